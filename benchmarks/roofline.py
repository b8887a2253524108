"""The floor under bench.py's run time for a shape and workload on one GPU: what its memory bandwidth and matmul
throughput allow, with nothing else costing time. Needs no GPU.

    python benchmarks/roofline.py --shape Llama-3.1-8B [--workload default] [--bandwidth 4.8 --tflops 790]

Model of a run (bench.py's lengths, its seed): every request starts together; each decode step reads the weights
once (a MoE layer only the experts the step's tokens pick, in expectation) or does its matmul arithmetic, whichever
takes longer, and reads every running request's whole KV context; prefill is matmul arithmetic. Attention's own
arithmetic, the small kernels and the host are left out, so a measured run is slower by what they cost. The
defaults are an H200's: 4.8 TB/s of HBM, ~790 TFLOP/s of dense bf16 matmul.
"""
import argparse
import os
import sys
from dataclasses import dataclass
from random import randint, seed

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import WORKLOADS  # noqa: E402
from nanovllm.utils.random_checkpoint import SHAPES, model_config  # noqa: E402


@dataclass
class ModelBytes:
    linear_params: int  # attention and dense MLPs, all layers (FP8 with --fp8-weights)
    router_params: int  # MoE routers, all layers
    expert_params: int  # one expert of one MoE layer
    moe_layers: int
    experts: int
    experts_per_token: int
    head_params: int  # the LM head, used once per generated token
    kv_bytes_per_token: int
    fp8_weights: bool = False

    def expected_experts(self, tokens: int) -> float:
        """Distinct experts that `tokens` tokens pick in one MoE layer with uniform routing, in expectation."""
        return self.experts * (1 - (1 - self.experts_per_token / self.experts) ** tokens) if self.experts else 0

    def step_weight_bytes(self, tokens: int) -> float:
        experts = self.moe_layers * self.expected_experts(tokens) * self.expert_params
        # FP8 checkpoints keep the LM head and routers in bf16, and this engine multiplies MoE experts in bf16
        return self.linear_params * (1 if self.fp8_weights else 2) + 2 * (self.router_params + experts +
                                                                            self.head_params)

    def matmul_seconds(self, tokens: int, with_head: bool, bf16_flops: float) -> float:
        bf16 = self.router_params + self.moe_layers * self.experts_per_token * self.expert_params + \
            (self.head_params if with_head else 0)
        linear_flops = bf16_flops * (2 if self.fp8_weights else 1)
        return 2 * tokens * (self.linear_params / linear_flops + bf16 / bf16_flops)


def model_bytes(shape: str, layers: int | None, fp8_weights: bool, fp8_kv: bool) -> tuple[ModelBytes, int]:
    """The shape's sizes, and the largest token id bench.py draws for it."""
    c = model_config(shape, **({"num_hidden_layers": layers} if layers else {}))
    hidden, n_layers = c["hidden_size"], c["num_hidden_layers"]
    head_dim = c.get("head_dim") or hidden // c["num_attention_heads"]
    attention = hidden * head_dim * (2 * c["num_attention_heads"] + 2 * c["num_key_value_heads"])
    moe = c.get("num_experts", 0)
    mlp = 0 if moe else 3 * hidden * c["intermediate_size"]
    return ModelBytes(linear_params=n_layers * (attention + mlp), router_params=n_layers * moe * hidden,
                      expert_params=3 * hidden * c["moe_intermediate_size"] if moe else 0,
                      moe_layers=n_layers if moe else 0, experts=moe,
                      experts_per_token=c.get("num_experts_per_tok", 0), head_params=c["vocab_size"] * hidden,
                      kv_bytes_per_token=n_layers * c["num_key_value_heads"] * head_dim * 2 * (1 if fp8_kv else 2),
                      fp8_weights=fp8_weights), min(10000, c["vocab_size"] - 1)


def floor_seconds(model: ModelBytes, workload: dict, bandwidth: float, bf16_flops: float,
                  max_token_id: int) -> dict[str, float]:
    """Seconds of each part of the floor over one run of `workload` (bench.py's lengths)."""
    seed(0)  # bench.py draws each prompt's length, then its token ids, then the output lengths
    prompts = []
    for _ in range(workload["num_seqs"]):
        prompts.append(randint(workload["min_input_len"], workload["max_input_len"]))
        for _ in range(prompts[-1]):
            randint(0, max_token_id)
    outputs = [randint(workload["min_output_len"], workload["max_output_len"]) for _ in range(workload["num_seqs"])]
    prefill = model.matmul_seconds(sum(prompts), False, bf16_flops)
    matmuls = kv = 0.0
    for step in range(1, max(outputs)):  # the first token of each request comes from its prefill
        running = [p + step for p, o in zip(prompts, outputs) if o > step]
        tokens = len(running)
        matmuls += max(model.step_weight_bytes(tokens) / bandwidth, model.matmul_seconds(tokens, True, bf16_flops))
        kv += sum(running) * model.kv_bytes_per_token / bandwidth
    return {"prefill matmuls": prefill, "decode matmuls": matmuls, "decode KV reads": kv,
            "tokens": sum(outputs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="Qwen3-0.6B", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=None, help="a shape cut to this many layers")
    parser.add_argument("--workload", default="default", choices=sorted(WORKLOADS))
    parser.add_argument("--bandwidth", type=float, default=4.8, help="HBM TB/s (default: an H200's 4.8)")
    parser.add_argument("--tflops", type=float, default=790.0, help="dense bf16 matmul TFLOP/s (default: 790)")
    parser.add_argument("--fp8-weights", action="store_true",
                        help="1-byte attention and dense-MLP weights, multiplied at twice --tflops (the LM head, "
                             "routers and MoE experts stay bf16, as this engine runs them)")
    parser.add_argument("--fp8-kv", action="store_true", help="a 1-byte KV cache")
    args = parser.parse_args()
    if args.layers is not None and args.layers < 1:
        parser.error(f"--layers {args.layers}: a model needs at least 1 layer")
    model, max_token_id = model_bytes(args.shape, args.layers, args.fp8_weights, args.fp8_kv)
    parts = floor_seconds(model, WORKLOADS[args.workload], args.bandwidth * 1e12, args.tflops * 1e12, max_token_id)
    tokens = parts.pop("tokens")
    total = sum(parts.values())
    variant = "".join(f", {name}" for name, on in (("FP8 weights", args.fp8_weights), ("FP8 KV", args.fp8_kv)) if on)
    print(f"{args.shape}{f' ({args.layers} layers)' if args.layers else ''}{variant}, workload {args.workload}: "
          + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in parts.items())
          + f"; floor {total:.2f} s = {tokens / total:,.0f} output tok/s")


if __name__ == "__main__":
    main()
