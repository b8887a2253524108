"""Where a run-batch driver's "process start and imports" go, step by step, in a fresh process:

    python benchmarks/startup_probe.py [--model DIR]

Each step's seconds and whether the CUDA driver is initialised after it (a data-parallel driver forks its replicas
only while it is not: nanovllm/data_parallel/processes.py). The steps are what run-batch's driver does before it
launches replicas (interpreter start, torch, Triton, transformers, the package, the config check), then what it
no longer does at import (torch.compile of a function, which imports TorchDynamo and Inductor) and GPU counting.
Run it in the environment the engine runs in; one process, so each step pays only what the ones before left.
"""
import argparse
import ctypes
import importlib.util
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


# Importing any of nanovllm imports the engine (nanovllm/__init__.py): engine/startup.py (standard library only) is
# loaded from its file, and processes.cuda_driver_initialised's question is asked here with ctypes.
_spec = importlib.util.spec_from_file_location("_startup", os.path.join(ROOT, "nanovllm", "engine", "startup.py"))
startup = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(startup)


def cuda_driver_initialised() -> bool:
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    count = ctypes.c_int()
    return libcuda.cuDeviceGetCount(ctypes.byref(count)) != 3  # CUDA_ERROR_NOT_INITIALIZED until cuInit


def steps(model: str | None) -> list[tuple[str, object]]:
    def config_check():
        from nanovllm.engine.config_checks import checked_config

        checked_config(model)

    def count_gpus():
        from nanovllm.data_parallel.processes import visible_gpus

        return visible_gpus()

    def compile_a_function():
        import torch

        torch.compile(lambda x: x + 1, dynamic=True)

    named = [("import torch", lambda: __import__("torch")), ("import triton", lambda: __import__("triton")),
             ("import transformers", lambda: __import__("transformers")),
             ("import nanovllm.llm", lambda: __import__("nanovllm.llm")),
             ("import nanovllm.batch.run", lambda: __import__("nanovllm.batch.run"))]
    if model:
        named.append(("config check (checked_config)", config_check))
    named += [("torch.compile(f) (no call)", compile_a_function), ("count GPUs (visible_gpus)", count_gpus)]
    return named


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a checkpoint folder, for the config check step")
    args = parser.parse_args()
    began = startup.process_started()
    now = time.time()
    print("| step | seconds | CUDA driver initialised after it |\n| --- | --- | --- |")
    if began is not None:
        print(f"| interpreter start, to this script's first line | {now - began:.2f} | {cuda_driver_initialised()} |")
    for name, step in steps(args.model):
        start = time.time()
        try:
            step()
            outcome = ""
        except Exception as error:  # a probe: say what failed and go on to the next step
            outcome = f" (failed: {type(error).__name__}: {error})"
        print(f"| {name}{outcome} | {time.time() - start:.2f} | {cuda_driver_initialised()} |", flush=True)


if __name__ == "__main__":
    main()
