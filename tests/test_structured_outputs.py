"""Structured outputs (xgrammar) on CPU: the spec's checks, outputs that parse and match their spec, greedy equal to
transformers under the same mask, free rows untouched by constrained ones, and the engine's edges (compile errors
before any work, padded vocabularies, whitespace bounds, one compile per distinct spec)."""
import json
import re
import threading

import pytest
import torch
import xgrammar as xgr
from hf_reference import assert_no_leaks
from transformers import AutoModelForCausalLM, AutoTokenizer

from nanovllm import LLM, SamplingParams, StructuredOutputsParams
from nanovllm.sampling.grammar import JSON_WHITESPACE_LIMIT, GrammarCompiler
from nanovllm.sampling.grammar_mask import GrammarMasks
from nanovllm.utils.random_checkpoint import write_random_checkpoint

PADDING = 24  # model rows past the tokenizer's last token
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
    "required": ["name", "age", "ok", "color"], "additionalProperties": False}
REGEX = r"[a-c]{2}-\d{1,3}"
CHOICES = ["yes", "no", 'say "maybe"', "a\\b"]
GRAMMAR = 'root ::= "(" [0-9]{1,4} ("+" [0-9]{1,4}){0,3} ")"'
SPECS = {"json": StructuredOutputsParams(json=SCHEMA),
         "json_text_compact": StructuredOutputsParams(json=json.dumps(SCHEMA), disable_any_whitespace=True),
         "regex": StructuredOutputsParams(regex=REGEX), "choice": StructuredOutputsParams(choice=CHOICES),
         "grammar": StructuredOutputsParams(grammar=GRAMMAR), "json_object": StructuredOutputsParams(json_object=True)}


@pytest.fixture(scope="module")
def padded_model(tmp_path_factory) -> str:
    return write_random_checkpoint(str(tmp_path_factory.mktemp("qwen3-tiny-padded")), "tiny", seed=3,
                                   vocab_padding=PADDING)


@pytest.fixture(scope="module")
def llm(padded_model):
    with LLM(padded_model, num_kvcache_blocks=48, max_model_len=1024) as engine:
        yield engine


class Row:
    """What the mask reads of a request (sampling/rows.py): no prompt, the tokens generated so far."""

    def __init__(self, seq_id: int, grammar) -> None:
        self.seq_id, self.grammar, self.token_ids, self.num_prompt_tokens = seq_id, grammar, [], 0

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


def masks_and_rows(padded_model: str, names: list[str]):
    """The tokenizer, its grammar compiler (close it), one constrained row per SPECS name, and mask buffers for 8
    rows on the host, over a vocabulary of 1,024 ids."""
    from nanovllm.sampling.grammar import GrammarState

    tokenizer = AutoTokenizer.from_pretrained(padded_model)
    compiler = GrammarCompiler(tokenizer, 1024, [tokenizer.eos_token_id])
    rows = [Row(i, GrammarState(compiler.submit(SPECS[name]))) for i, name in enumerate(names)]
    return tokenizer, compiler, rows, GrammarMasks(1024, 8, torch.device("cpu"), [tokenizer.eos_token_id])


def sample_a_step(masks: GrammarMasks, batch: list[Row], eos: int) -> None:
    """One step of the host path, as the engine takes it: the step's mask (each row's must be xgrammar's own for
    its matcher), each row's first allowed token but the end (the end once nothing else is allowed), the tokens
    to the matchers and the fill ahead, waited for (done, or failed)."""
    mask = masks.finish(masks.start(batch, lambda: {}))
    logits = torch.zeros(len(batch), masks.vocab_size)
    mask.apply(logits)
    tokens = []
    for i, row in enumerate(batch):
        assert torch.equal(logits[i], own_masked_logits(row.grammar.matcher, masks.vocab_size)), f"row {row.seq_id}"
        allowed = torch.isfinite(logits[i]).nonzero().flatten()
        going_on = allowed[allowed != eos]
        tokens.append(int(going_on[0]) if len(going_on) else eos)
        row.token_ids = row.token_ids + [tokens[-1]]
    masks.after_sample(batch, [True] * len(batch), lambda: tokens)
    masks.worker.submit(lambda: None).result()


