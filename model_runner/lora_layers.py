"""LoRA adapters on a loaded model: rows of different adapters and of the base model in
one step, each projection's delta computed grouped by adapter after the base projection.

`LoRAModel.attach` gives every fused projection of the decoder layers (qkv_proj, o_proj,
gate_up_proj, down_proj) a `LoRAProjection`; all of them read one `LoRAStep`: the
step's runs of consecutive rows of one adapter (the runner orders a step's requests by
adapter). For each run, a projection shrinks its rows to the adapter's rank (x @ A.T,
the fused parts' A matrices stacked) and expands them (@ B.T, the parts' B matrices at
their rows of the fused output, scale folded in), added to the base output at those
rows. An adapter is read, checked and laid out on the loader thread (`read`); `add`
between two steps only installs it. A step without adapter rows costs each projection one
check. On the CPU in float32 each delta is the C++ kernels' `lora_add_`, and a decode
step with adapter rows runs in the C++ decode stack too (on each adapter's matrices as
`LoRAStep.stacked` holds them).

On CUDA each projection's adapters sit in slot buffers (model_runner/lora_stacks.py) and
one Triton kernel pair adds every row's delta, grouped by slot, whatever the runs (decode
steps in CUDA graphs, model_runner/cuda_graphs.py). Under tensor parallelism a rank holds
its slice of each adapter, cut as the base weight is (the model's `checkpoint_slices`): a
column-parallel part (q, k, v, gate, up) its rows of B, a row-parallel one (o, down) its
columns of A, so that its delta is a partial sum, all-reduced with the base projection's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from model_runner.config import LoRAConfig
from model_runner.kernels.cpu_kernels import cpu_kernels_available
from model_runner.lora_adapters import LoRAAdapter, check_adapter, read_adapter
from model_runner.lora_stacks import LoRAStack, ProjectionWeights, SlotTable

# our fused projection -> the PEFT projections it holds, in their order of rows
_FUSED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


class LoRAStep:
    """The step's runs of consecutive rows of one adapter: (adapter name, start, stop).
    Empty: no adapter in the step. With slot buffers, `row_slots`: each row's slot [T].
    `stacked`: each adapter held, as the C++ decode stack reads it (per layer, A, B.T and
    parts of qkv, o, gate_up and down; empty where not targeted), or None when the model's layers
    are not the stack's four projections each."""

    def __init__(self) -> None:
        self.runs: list[tuple[str, int, int]] = []
        self.row_slots: torch.Tensor | None = None
        self.stacked: dict[str, list[torch.Tensor]] | None = None
        self.native = False  # deltas by the C++ kernels' lora_add_ (CPU, float32)

    def stack_inputs(self) -> tuple[list[int], list[torch.Tensor]]:
        """The runs as the decode stack takes them: (the adapter's index among the step's,
        start, stop) one after the other, and those adapters' matrices in that order."""
        assert self.stacked is not None
        order: dict[str, int] = {}
        runs: list[int] = []
        for name, start, stop in self.runs:
            runs += (order.setdefault(name, len(order)), start, stop)
        return runs, [tensor for name in order for tensor in self.stacked[name]]


# a part's tensor-parallel cut: (dim, start, stop) of its weight this rank holds
Cut = tuple[int, int, int]


@dataclass(frozen=True)
class ReadyAdapter:
    """An adapter read, checked and laid out for every projection of the model (in
    `LoRAModel.projections` order): what `LoRAModel.add` installs at once."""

    adapter: LoRAAdapter
    weights: list[ProjectionWeights]


