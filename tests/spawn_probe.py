"""Imported by a spawned process in test_data_parallel: what its environment held when its modules were imported."""
import os

AT_IMPORT = os.environ.get("CUDA_VISIBLE_DEVICES")


def report(queue) -> None:
    queue.put(AT_IMPORT)
