"""Tensor parallelism over torch.distributed: one rank's process groups, its collectives,
and which slice of each dimension it holds.

Rank 0 is the engine core; ranks 1..N-1 are worker processes
(model_runner/distributed/tp_workers.py).
They meet at a TCPStore that rank 0 opens on a free local port (no port race: the OS picks
it). On the CPU one gloo group carries everything. On CUDA NCCL carries the model's
collectives (one device per rank) and a gloo group the CPU-side ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# The rendezvous, and any one collective (a rank waits in one while the others load).
TIMEOUT = timedelta(seconds=300)
HOST = "127.0.0.1"


class RanksOutOfStep(BaseException):
    """Rank 0 failed between sending a step and finishing its collectives: the workers
    wait in one it will never join. Not an Exception, so that the engine core does not go
    on to the next step (it exits; see engine/core_process.py)."""


def open_store(world_size: int) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free local port (`store.port`)."""
    return dist.TCPStore(HOST, 0, world_size, is_master=True, timeout=TIMEOUT,
                         wait_for_workers=False)


@dataclass(frozen=True)
class TensorParallel:
    """This process's rank among `world_size` and its groups (see the module docstring)."""

    rank: int
    world_size: int
    group: dist.ProcessGroup  # the model's collectives: NCCL on CUDA, gloo on the CPU
    cpu_group: dist.ProcessGroup  # gloo, for CPU-side values

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place; x."""
        dist.all_reduce(x, group=self.group)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x [N, n], concatenated along the last dim on rank 0: [N, ranks * n].

        The other ranks get their own x back (only rank 0 samples)."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0, group=self.group)
        return x if parts is None else torch.cat(parts, dim=-1)

    def min(self, value: int) -> int:
        """The smallest of every rank's `value`."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def split(self, total: int) -> tuple[int, int]:
        """This rank's [start, stop) of `total` split as evenly as it goes (the first
        total % N ranks one more)."""
        size, extra = divmod(total, self.world_size)
        start = self.rank * size + min(self.rank, extra)
        return start, start + size + (self.rank < extra)

    def heads(self, num_heads: int, num_kv_heads: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """This rank's [start, stop) of the query heads and of the KV heads.

        The KV heads are split as evenly as they go, each with its group of query heads
        (SmolLM2-135M's 3 over 2 ranks: 2 and 1). With fewer KV heads than ranks, each is
        replicated on N / num_kv_heads ranks, which split its group; ValueError when that
        does not divide.
        """
        group = num_heads // num_kv_heads
        if num_kv_heads >= self.world_size:
            kv_start, kv_stop = self.split(num_kv_heads)
            return (kv_start * group, kv_stop * group), (kv_start, kv_stop)
        replicas = self.world_size // num_kv_heads
        if self.world_size % num_kv_heads or group % replicas:
            raise ValueError(
                f"--tensor-parallel-size {self.world_size} does not shard {num_heads} query "
                f"heads over {num_kv_heads} KV heads (with fewer KV heads than ranks, the "
                "ranks must split each head's group evenly)"
            )
        head, part = divmod(self.rank, replicas)
        size = group // replicas
        start = head * group + part * size
        return (start, start + size), (head, head + 1)

    def vocab(self, vocab_size: int) -> tuple[int, int, int]:
        """This rank's [start, stop) of the vocabulary and its padded row count: every rank
        holds ceil(vocab / N) rows, the last one zeros past the vocabulary."""
        rows = -(-vocab_size // self.world_size)
        start = min(self.rank * rows, vocab_size)
        return start, min(start + rows, vocab_size), rows

    def close(self) -> None:
        dist.destroy_process_group()


def init_tensor_parallel(
    rank: int, world_size: int, store: dist.Store, device: torch.device
) -> TensorParallel:
    """Join the ranks at `store`; returns when all `world_size` have joined (or raises
    after TIMEOUT)."""
    if device.type == "cuda":
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", store=store, rank=rank, world_size=world_size,
                                timeout=TIMEOUT, device_id=torch.device("cuda", rank))
        cpu_group = dist.new_group(backend="gloo", timeout=TIMEOUT)
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=TIMEOUT)
        cpu_group = dist.group.WORLD
    return TensorParallel(rank, world_size, dist.group.WORLD, cpu_group)
