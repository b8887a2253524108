"""Replicas launched before the driver imports the engine, where that gains: Ray actors (Ray's own start takes
seconds) and processes that are spawned (no safe fork here), which import everything themselves anyway. run-batch
asks for those first thing, so their start-up (imports, model, compile, CUDA graphs) runs while the driver itself
imports transformers and the engine, rather than after. Processes that can be forked are forked after the driver's
imports instead (by DataParallel), and start with them done. This module and what it imports (processes.py, or
ray_actors.py and Ray, and engine/startup.py) need neither transformers nor the engine (counting GPUs imports
torch); the engine is named, not imported, for the replicas to import themselves."""
from dataclasses import dataclass

from nanovllm.engine.startup import StartupTimes

ENGINE = "nanovllm.llm:LLM"


@dataclass
class LaunchedReplicas:
    """Replicas launched by run-batch before its engine import; whoever holds this until DataParallel take()s them
    close()s them, so that no error in between leaves them waiting for work (and the driver for them, forever)."""

    replicas: object | None  # ProcessReplicas or RayReplicas; None once taken or closed
    startup: StartupTimes  # the driver's, begun before the launch: DataParallel carries it on

    def take(self) -> object:
        replicas, self.replicas = self.replicas, None
        if replicas is None:
            raise RuntimeError("these launched replicas were taken over or closed already")
        return replicas

    def close(self) -> None:
        if self.replicas is not None:
            replicas, self.replicas = self.replicas, None
            replicas.close(False)


def launched_phase(replicas, backend: str) -> str:
    """The driver's start-up phase that launching `replicas` took, named for the start-up line."""
    if backend != "mp":
        return "Ray and replicas launched"
    spawned = getattr(replicas, "spawn_reason", "")
    return "replicas launched" + (f", spawned: {spawned}" if spawned else "")


def start_replicas(backend: str, data_parallel_size: int, engine_class: type | str, model: str, options: dict,
                   fork: bool = False) -> object:
    """Every replica asked for at once: processes of this host (backend "mp"; fork: the caller allows forking where
    it is safe) or Ray actors ("ray")."""
    if backend == "mp":
        from .processes import ProcessReplicas

        return ProcessReplicas(data_parallel_size, engine_class, model, options, **({"fork": True} if fork else {}))
    from .ray_actors import RayReplicas

    return RayReplicas(data_parallel_size, engine_class, model, options)


def launch_replicas(model: str, data_parallel_size: int, backend: str, options: dict) -> LaunchedReplicas:
    """Start data_parallel_size replicas of LLM(model, **options): processes of this host (backend "mp", forked
    where safe) or Ray actors ("ray"); hand the result to DataParallel(..., launched=...). Raises ValueError where
    the GPUs do not suffice, ImportError where Ray is asked for and missing."""
    startup = StartupTimes()
    replicas = start_replicas(backend, data_parallel_size, ENGINE, model, options, fork=True)
    startup.lap(launched_phase(replicas, backend))
    return LaunchedReplicas(replicas, startup)
