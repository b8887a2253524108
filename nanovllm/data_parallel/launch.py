"""Replicas launched before the driver imports the engine. run-batch asks for its replicas first thing, so their
start-up (imports, model, compile, CUDA graphs) runs while the driver itself imports torch, transformers and the
engine, rather than after: the driver's imports took as long as a replica's whole import. This module and what it
imports (processes.py, engine/startup.py) need neither torch nor the engine; the engine is named, not imported,
for the replicas to import themselves."""
from dataclasses import dataclass

from nanovllm.engine.startup import StartupTimes

from .processes import ProcessReplicas

ENGINE = "nanovllm.llm:LLM"


@dataclass
class LaunchedReplicas:
    replicas: ProcessReplicas
    startup: StartupTimes  # the driver's, begun before the launch: DataParallel carries it on


def launched_phase(replicas, backend: str) -> str:
    """The driver's start-up phase that launching `replicas` took, named for the start-up line."""
    if backend != "mp":
        return "Ray and replicas launched"
    spawned = getattr(replicas, "spawn_reason", "")
    return "replicas launched" + (f", spawned: {spawned}" if spawned else "")


def launch_replicas(model: str, data_parallel_size: int, options: dict) -> LaunchedReplicas:
    """Start data_parallel_size processes of LLM(model, **options) on this host (backend "mp"), forked where safe;
    hand the result to DataParallel(..., launched=...). Raises ValueError where the GPUs do not suffice."""
    startup = StartupTimes()
    replicas = ProcessReplicas(data_parallel_size, ENGINE, model, options, fork=True)
    startup.lap(launched_phase(replicas, "mp"))
    return LaunchedReplicas(replicas, startup)
