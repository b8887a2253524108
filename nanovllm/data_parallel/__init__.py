"""Data parallelism: N engine replicas on one host's GPUs (backend "mp") or on a Ray cluster (backend "ray"),
fed from one queue, results streamed back in finishing order. See docs/data_parallel.md."""
from nanovllm.data_parallel.driver import BACKENDS, DataParallel, ReplicasLost, iter_generate

__all__ = ["BACKENDS", "DataParallel", "ReplicasLost", "iter_generate"]