def own_masked_logits(matcher, vocab: int) -> torch.Tensor:
    """Zero logits with xgrammar's own mask for `matcher`'s next token applied (-inf where refused)."""
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    matcher.fill_next_token_bitmask(bitmask)
    logits = torch.zeros(1, vocab)
    xgr.apply_token_bitmask_inplace(logits, bitmask)
    return logits[0]


def check_schema(value) -> None:
    """SCHEMA's rules, checked by hand (no validator needed where the GPU tests run)."""
    assert isinstance(value, dict) and set(value) == {"name", "age", "ok", "color"}, value
    assert isinstance(value["name"], str) and len(value["name"]) <= 6, value
    assert type(value["age"]) is int and 0 <= value["age"] <= 120, value
    assert type(value["ok"]) is bool and value["color"] in ("red", "green", "blue"), value


def check_matches(kind: str, text: str) -> None:
    if kind.startswith("json") and kind != "json_object":
        # strict=False: xgrammar lets a string with maxLength hold control characters, which strict JSON refuses
        check_schema(json.loads(text, strict=False))
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    else:
        assert re.fullmatch(r"\(\d{1,4}(\+\d{1,4}){0,3}\)", text), text


def test_the_spec_is_checked_when_made():
    from nanovllm.sampling_params import StructuredOutputsParams as same  # vLLM's module path too
    assert same is StructuredOutputsParams
    with pytest.raises(ValueError, match="exactly one of json, regex, choice, grammar, json_object; got none"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="got json and regex"):
        StructuredOutputsParams(json=SCHEMA, regex="a")
    with pytest.raises(ValueError, match=r"choice=\[\] is out of range"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="whitespace_pattern.*xgrammar has no whitespace pattern"):
        StructuredOutputsParams(json=SCHEMA, whitespace_pattern=r"[ ]?")
    with pytest.raises(ValueError, match="json=3 is out of range"):
        StructuredOutputsParams(json=3)
    spec = StructuredOutputsParams(regex="a+")
    for name, value in (("ignore_eos", True), ("min_tokens", 2)):
        with pytest.raises(ValueError, match=f"SamplingParams.{name}={value!r} cannot be combined with "
                                             f"structured_outputs"):
            SamplingParams(structured_outputs=spec, **{name: value})
    with pytest.raises(ValueError, match="structured_outputs='a' is out of range"):
        SamplingParams(structured_outputs="a")


def test_every_kind_parses_and_matches_its_spec_with_n_samples(llm):
    kinds = list(SPECS)
    params = [SamplingParams(temperature=1.0, seed=i, n=3, max_tokens=200, structured_outputs=SPECS[kind])
              for i, kind in enumerate(kinds)]
    outputs = llm.generate(["Give me data:"] * len(kinds), params, use_tqdm=False)
    for kind, output in zip(kinds, outputs):
        assert len(output.outputs) == 3
        for sample in output.outputs:
            if kind == "json_object" and sample.finish_reason == "length":
                continue  # any object: a random model's strings need not end (the matcher test below covers it)
            assert sample.finish_reason == "stop", (kind, sample.text)
            check_matches(kind, sample.text)
            assert all(t < llm.config.hf_config.vocab_size - PADDING for t in sample.token_ids)
    compact = outputs[kinds.index("json_text_compact")].outputs[0].text
    assert not re.search(r"\s", compact.replace(json.loads(compact, strict=False)["name"], "")), compact
    assert_no_leaks(llm)


