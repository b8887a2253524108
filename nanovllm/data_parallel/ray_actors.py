"""Backend "ray": replicas as Ray actors, with `num_gpus` = the tensor-parallel size each (one CPU each where the
cluster has no GPU), on the cluster named by RAY_ADDRESS, or on a local Ray instance where none is named.

Every node must hold the model at the same path: actors load it there, the driver sends no weights. Ray is
imported only here, so it stays an optional extra.

Both directions travel as bytes pickled by the sending end (a refill, a poll's messages): Ray's own serializer
is slower for these many small objects (docs/data_parallel.md), in the actor beside its engine as in the driver,
and bytes over 100 KB cross the object store as one buffer.
"""
import os
import pickle
import queue
import threading
import time

from nanovllm.data_parallel.ray_reaper import Reaper, watch_local_instance
from nanovllm.data_parallel.replica import STOP, engine_named, serve

POLL_S = 0.5  # an actor answers a poll within this long even with nothing to say
# a poll that has something keeps gathering this long: each poll is an actor call, whose overhead runs in the
# replica beside its engine, and an engine finishes requests at nearly every step (a few ms); a result that waits
# this long costs nothing, since each replica holds a whole max_num_seqs of requests beyond its engine's window
GATHER_S = 0.02
# Ray runs its workers at niceness 15 (its own processes keep priority); a replica feeds a GPU and should not
# queue behind the driver or other work of the host, so a local instance this driver starts gets 0
NICENESS = "RAY_worker_niceness"
UNRESPONSIVE_S = 900.0  # a poll not back in this long (never placed, node hung) counts the actor as lost
JOIN_S = 30.0


class ReplicaActor:
    """serve() in a thread of the actor; submit() and poll() are the methods the driver calls."""

    def __init__(self, engine_class: type | str, model: str, options: dict, requested_at: float) -> None:
        self.inbox: queue.Queue = queue.Queue()
        self.outbox: queue.Queue = queue.Queue()
        self._next, self._early, self._lock = 0, {}, threading.Lock()
        self.thread = threading.Thread(target=self._run, args=(engine_class, model, options, requested_at),
                                       daemon=True)
        self.thread.start()

    def _run(self, engine_class: type | str, model: str, options: dict, requested_at: float) -> None:
        try:
            engine = engine_named(engine_class)  # imported here when named: counted in "start and imports"
        except BaseException as error:  # the driver hears of it as of any engine that failed to start
            self.outbox.put(("error", f"the engine failed to start: {type(error).__name__}: {error}"))
            return
        try:
            serve(lambda: engine(model, **options), self.inbox, self.outbox.put, requested_at)
        except BaseException:  # serve has sent the driver its error
            pass

    def submit(self, seq: int, data: bytes) -> None:
        """`data`: the pickled list of items."""
        items = pickle.loads(data)
        # a threaded actor may run two calls out of order: `seq` puts them back in the driver's order
        with self._lock:
            self._early[seq] = items
            while self._next in self._early:
                for item in self._early.pop(self._next):
                    self.inbox.put(item)
                self._next += 1

    def poll(self, timeout: float) -> bytes:
        """The pickled list of the messages that are here within `timeout` s (an empty list if none), and of those
        that come within GATHER_S of the first."""
        try:
            messages = [self.outbox.get(timeout=timeout)]
        except queue.Empty:
            return pickle.dumps([])
        deadline = time.monotonic() + GATHER_S
        while (left := deadline - time.monotonic()) > 0:
            try:
                messages.append(self.outbox.get(timeout=left))
            except queue.Empty:
                break
        return pickle.dumps(messages, protocol=pickle.HIGHEST_PROTOCOL)

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)


