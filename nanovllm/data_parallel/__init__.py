"""Data parallelism: N engine replicas on one host's GPUs (backend "mp") or on a Ray cluster (backend "ray"),
fed from one queue, results streamed back in finishing order. See docs/data_parallel.md.

The names load on first use (PEP 562), as the package's own: run-batch may launch its replicas
(data_parallel.processes, ray_actors) before it imports the engine, which the driver module needs."""
from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nanovllm.data_parallel.driver import BACKENDS, DataParallel, ReplicasLost, iter_generate

__all__ = ["BACKENDS", "DataParallel", "ReplicasLost", "iter_generate"]


def __getattr__(name: str) -> object:
    if name not in __all__:
        raise AttributeError(f"module 'nanovllm.data_parallel' has no attribute {name!r}")
    value = getattr(import_module("nanovllm.data_parallel.driver"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