def test_a_reply_cut_by_max_tokens_is_returned_as_it_is(llm):
    out = llm.generate(["x"], SamplingParams(temperature=0, max_tokens=3,
                                             structured_outputs=SPECS["json"]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3 and out.text.startswith("{")


def hf_constrained_greedy(hf_model, tokenizer, vocab_size: int, prompt: list[int], spec, max_tokens: int) -> list[int]:
    """transformers' model, xgrammar's mask applied by hand to each step's logits, argmax."""
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                              stop_token_ids=[tokenizer.eos_token_id])
    compiled = xgr.GrammarCompiler(info).compile_json_schema(spec, any_whitespace=True,
                                                             max_whitespace_cnt=JSON_WHITESPACE_LIMIT)
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    ids = list(prompt)
    for _ in range(max_tokens):
        logits = hf_model(torch.tensor([ids])).logits[:, -1].float()
        matcher.fill_next_token_bitmask(bitmask)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        token = int(logits.argmax())
        ids.append(token)
        if token == tokenizer.eos_token_id:
            break
        assert matcher.accept_token(token)
    return ids[len(prompt):]


def test_constrained_greedy_equals_transformers_with_the_mask_by_hand(llm, padded_model):
    hf_model = AutoModelForCausalLM.from_pretrained(padded_model).eval()
    tokenizer = AutoTokenizer.from_pretrained(padded_model)
    prompts = [[5, 17, 300], [900, 2, 44, 61, 7], [12]]
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=SPECS["json"])
    ours = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)]
    with torch.no_grad():
        theirs = [hf_constrained_greedy(hf_model, tokenizer, llm.config.hf_config.vocab_size, p, SCHEMA, 40)
                  for p in prompts]
    assert ours == theirs


def test_free_rows_are_untouched_by_constrained_rows_through_preemption_chunks_and_prefix_hits(padded_model):
    # a cache too small for every request at once (preemption), a prefill budget below the longest prompt
    # (chunked prefill), and prompts that share a prefix (prefix-cache hits)
    shared = list(range(40, 340))
    free_prompts = [shared + [7, i] for i in range(4)] + [list(range(500, 780))]
    free = [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
            SamplingParams(temperature=0.9, seed=11, max_tokens=48, ignore_eos=True, n=2)]
    free_params = [free[i % 2] for i in range(len(free_prompts))]
    options = dict(num_kvcache_blocks=14, kvcache_block_size=64, max_num_batched_tokens=256, max_model_len=1024)
    with LLM(padded_model, **options) as alone:
        expected = [[c.token_ids for c in o.outputs] for o in alone.generate(free_prompts, free_params,
                                                                             use_tqdm=False)]
    constrained = [SamplingParams(temperature=0.8, seed=i, n=2, max_tokens=120, structured_outputs=spec)
                   for i, spec in enumerate(SPECS.values())]
    with LLM(padded_model, **options) as mixed:
        preempted = []
        original = mixed.scheduler._preempt
        mixed.scheduler._preempt = lambda seq: (preempted.append(seq), original(seq))[1]
        prompts = [p for pair in zip(free_prompts, [shared + [9, i] for i in range(5)]) for p in pair]
        params = [p for pair in zip(free_params, constrained) for p in pair] + constrained[5:]
        prompts += [shared + [1]] * (len(params) - len(prompts))
        outputs = mixed.generate(prompts, params, use_tqdm=False)
        assert preempted, "the cache was meant to be too small for every request at once"
        assert [[c.token_ids for c in o.outputs] for o in outputs[0::2][:len(free_prompts)]] == expected
        kinds = list(SPECS)
        for i, output in enumerate([*outputs[1::2], *outputs[2 * len(free_prompts):]][:len(kinds)]):
            for sample in output.outputs:
                if sample.finish_reason == "stop":
                    check_matches(kinds[i], sample.text)
        assert_no_leaks(mixed)


