import os
import signal

import pytest
import torch

# Without a GPU, Triton kernels run in its interpreter on CPU tensors; it must be chosen before they are defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from nanovllm.utils.random_checkpoint import write_random_checkpoint  # noqa: E402

# The tests that stop replicas with Ctrl-C (as run-batch does after a failure) assume a terminal's foreground job. A
# background job of a non-interactive shell starts with SIGINT ignored, which every process below would inherit:
# its replicas would then wait out JOIN_S before being killed, and an interrupt would never arrive
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU with flash-attn: tests/run_gpu.sh runs these on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return write_random_checkpoint(str(tmp_path_factory.mktemp("qwen3-tiny")), "tiny", seed=0)


@pytest.fixture(scope="session")
def small_model(tmp_path_factory) -> str:
    """Qwen3-0.6B-shaped random weights (the shape flash-attn's trimmed GPU build supports), spread wide enough for
    peaked logits."""
    return write_random_checkpoint(str(tmp_path_factory.mktemp("qwen3-0.6b")), "Qwen3-0.6B", std=0.05, seed=1)


@pytest.fixture(scope="session")
def hf_model(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model).eval()