class RayReplicas:
    """Starts the actors and carries messages to and from them: one poll in flight per actor."""

    def __init__(self, replicas: int, engine_class: type | str, model: str, options: dict) -> None:
        try:
            import ray
        except ImportError:
            raise ImportError("data-parallel backend 'ray' needs Ray: pip install -e '.[ray]'") from None
        self.ray = ray
        self.owns_ray = not ray.is_initialized()
        self.reaper = _init_ray(ray) if self.owns_ray else None
        try:
            resources = self._resources(replicas, options.get("tensor_parallel_size", 1))
            actor_class = ray.remote(ReplicaActor).options(max_concurrency=2, **resources)
            # all at once: Ray places and starts them concurrently, and each starts its engine in a thread of
            # its own, so that no actor's start-up waits for another's
            self.actors = [actor_class.remote(engine_class, model, options, time.time()) for _ in range(replicas)]
        except BaseException:
            if self.owns_ray:
                ray.shutdown()
            raise
        self.names = [f"replica {r} (Ray actor {a._actor_id.hex()[:12]})" for r, a in enumerate(self.actors)]
        self.seq = [0] * replicas
        self.polls: dict = {}  # poll ObjectRef -> (replica, when it was sent)
        self.gone: dict[int, str] = {}
        for r in range(replicas):
            self._poll(r)

    def _resources(self, replicas: int, tp: int) -> dict:
        """Refuse up front what the cluster cannot hold: Ray would otherwise wait for it forever."""
        total = self.ray.cluster_resources()
        if total.get("GPU", 0):
            if replicas * tp > total["GPU"]:
                raise ValueError(f"data_parallel_size={replicas} x tensor_parallel_size={tp} needs {replicas * tp} "
                                 f"GPUs but the Ray cluster has {total['GPU']:g}")
            return {"num_gpus": tp, "num_cpus": 1}
        if replicas > total.get("CPU", 0):
            raise ValueError(f"data_parallel_size={replicas} CPU replicas need {replicas} CPUs but the Ray cluster "
                             f"has {total.get('CPU', 0):g} (and no GPU)")
        return {"num_cpus": 1}

    def _poll(self, r: int) -> None:
        self.polls[self.actors[r].poll.remote(POLL_S)] = r, time.monotonic()

    def send(self, r: int, items: list) -> None:
        self.actors[r].submit.remote(self.seq[r], pickle.dumps(items, protocol=pickle.HIGHEST_PROTOCOL))
        self.seq[r] += 1

    def receive(self, timeout: float) -> list[tuple[int, tuple]]:
        refs = list(self.polls)
        if not refs:
            time.sleep(timeout)
            return []
        ready, _ = self.ray.wait(refs, num_returns=1, timeout=timeout)
        if ready:  # and whatever else is in by now
            ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=0)
        messages = []
        for ref in ready:
            r, _ = self.polls.pop(ref)
            try:
                messages += [(r, m) for m in pickle.loads(self.ray.get(ref))]
            except self.ray.exceptions.RayError as error:  # the actor died, or its node
                self.gone[r] = f"lost: {type(error).__name__}: {str(error).splitlines()[0]}"
                continue
            self._poll(r)
        now = time.monotonic()
        for ref, (r, sent) in list(self.polls.items()):
            if now - sent > UNRESPONSIVE_S:
                del self.polls[ref]
                self.gone[r] = f"did not answer for {UNRESPONSIVE_S:g} s"
                self.ray.kill(self.actors[r])
        return messages

    def lost(self) -> dict[int, str]:
        gone, self.gone = self.gone, {}
        return gone

    def kill(self, r: int) -> None:
        self.ray.kill(self.actors[r])
        for ref, (replica, _) in list(self.polls.items()):
            if replica == r:
                del self.polls[ref]

    def close(self, clean: bool) -> None:
        try:
            if clean:  # let engines release their memory and workers before the actors go
                live = [self.actors[r] for _, (r, _) in self.polls.items()]
                for actor in live:
                    self.send(self.actors.index(actor), [STOP])
                try:
                    self.ray.get([actor.join.remote(JOIN_S) for actor in live], timeout=JOIN_S + 5)
                except self.ray.exceptions.RayError:
                    pass
            for actor in self.actors:
                self.ray.kill(actor)
        finally:
            if self.owns_ray:
                self.ray.shutdown()
            if self.reaper is not None:  # the watcher ends what the shutdown left of the instance, then exits
                os.close(self.reaper.pipe)
                self.reaper = None


def _init_ray(ray) -> Reaper | None:
    """ray.init(): joins the cluster that RAY_ADDRESS names, else starts a local instance, whose workers (the
    replicas) then run at the driver's own priority rather than Ray's default niceness, and which ends with
    the driver."""
    local = not os.environ.get("RAY_ADDRESS")
    set_here = local and NICENESS not in os.environ
    if set_here:  # read by the local instance's processes as they start; the driver's environment is restored
        os.environ[NICENESS] = "0"
    try:
        ray.init()
    finally:
        if set_here:
            del os.environ[NICENESS]
    # a local instance's agents would outlive a killed driver by a minute (data_parallel/ray_reaper.py)
    return watch_local_instance(os.getpid()) if local else None
