import os
import signal

import pytest
import torch

# Without a GPU, Triton kernels run in its interpreter on CPU tensors; it must be chosen before they are defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from nanovllm.utils.random_checkpoint import write_random_checkpoint  # noqa: E402

# Some tests press Ctrl-C themselves (SIGINT to their own process) and expect a terminal foreground job's response.
# A background job of a non-interactive shell starts with SIGINT ignored, which those interrupts would then meet:
# the suite restores the default. (Replicas stopped by their driver do not depend on it: tests/
# test_data_parallel_startup.py runs a driver that ignores SIGINT.)
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