def test_a_spec_that_does_not_compile_fails_before_any_work_and_the_engine_goes_on(llm):
    good = SamplingParams(temperature=0, max_tokens=4)
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(ab"))
    generated = llm.token_counter.generated
    with pytest.raises(ValueError, match="structured_outputs regex does not compile: Regex parsing error at "
                                         "position 4: The parenthesis is not closed"):
        llm.generate(["a", "b"], [good, bad], use_tqdm=False)
    assert llm.token_counter.generated == generated  # nothing ran
    assert llm.scheduler.is_finished()
    bad_schema = SamplingParams(structured_outputs=StructuredOutputsParams(json='{"type": "object", '))
    results = dict(llm.iter_generate(["a", "b", "c"], iter([good, bad_schema, good]), errors="yield"))
    assert isinstance(results[1], ValueError) and "json does not compile: Failed to parse JSON" in str(results[1])
    assert [len(results[i].outputs[0].token_ids) for i in (0, 2)] == [4, 4]
    assert_no_leaks(llm)


def test_identical_specs_compile_once_and_distinct_ones_apart(padded_model):
    tokenizer = AutoTokenizer.from_pretrained(padded_model)
    compiler = GrammarCompiler(tokenizer, 1024, [tokenizer.eos_token_id])
    reordered = dict(reversed(list(SCHEMA.items())))
    first = compiler.submit(StructuredOutputsParams(json=SCHEMA))
    assert compiler.submit(StructuredOutputsParams(json=reordered)) is first
    assert compiler.submit(StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)) is not first
    assert compiler.submit(StructuredOutputsParams(regex="a")) is not compiler.submit(StructuredOutputsParams(
        regex="b"))
    compiler.close()


def test_json_whitespace_is_bounded_and_compact_has_none(padded_model):
    tokenizer = AutoTokenizer.from_pretrained(padded_model)
    compiler = GrammarCompiler(tokenizer, 1024, [tokenizer.eos_token_id])

    def accepts(spec: StructuredOutputsParams, text: str) -> bool:
        return xgr.GrammarMatcher(compiler.submit(spec).result()).accept_string(text)

    loose, compact = SPECS["json"], StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    assert accepts(loose, "{" + " " * JSON_WHITESPACE_LIMIT + '"name"')
    assert not accepts(loose, "{" + " " * (JSON_WHITESPACE_LIMIT + 1) + '"name"')
    assert accepts(compact, '{"name":"ab","age":3')
    assert not accepts(compact, '{ "name"') and not accepts(compact, '{"name": "ab"')
    any_object = StructuredOutputsParams(json_object=True)
    assert accepts(any_object, '{"k": [1, {"x": null}], "other": "v"}') and accepts(any_object, "{}")
    assert not accepts(any_object, "[1]") and not accepts(any_object, '"text"')
    compiler.close()


def test_the_mask_covers_the_padded_rows_and_leaves_free_rows(padded_model):
    tokenizer = AutoTokenizer.from_pretrained(padded_model)
    vocab = 1024
    compiler = GrammarCompiler(tokenizer, vocab, [tokenizer.eos_token_id])

    from nanovllm.sampling.grammar import GrammarState
    rows = [Row(0, None), Row(1, GrammarState(compiler.submit(StructuredOutputsParams(choice=["yes", "no"])))),
            Row(2, None)]
    masks = GrammarMasks(vocab, 8, torch.device("cpu"), [tokenizer.eos_token_id])
    mask = masks.finish(masks.start(rows, lambda: {}))
    logits = torch.zeros(3, vocab)
    logits[:, vocab - PADDING:] = 100.0  # padded rows a random head may well favour
    mask.apply(logits)
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert allowed == sorted({tokenizer.encode(w)[0] for w in ("yes", "no")})
    assert torch.equal(logits[0], logits[2]) and torch.isfinite(logits[0]).all()
    compiler.close()


@pytest.mark.parametrize("public_accept", [False, True])
def test_masks_step_by_step_equal_xgrammar_own(padded_model, public_accept):
    """The host path, step after step: every step's mask equals xgrammar's own, each matcher took its own row's
    tokens, and one that took the end is marked terminated; also with xgrammar's public batch accept (what an
    xgrammar whose binding differs gets)."""
    _masks_step_by_step(padded_model, torch.device("cpu"), public_accept)


