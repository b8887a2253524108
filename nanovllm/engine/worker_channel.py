import pickle
from multiprocessing.shared_memory import SharedMemory
from multiprocessing.synchronize import Event


class WorkerChannel:
    """Rank 0 -> tensor-parallel workers: one pickled [method, *args] in a shared-memory segment, one Event per worker.

    The first 4 bytes hold the message length; a message that does not fit is an error, never a truncation.
    """

    def __init__(self, name: str, size: int, create: bool) -> None:
        self.shm = SharedMemory(name=name, create=create, size=size if create else 0)
        self.owner = create

    def send(self, events: list[Event], method: str, *args) -> None:
        data = pickle.dumps([method, *args])
        if len(data) + 4 > self.shm.size:
            raise RuntimeError(f"tensor-parallel message of {len(data)} bytes exceeds the {self.shm.size}-byte "
                               f"shared-memory segment")
        self.shm.buf[:4] = len(data).to_bytes(4, "little")
        self.shm.buf[4:4 + len(data)] = data
        for event in events:
            event.set()

    def receive(self, event: Event) -> tuple[str, list]:
        event.wait()
        n = int.from_bytes(self.shm.buf[:4], "little")
        method, *args = pickle.loads(self.shm.buf[4:4 + n])
        event.clear()
        return method, args

    def close(self) -> None:
        self.shm.close()
        if self.owner:
            self.shm.unlink()