class LoRAProjection:
    """One fused projection's adapters: name -> (A [R, in], B.T [R, out], parts), R the sum
    of the ranks of the parts the adapter targets (a part it skips has no rows in A and B),
    parts [P, 4] int64: each targeted part's rows of R and columns of the fused output, the
    block of B.T that is not zero (what `lora_add_` reads);
    `stack`: their slot buffers, on CUDA (then the pairs are views into them)."""

    def __init__(self, step: LoRAStep, parts: tuple[str, ...], sizes: tuple[int, ...]) -> None:
        self.step = step
        self.parts = parts
        self.sizes = sizes  # the parts' output rows
        self.adapters: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.stack: LoRAStack | None = None

    def lay_out(self, adapter: LoRAAdapter, layer: int, dtype: torch.dtype,
                device: torch.device, cuts: dict[str, Cut]) -> ProjectionWeights:
        """`adapter`'s A matrices of this layer's parts stacked, its B matrices (as B.T) at
        their parts' columns of the fused output, and where each sits (None: it targets none
        of them); each part cut to this rank's slice (`cuts`)."""
        shrinks, expands, spans, offset, rank = [], [], [], 0, 0
        out_size = sum(self.sizes)
        for part, size in zip(self.parts, self.sizes, strict=True):
            pair = adapter.weights.get((layer, part))
            if pair is not None:
                a, b = pair
                if part in cuts:
                    dim, start, stop = cuts[part]
                    a, b = (a, b[start:stop]) if dim == 0 else (a[:, start:stop], b)
                expand = torch.zeros(a.shape[0], out_size)  # B.T: its rows added whole
                expand[:, offset : offset + size] = b.T
                shrinks.append(a)
                expands.append(expand)
                spans.append((rank, rank + a.shape[0], offset, offset + size))
                rank += a.shape[0]
            offset += size
        if not shrinks:
            return None
        return (torch.cat(shrinks).to(device=device, dtype=dtype),
                torch.cat(expands).to(device=device, dtype=dtype),
                torch.tensor(spans, dtype=torch.int64))

    def apply_(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` [T, out] of the base projection of `x` [T, in], plus each adapter's delta
        on its runs of rows of the step (in place); on the CPU in float32, the C++
        kernels' `lora_add_` (the decode stack's, on the step's thread: no GEMM's thread
        pool woken twice a projection)."""
        if self.stack is not None and self.step.row_slots is not None:
            return self.stack.apply_(x, out, self.step.row_slots)
        native = (self.step.native and x.dtype == torch.float32 and x.dim() == 2
                  and x.stride(1) == 1 and out.stride(1) == 1)
        for name, start, stop in self.step.runs:
            pair = self.adapters.get(name)
            if pair is None:  # the adapter does not target this projection
                continue
            shrink, expand, parts = pair
            if native:
                torch.ops.pagedserve.lora_add_(out, x, shrink, expand, parts, start, stop)
            else:
                out[start:stop] += (x[start:stop] @ shrink.T) @ expand
        return out


class LoRAModel:
    """The adapters a model holds (`adapters`, at most --max-cpu-loras), those it may load
    (`paths`), and the step's runs of rows by adapter. `use_stacks`: slot buffers and the
    Triton kernel (None: on CUDA)."""

    def __init__(self, model: nn.Module, config: LoRAConfig,
                 use_stacks: bool | None = None) -> None:
        self.model = model
        self.max_rank = config.max_lora_rank
        self.paths: dict[str, str] = {}  # every adapter it may load: name -> PEFT folder
        self.step = LoRAStep()
        self.adapters: dict[str, LoRAAdapter] = {}
        self.projections: list[tuple[int, LoRAProjection]] = []
        self.shapes: dict[str, tuple[int, int]] = {}
        param = next(model.parameters())
        self.dtype, self.device = param.dtype, param.device
        self.table = SlotTable(config.cpu_loras)
        self.use_stacks = self.device.type == "cuda" if use_stacks is None else use_stacks
        self.cuts: dict[str, Cut] = {}
        slices = model.checkpoint_slices()  # {} on one rank
        for layer_id, layer in enumerate(model.layers):
            for owner in (layer.self_attn, layer.mlp):
                self._attach(layer_id, owner, slices)
        stack_order = [(i, parts) for i in range(len(model.layers)) for parts in _FUSED.values()]
        if not self.use_stacks and [(i, p.parts) for i, p in self.projections] == stack_order:
            self.step.stacked = {}
        self.step.native = (self.device.type == "cpu" and self.dtype == torch.float32
                            and cpu_kernels_available())
        model.lora_step = self.step

    def _attach(self, layer_id: int, owner: nn.Module,
                slices: dict[str, tuple[int, int, int, int]]) -> None:
        for fused, parts in _FUSED.items():
            linear = getattr(owner, fused, None)
            if linear is None or not hasattr(linear, "lora"):
                continue
            sizes = _part_sizes(owner, fused)
            projection = LoRAProjection(self.step, parts, sizes)
            if self.use_stacks:
                projection.stack = LoRAStack(self.table.num_slots, self.max_rank * len(parts),
                                             linear.in_features, sum(sizes), self.dtype,
                                             self.device)
            linear.lora = projection
            self.projections.append((layer_id, projection))
            for part, size in zip(parts, sizes, strict=True):
                self.shapes[part] = (size, linear.in_features)  # the whole (out, in)
                if part in slices:
                    dim, start, stop, whole = slices[part]
                    self.cuts[part] = (dim, start, stop)
                    self.shapes[part] = (whole, linear.in_features) if dim == 0 else (size, whole)

    def read(self, name: str, path: str) -> ReadyAdapter:
        """The adapter in the PEFT folder `path`, checked against this model and laid out
        for its projections (no state changes: it runs on the loader thread)."""
        adapter = read_adapter(name, path, self.max_rank, self.shapes, len(self.model.layers))
        return ReadyAdapter(adapter, [
            projection.lay_out(adapter, layer, self.dtype, self.device, self.cuts)
            for layer, projection in self.projections])

    def check(self, name: str, path: str) -> None:
        """Check the adapter in the PEFT folder `path` against this model from its config
        and its weights' shapes, without reading them (AdapterError naming why not)."""
        check_adapter(name, path, self.max_rank, self.shapes, len(self.model.layers))

    def add(self, ready: ReadyAdapter) -> None:
        """Hold an adapter read (replacing one of the same name): dict entries only, between
        two steps."""
        name = ready.adapter.name
        self.remove(name)
        slot = self.table.take(name)
        for (_, projection), weights in zip(self.projections, ready.weights, strict=True):
            if projection.stack is not None:  # held once, in the slot
                weights = projection.stack.put(slot, weights)
            if weights is not None:
                projection.adapters[name] = weights
        self.adapters[name] = ready.adapter
        if self.step.stacked is not None:
            none = torch.empty(0, dtype=self.dtype, device=self.device)
            self.step.stacked[name] = [tensor for weights in ready.weights
                                       for tensor in (weights or (none, none, none))]

    def remove(self, name: str) -> None:
        self.adapters.pop(name, None)
        self.table.release(name)
        if self.step.stacked is not None:
            self.step.stacked.pop(name, None)
        for _, projection in self.projections:
            projection.adapters.pop(name, None)

    def begin_step(self, names: Sequence[str | None], num_rows: Sequence[int]) -> bool:
        """The step's runs of rows by adapter: the i-th request's `num_rows[i]` rows (laid
        out in order) run adapter `names[i]` (None: the base model); the runner orders
        the requests by adapter so that the runs are few. Whether any adapter runs."""
        runs: list[tuple[str, int, int]] = []
        start = 0
        for name, n in zip(names, num_rows, strict=True):
            if name is not None:
                if name not in self.adapters:
                    raise ValueError(f"LoRA adapter {name!r} is not loaded")
                if runs and runs[-1][0] == name and runs[-1][2] == start:
                    runs[-1] = (name, runs[-1][1], start + n)
                else:
                    runs.append((name, start, start + n))
            start += n
        self.step.runs = runs
        self.step.row_slots = None
        if runs and self.use_stacks:
            self.step.row_slots = self.table.row_slots(names, num_rows, self.device)
        return bool(runs)


def _part_sizes(owner: nn.Module, fused: str) -> tuple[int, ...]:
    """The output rows of each part of a fused projection of `owner` (attention or MLP)."""
    if fused == "qkv_proj":
        return (owner.q_size, owner.kv_size, owner.kv_size)
    if fused == "gate_up_proj":
        return (owner.intermediate_size, owner.intermediate_size)
    linear = getattr(owner, fused)
    return (linear.out_features,)
