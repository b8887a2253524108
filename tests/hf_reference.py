"""Check our tokens against transformers' Qwen3 on the same weights."""
import torch


@torch.inference_mode()
def hf_greedy(hf_model, prompt: list[int], max_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    # an explicit mask: otherwise transformers masks every prompt token equal to the pad id
    out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                            min_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@torch.inference_mode()
def assert_teacher_forced_greedy(hf_model, prompt: list[int], completion: list[int], margin: float = 1e-3) -> int:
    """Every token we chose must be transformers' argmax given our own history, or within `margin` of it
    (a near-tie that float noise may break either way). Returns how many near-ties were accepted."""
    ids = torch.tensor([prompt + completion[:-1]])
    logits = hf_model(ids).logits[0, len(prompt) - 1:].float()
    near_ties = 0
    for i, token in enumerate(completion):
        best = int(logits[i].argmax())
        if token != best:
            gap = float(logits[i, best] - logits[i, token])
            assert gap < margin, f"token {i}: ours {token}, transformers' argmax {best}, logit gap {gap:.3g}"
            near_ties += 1
    return near_ties


def assert_no_leaks(llm) -> None:
    bm = llm.scheduler.block_manager
    assert llm.scheduler.is_finished()
    assert len(bm.free_block_ids) == bm.num_blocks and not bm.used_block_ids
    assert all(block.ref_count == 0 for block in bm.blocks)
