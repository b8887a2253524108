import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass
class TensorParallelGroup:
    """This rank's place among the tensor-parallel ranks, and the process group they share.

    The group is built from its own store instead of torch's global default group, so two engines in one
    process keep separate groups. Size 1 needs no group and every collective is a no-op. Ranks share one host,
    so every socket they open is bound to the loopback interface.
    """

    rank: int = 0
    size: int = 1
    pg: dist.ProcessGroup | None = None

    @classmethod
    def connect(cls, store: dist.Store, rank: int, size: int, use_cuda: bool,
                timeout: timedelta = timedelta(minutes=5)) -> "TensorParallelGroup":
        if size == 1:
            return cls()
        if use_cuda:
            # NCCL's bootstrap listens on the interface this names (the user's own setting wins)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            pg = dist.ProcessGroupNCCL(store, rank, size, options)
        else:
            options = dist.ProcessGroupGloo._Options()
            options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            options._timeout = timeout
            pg = dist.ProcessGroupGloo(store, rank, size, options)
        return cls(rank, size, pg)

    def close(self) -> None:
        """Shut the process group down, closing its connections to the other ranks."""
        if self.pg is not None:
            pg, self.pg = self.pg, None
            try:
                pg.shutdown()
            except RuntimeError:
                pass  # a peer already gone can fail the goodbye; the group is dropped all the same

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
        if self.size > 1:
            options = dist.AllreduceOptions()
            options.reduceOp = op
            self.pg.allreduce([tensor], options).wait()
        return tensor

    def broadcast_from_first(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's tensor into `tensor` on every other rank (a buffer of the same shape and dtype)."""
        if self.size > 1:
            options = dist.BroadcastOptions()
            options.rootRank = 0
            self.pg.broadcast([tensor], options).wait()
        return tensor

    def gather_to_first(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's tensor, in rank order, on rank 0; None elsewhere."""
        if self.size == 1:
            return [tensor]
        options = dist.GatherOptions()
        options.rootRank = 0
        parts = [[torch.empty_like(tensor) for _ in range(self.size)]] if self.rank == 0 else []
        self.pg.gather(parts, [tensor], options).wait()
        return parts[0] if self.rank == 0 else None