def test_a_row_that_sat_out_a_step_keeps_the_mask_filled_ahead_for_it(padded_model):
    """Rows A and B sample a step, a step of only a new request C follows (a prefill of others), then all three
    sample: A's and B's masks, filled ahead after their step into the other buffer, are used as they are, and only
    C's first mask is filled when its step starts. Each step's mask equals xgrammar's own."""
    tokenizer, compiler, (a, b, c), masks = masks_and_rows(padded_model, ["json_text_compact", "regex", "choice"])
    filled = []  # per fill of rows: how many, the step's start's first
    fill_rows = masks._fill_rows
    masks._fill_rows = lambda turn, states, first: (filled.append(len(states)), fill_rows(turn, states, first))

    def step(batch: list[Row]) -> None:
        filled.clear()
        sample_a_step(masks, batch, tokenizer.eos_token_id)

    step([a, b])
    step([c])
    assert filled == [1, 1]  # C's first mask at the start, its next one ahead
    step([a, b, c])
    assert filled == [0, 3], "A's and B's masks were filled again at the step's start"
    step([a, b, c])
    compiler.close()


def test_a_fill_ahead_that_fails_midway_leaves_no_row_reading_its_half_written_buffer(padded_model):
    """Row S samples one step, then sits out two (a prefill of others); the second of A's and B's fills ahead goes
    into the buffer that holds S's mask, writes over it, and fails. When all three sample again, S's mask is
    filled anew, not read from that buffer, and A's and B's matchers catch up: every mask is xgrammar's own."""
    tokenizer, compiler, (sat_out, a, b), masks = masks_and_rows(padded_model,
                                                                  ["json_text_compact", "regex", "choice"])
    fill_rows, failing = masks._fill_rows, [False]

    def half_written(turn, states, first):
        if failing[0] and first == 0:  # a fill ahead: its rows are written over, then xgrammar fails
            masks.host[turn][:len(states)] = 0
            raise RuntimeError("fill failed")
        fill_rows(turn, states, first)
    masks._fill_rows = half_written

    def step(batch: list[Row]) -> None:
        sample_a_step(masks, batch, tokenizer.eos_token_id)

    step([sat_out, a, b])  # S's next mask: row 0 of the buffer filled ahead
    step([a, b])
    failing[0] = True
    step([a, b])  # its fill ahead goes to S's buffer, writes rows 0 and 1, fails
    failing[0] = False
    step([sat_out, a, b])
    compiler.close()


def test_a_token_its_mask_refused_ends_that_row_only(padded_model):
    """A row whose sampled token its mask did not allow (every allowed token banned, say) is marked rejected and may
    only end; the row beside it, whose token was allowed, goes on as xgrammar's own matcher would."""
    tokenizer, compiler, (bad, good), masks = masks_and_rows(padded_model, ["choice", "regex"])
    vocab = 1024
    logits = torch.zeros(2, vocab)
    masks.finish(masks.start([bad, good], lambda: {})).apply(logits)
    refused = int(torch.isinf(logits[0]).nonzero()[0])
    allowed = int(torch.isfinite(logits[1]).nonzero()[-1])
    bad.token_ids, good.token_ids = [refused], [allowed]
    masks.after_sample([bad, good], [True, True], lambda: [refused, allowed])
    logits = torch.zeros(2, vocab)
    masks.finish(masks.start([bad, good], lambda: {})).apply(logits)
    assert bad.grammar.rejected and not good.grammar.rejected
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [tokenizer.eos_token_id]
    own = xgr.GrammarMatcher(good.grammar.compiled.result())
    assert own.accept_token(allowed)
    assert torch.equal(logits[1], own_masked_logits(own, vocab))
    compiler.close()


