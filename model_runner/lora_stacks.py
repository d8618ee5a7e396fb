"""On CUDA, a projection's LoRA adapters in fixed slot buffers, for the Triton kernel
(model_runner/kernels/triton_lora.py).

Each adapter the model holds has one slot (the same in every projection, `SlotTable`); a
projection's `LoRAStack` holds every slot's A matrices [S, R, in] and B matrices
transposed [S, R, out], R the most rows any adapter can have there (the --max-lora-rank of
each fused part), zero past an adapter's own. A step then names each row's slot in one
int32 tensor; the kernel reads the buffers where they are, whatever adapters the slots
hold, so their addresses never change (what a CUDA graph needs).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

# A [R, in], B.T [R, out], parts [P, 4] (lora_layers.LoRAProjection)
ProjectionWeights = tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None


class SlotTable:
    """Which slot each adapter held has, of `num_slots` (--max-cpu-loras)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.slots: dict[str, int] = {}

    def take(self, name: str) -> int:
        """A free slot for `name` (its own if it has one)."""
        if name in self.slots:
            return self.slots[name]
        free = sorted(set(range(self.num_slots)) - set(self.slots.values()))
        if not free:
            raise ValueError(f"no free LoRA slot for adapter {name!r}: {self.num_slots} "
                             "adapters are held (--max-cpu-loras)")
        self.slots[name] = free[0]
        return free[0]

    def release(self, name: str) -> None:
        self.slots.pop(name, None)

    def row_slots(self, names: Sequence[str | None], num_rows: Sequence[int],
                  device: torch.device) -> torch.Tensor:
        """The slot of each row of a step [T] int32 (-1: the base model's): the i-th
        request's `num_rows[i]` rows run adapter `names[i]`."""
        slots = np.fromiter((-1 if n is None else self.slots[n] for n in names), np.int32,
                            len(names))
        rows = torch.from_numpy(np.repeat(slots, np.asarray(num_rows, dtype=np.int64)))
        return rows.to(device, non_blocking=True) if device.type == "cuda" else rows


class LoRAStack:
    """One projection's slot buffers (see the module docstring)."""

    def __init__(self, num_slots: int, rank: int, in_features: int, out_features: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.shrink = torch.zeros(num_slots, rank, in_features, dtype=dtype, device=device)
        self.expand = torch.zeros(num_slots, rank, out_features, dtype=dtype, device=device)

    def put(self, slot: int, weights: ProjectionWeights) -> ProjectionWeights:
        """Hold an adapter's weights (None: it skips this projection) in `slot`: its views
        there, as `weights` are (A [r, in], B.T [r, out], parts), or None."""
        self.shrink[slot].zero_()
        self.expand[slot].zero_()
        if weights is None:
            return None
        a, b, parts = weights
        rank = a.shape[0]
        self.shrink[slot, :rank].copy_(a)
        self.expand[slot, :rank].copy_(b)
        return self.shrink[slot, :rank], self.expand[slot, :rank], parts

    def apply_(self, x: torch.Tensor, out: torch.Tensor, row_slots: torch.Tensor) -> torch.Tensor:
        """`out` plus each row's adapter delta (triton_lora.add_lora), in place."""
        from model_runner.kernels.triton_lora import add_lora  # NOTE: triton on CUDA only

        return add_lora(out, x, self.shrink, self.expand, row_slots)
