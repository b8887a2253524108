"""What start-up prepares the first requests' sampling for. ModelRunner.first_serving_passes runs these passes dry
on a GPU (utils/parallel_compile.py), so that their Triton variants compile side by side before the first request
rather than on the engine's thread in the middle of a run."""
from dataclasses import replace

import torch

from nanovllm.engine.sequence import Sequence
from nanovllm.sampling.sampler import Sampler
from nanovllm.sampling_params import SamplingParams


def first_request_settings(model_dir: str) -> list[SamplingParams]:
    """Plain sampling, a repetition penalty (which turns the logits to float32: another variant of the draw) and the
    checkpoint's generation_config defaults, each with and without a seed, each once."""
    settings = [SamplingParams(), SamplingParams(repetition_penalty=1.1)]
    try:
        settings.append(SamplingParams.from_generation_config(model_dir))
    except ValueError:  # a setting SamplingParams refuses: get_default_sampling_params() raises it by name
        pass
    settings = [replace(params, seed=seed) for params in settings for seed in (None, 0)]
    return [params for i, params in enumerate(settings) if params not in settings[:i]]


def prefill_sequence(params: SamplingParams, block_size: int) -> Sequence:
    """A prompt of 3 tokens whose prefill writes its KV into block 0, which holds nothing yet at start-up."""
    seq = Sequence([0, 1, 2], params, block_size=block_size)
    seq.block_table, seq.num_scheduled_tokens = [0], 3
    return seq


def decode_rows(params: SamplingParams, block_size: int) -> list[Sequence]:
    """Two requests one token into their completions, as a decode step samples them: two, since a row count of 1
    is a variant of its own for some kernels and must not be the only one met."""
    rows = [Sequence([0, 1, 2], params, block_size=block_size) for _ in range(2)]
    for seq in rows:
        seq.append_token(3)
    return rows


def sample_decode_steps(sampler: Sampler, settings: list[SamplingParams], vocab_size: int, dtype: torch.dtype,
                        block_size: int) -> None:
    """A decode step's sampling for each setting, as the engine's would run it: logits of the model's dtype, and the
    fed tokens (which a penalty counts) int32 at the start of a buffer, as a decode step's input ids are."""
    fed = torch.zeros(2, dtype=torch.int32, device=sampler.device)
    logits = torch.zeros(2, vocab_size, dtype=dtype, device=sampler.device)
    for params in settings:
        sampler(logits, sampler.prepare(decode_rows(params, block_size), fed))