def test_a_row_whose_request_ended_before_its_mask_is_filled_gets_a_stop_only_mask(padded_model):
    """A matcher behind its row's tokens (no fill ahead took them) whose request ends while the step's mask waits
    for the worker (the engine cuts the token slots past the end): the step still gets its mask, that row's
    allowing only the end, and the row beside it is xgrammar's own."""
    tokenizer, compiler, (ended, going), masks = masks_and_rows(padded_model, ["regex", "choice"])
    vocab = 1024
    logits = torch.zeros(2, vocab)
    masks.finish(masks.start([ended, going], lambda: {})).apply(logits)
    ended.token_ids, going.token_ids = ([int(torch.isfinite(row).nonzero()[0])] for row in logits)
    hold = threading.Event()
    masks.worker.submit(hold.wait)  # the worker is busy while the next step starts
    started = masks.start([ended, going], lambda: {})
    ended.token_ids = []  # its request ended meanwhile
    hold.set()
    logits = torch.zeros(2, vocab)
    masks.finish(started).apply(logits)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [tokenizer.eos_token_id]
    own = xgr.GrammarMatcher(going.grammar.compiled.result())
    assert own.accept_token(going.token_ids[0])
    assert torch.equal(logits[1], own_masked_logits(own, vocab))
    compiler.close()


def test_a_bigger_batch_takes_over_the_matchers_after_the_last_fill_ahead(padded_model):
    """A constrained batch wider than the mask buffers makes new ones, while the old worker may still wait for the
    step in flight's tokens to take them into the same matchers: the new buffers wait for it, so each token is
    taken once and the next mask is xgrammar's own."""
    tokenizer = AutoTokenizer.from_pretrained(padded_model)
    vocab = 1024
    compiler = GrammarCompiler(tokenizer, vocab, [tokenizer.eos_token_id])
    from nanovllm.sampling.grammar import GrammarState
    from nanovllm.sampling.sampler import Sampler

    row = Row(0, GrammarState(compiler.submit(SPECS["regex"])))
    sampler = Sampler([tokenizer.eos_token_id])
    logits = torch.zeros(1, vocab)
    sampler.finish_grammar_mask(sampler.grammar_mask([row], logits, lambda: {})).apply(logits)
    token = int(torch.isfinite(logits[0]).nonzero()[0])
    row.token_ids = [token]
    arrived = threading.Event()  # the step's tokens, still on the device for a moment
    threading.Timer(0.3, arrived.set).start()
    sampler.grammar_after_sample([row], [True], lambda: (arrived.wait(), [token])[1])
    old = sampler.grammar_masks
    wide = [row] + [Row(i, None) for i in range(1, old.max_rows + 1)]
    logits = torch.zeros(len(wide), vocab)
    sampler.finish_grammar_mask(sampler.grammar_mask(wide, logits, lambda: {})).apply(logits)
    assert sampler.grammar_masks is not old
    old.worker.shutdown(wait=True)  # whatever the old worker still had to do is done
    assert row.grammar.num_accepted == 1
    own = xgr.GrammarMatcher(row.grammar.compiled.result())
    assert own.accept_token(token)
    for matcher in (own, row.grammar.matcher):
        assert torch.equal(logits[0], own_masked_logits(matcher, vocab))
    compiler.close()


@pytest.mark.gpu
def test_gpu_mask_through_pinned_buffers_equals_the_host_mask(padded_model):
    """The device path, step after step (both pinned buffers in turn; a constrained subset scattered by row, and
    every row constrained; rows sitting out a step; masks filled ahead after a step's sampling, or at the next
    start): the logits it masks
    on the GPU equal xgrammar's CPU masking of the same logits."""
    _masks_step_by_step(padded_model, torch.device("cuda"))


def _masks_step_by_step(padded_model: str, device: torch.device, public_accept: bool = False) -> None:
    tokenizer = AutoTokenizer.from_pretrained(padded_model)
    vocab = 1024
    compiler = GrammarCompiler(tokenizer, vocab, [tokenizer.eos_token_id])
    from nanovllm.sampling.grammar import GrammarState

    specs = list(SPECS.values())
    rows = [Row(i, None if i % 3 == 0 else GrammarState(compiler.submit(specs[i % len(specs)]))) for i in range(9)]
    masks = GrammarMasks(vocab, 16, device, [tokenizer.eos_token_id])
    assert masks.core is not None, "this xgrammar changed the binding accept_binding calls: the fast accept is off"
    assert masks.fill_binding is not None, "this xgrammar changed the binding fill_binding calls: the fast fill is off"
    if public_accept:  # and the public fill
        masks.core = masks.fill_binding = None
    generator = torch.Generator().manual_seed(0)
    for step in range(12):
        batch = rows if step % 2 == 0 else [r for r in rows if r.grammar is not None]  # all, then a subset
        if step % 4 == 3:  # some constrained rows sit out a step (a prefill of other requests)
            batch = [r for r in batch if r.seq_id % 2 == 0]
        logits = torch.randn(len(batch), vocab, generator=generator)
        mask = masks.finish(masks.start(batch, lambda: {}))
        on_device = logits.to(device)
        mask.apply(on_device)
        expected = logits.clone()
        for i, row in enumerate(batch):
            if row.grammar is not None and row.grammar.matcher.is_terminated():  # it may only end (again)
                end = expected[i, tokenizer.eos_token_id].item()
                expected[i] = -float("inf")
                expected[i, tokenizer.eos_token_id] = end
            elif row.grammar is not None:
                bitmask = xgr.allocate_token_bitmask(1, vocab)
                row.grammar.matcher.fill_next_token_bitmask(bitmask)
                xgr.apply_token_bitmask_inplace(expected[i:i + 1], bitmask)
        assert torch.equal(on_device.cpu(), expected), f"step {step}"
        sampled = []
        for i, row in enumerate(batch):  # each row takes its best allowed token but the end, as a step would
            scores = expected[i].clone()
            scores[tokenizer.eos_token_id] = -float("inf")
            sampled.append(int(scores.argmax()))
            if row.grammar is not None and not torch.isfinite(scores.max()):
                sampled[-1] = tokenizer.eos_token_id  # the grammar is complete
            row.token_ids = row.token_ids + [sampled[-1]]
        if step % 3 != 2:  # the matchers take the tokens and fill ahead; every third step they wait for start
            masks.after_sample(batch, [True] * len(batch), lambda sampled=sampled: sampled)
    masks.finish(masks.start(rows, lambda: {}))  # every matcher takes the last step's tokens
    for row in rows:
        if row.grammar is not None:
            fresh = xgr.GrammarMatcher(row.grammar.compiled.result())
            taken = row.token_ids[:row.grammar.num_accepted]
            assert len(taken) == len(row.token_ids)
            assert all(fresh.accept_token(t) for t in taken if not fresh.is_terminated())
            assert not row.grammar.rejected and row.grammar.terminated == fresh.is_terminated()
    compiler.close()


@pytest.mark.gpu
def test_gpu_engine_constrains_its_rows_and_runs_the_free_ones_whole(small_model):
    """CUDA graphs and async scheduling with constrained and free rows in one batch. (Free rows equal to a run
    without the constrained ones is checked on CPU, where logits do not depend on the batch's size.)"""
    prompts = [[1000 + 37 * i + j for j in range(20 + 9 * i)] for i in range(12)]
    free = SamplingParams(temperature=0.7, seed=5, max_tokens=64, ignore_eos=True)
    kinds = list(SPECS)
    params = [free if i % 2 == 0 else SamplingParams(temperature=0.7, seed=i, max_tokens=300,
                                                     structured_outputs=SPECS[kinds[(i // 2) % len(kinds)]])
              for i in range(len(prompts))]
    with LLM(small_model, max_model_len=1024) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 64 for o in outputs[0::2])
        for i, output in enumerate(outputs[1::2]):
            sample = output.outputs[0]
            if sample.finish_reason == "stop":
                check_matches(kinds[i % len(kinds)], sample.text)
            else:
                assert kinds[i % len(kinds)] == "json_object", sample.text
        assert_no_leaks(llm)
