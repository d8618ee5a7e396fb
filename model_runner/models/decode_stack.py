"""A decoder's layers in one C++ call for decode steps: of a few rows, or of up to
STACK_BATCH_MAX_ROWS where every projection has a batch form.

At batch 1 a step of the default model does ~10 ms of arithmetic, and its Python layers
add ~3 ms of op calls around it (a dozen a layer: docs/benchmarks-runner.md, the batch-1 decode
step). `DecodeStack` hands the layers' weights to csrc/cpu_decode_stack.cpp once, which
then runs every layer of a decode step with the kernels the Python layers call on the
"cpu" backend, in their order: the same hidden states to the bit (tests/runner/
test_decode_stack.py). `LlamaForCausalLM.forward` (and Gemma's) runs it when `takes` says
so, the Python layers otherwise (prefill chunks, verifications, larger batches, other
backends).

A layer is taken by what it declares, not by its type: its `decode_stack_form()` gives
its parts as the C++ stack repeats them (`StackLayer`: a pre-norm block of RMSNorms, with
Gemma's sandwich norms on the blocks' outputs or without, each block's output scaled or not;
attention with full RoPE from the layer's own table or none, per-head q/k norms or none,
any scale, window, soft cap and sinks; a SwiGLU or gelu-tanh gated MLP; every projection
on a small-batch path of cpu_kernel_table.py, or on several, one for each run of its rows:
a GGUF's fused projection of mixed block types; past the path's rows on its batch form
where it has one: AMX's int8 tiles, of int8 rows or of a GGUF's blocks), or a reason why
not, and so do its norms, attention and MLP. A step with LoRA adapters' rows runs here
too: the model hands the stack the step's runs of rows by adapter and their A and B matrices
(model_runner/lora_layers.py), whose deltas follow each base projection as in Python
(the same kernel, `lora_add_`). A family
whose subclass changes the arithmetic (a forward of its own) declares its own form
(tests/runner/test_decode_stack.py holds every subclass here to that).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import nn

from model_runner.attention_metadata import AttentionMetadata
from model_runner.kernels.cpu_kernel_table import DEFAULT_TABLE, PATHS, KernelPath, KernelTable
from model_runner.kernels.cpu_kernels import cpu_kernels_available
from model_runner.kernels.small_batch import DecodeForm, ProjectionForm
from model_runner.kv_cache import KVCaches

# the C++ stack's projection kinds: each path's place in the table and its tensor count
KIND_OF = {name: kind for kind, name in enumerate(PATHS)}
TENSORS_PER_KIND = [len(path.tensors) for path in PATHS.values()]


@dataclass(frozen=True)
class StackNorm:
    """An RMSNorm as the stack runs it: weight * x / rms(x), in float32 (cpu_layers.cpp);
    `weight`: what the norm multiplies by (Gemma's 1 + w, `GemmaRMSNorm.scale`)."""

    weight: torch.Tensor
    eps: float


@dataclass(frozen=True)
class StackAttention:
    """Self-attention as the stack runs it: q/k/v projected, each q and k head normed
    (`q_norm`, `k_norm`: Qwen3's per-head norms, or None) and RoPE on its every dim (none
    where not `rotates`: a NoPE layer), the KV write and paged decode attention (window,
    soft cap, sinks), o projected."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    window: int  # 0: none
    scale: float
    softcap: float  # 0: none
    sinks: torch.Tensor | None
    qkv: ProjectionForm
    o: ProjectionForm
    q_norm: StackNorm | None = None
    k_norm: StackNorm | None = None
    rotates: bool = True


# the gated MLP's activations, by their index in csrc/cpu_decode_stack.cpp
ACTIVATIONS = ("silu", "gelu_tanh")


@dataclass(frozen=True)
class StackMLP:
    """A gated MLP as the stack runs it: gate/up projected, act(gate) * up (`activation`:
    "silu", SwiGLU, or "gelu_tanh", Gemma's), down projected."""

    gate_up: ProjectionForm
    down: ProjectionForm
    activation: str = "silu"


DEFAULT_ROPE = "default"  # the RoPE table of a model with one for every layer


@dataclass(frozen=True)
class StackLayer:
    """A pre-norm decoder layer: x + attention(norm(x)), then x + mlp(norm(x)); with
    Gemma's sandwich norms, each block's output normed before it is added
    (`attention_out_norm`, `mlp_out_norm`); each block's output times
    `residual_multiplier` (Granite's) before it is added. `rope`: the name of the RoPE
    table its attention reads (Gemma 3's local and global layers read their own)."""

    input_norm: StackNorm
    post_norm: StackNorm  # the feed-forward block's input norm
    attention: StackAttention
    mlp: StackMLP
    attention_out_norm: StackNorm | None = None
    mlp_out_norm: StackNorm | None = None
    rope: str = DEFAULT_ROPE
    residual_multiplier: float = 1.0


Form = TypeVar("Form")


def form_of(module: nn.Module, what: str, kind: type[Form]) -> Form | str:
    """The `kind` of decode-stack form `module` declares, or why it has none (naming
    `what`)."""
    declare = getattr(module, "decode_stack_form", None)
    if declare is None:
        return f"{what}: {type(module).__name__} declares no decode-stack form"
    form = declare()
    if isinstance(form, str):
        return f"{what}: {form}"
    return form if isinstance(form, kind) else f"{what}: declares no {kind.__name__}"


class DecodeStack:
    """The native stack of a model's layers and the most rows it runs under the model's
    kernel table (the fewest its projections' paths take)."""

    def __init__(self, native: torch.ScriptObject, paths: set[KernelPath],
                 table: KernelTable, ropes: list[str]) -> None:
        self.native = native
        self.paths = paths
        self.ropes = ropes  # the RoPE tables the layers read, in the native stack's order
        self.use_table(table)
        # the caches split into the k and v lists the native stack takes, once per cache
        self._split: tuple[KVCaches, list[torch.Tensor], list[torch.Tensor]] | None = None

    def use_table(self, table: KernelTable) -> None:
        """Run decode steps of up to the rows `table` gives every projection's path (its
        batch form's, where it has one)."""
        self.max_rows = min(table.rows(path) for path in self.paths)

    def takes(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        """Whether this step is one it runs: decodes only, one row each, few enough rows."""
        return meta.num_decode_seqs == meta.num_seqs == num_tokens <= self.max_rows

    def __call__(
        self,
        x: torch.Tensor,  # [T, H]
        ropes: Mapping[str, tuple[torch.Tensor, torch.Tensor]],  # name -> cos, sin [T, D / 2]
        meta: AttentionMetadata,
        kv_caches: KVCaches,
        lora_runs: Sequence[int] = (),
        lora_weights: Sequence[torch.Tensor] = (),
    ) -> torch.Tensor:
        """The residual stream after the last layer (before the final norm): [T, H].
        `lora_runs`, `lora_weights`: the step's LoRA adapters' rows and weights
        (`LoRAStep.stack_inputs`; none: no adapter in the step)."""
        if self._split is None or self._split[0] is not kv_caches:
            self._split = (kv_caches, [k for k, _ in kv_caches], [v for _, v in kv_caches])
        _, k_caches, v_caches = self._split
        tables = [ropes[name] for name in self.ropes]
        return self.native.forward(
            x, [cos for cos, _ in tables], [sin for _, sin in tables], meta.slot_mapping,
            meta.block_tables, meta.context_lens, k_caches, v_caches, list(lora_runs),
            list(lora_weights),
        )


def build_decode_stack(
    layers: Sequence[nn.Module], table: KernelTable = DEFAULT_TABLE
) -> DecodeStack | str:
    """The stack of `layers` from the forms they declare, or why there is none (a layer
    that declares none or says why not, or the kernels missing)."""
    if not cpu_kernels_available():
        return "the C++ CPU kernels are not built"
    forms: list[StackLayer] = []
    for i, layer in enumerate(layers):
        form = form_of(layer, f"layer {i}", StackLayer)
        if isinstance(form, str):
            return form
        if len({norm.eps for norm in _norms(form) if norm is not None}) > 1:
            return f"layer {i}: its norms' eps differ"
        if (form.attention.q_norm is None) != (form.attention.k_norm is None):
            return f"layer {i}: a q norm without a k norm, or a k norm without a q norm"
        if form.attention.q_norm is not None and not form.attention.rotates:
            return f"layer {i}: q/k norms on a layer without RoPE"
        if form.mlp.activation not in ACTIVATIONS:
            return f"layer {i}: the activation {form.mlp.activation!r}"
        forms.append(form)
    if not forms:
        return "no layers"
    native = torch.classes.pagedserve.DecodeStack(list(PATHS), TENSORS_PER_KIND)
    empty = torch.empty(0)
    paths: set[KernelPath] = set()
    ropes = list(dict.fromkeys(form.rope for form in forms if form.attention.rotates))
    for form in forms:
        attn = form.attention
        projections = (attn.qkv, attn.o, form.mlp.gate_up, form.mlp.down)
        parts = [part for p in projections for part in p.parts]
        native.add_layer(
            [empty if norm is None else norm.weight for norm in _norms(form)],
            float(form.input_norm.eps),
            [attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.window,
             ropes.index(form.rope) if attn.rotates else -1,
             ACTIVATIONS.index(form.mlp.activation)],
            float(attn.scale),
            float(attn.softcap),
            float(form.residual_multiplier),
            empty if attn.sinks is None else attn.sinks,
            [len(p.parts) for p in projections],
            [KIND_OF[p.path.name] for p in parts],
            [p.argument for p in parts],
            [n for p in parts for n in _batch_of(p)],
            [tensor for p in parts
             for tensor in (*p.tensors, *(() if p.batch is None else p.batch.tensors))],
            [empty if p.bias is None else p.bias for p in parts],
        )
        # what bounds each part's rows: its batch form's path, or its own
        paths.update(p.path if p.batch is None else p.batch.path for p in parts)
    return DecodeStack(native, paths, table, ropes)


def _batch_of(part: DecodeForm) -> tuple[int, int, int]:
    """A part's batch form as the native stack takes it: its kind (-1: none), its argument
    and the fewest rows it runs."""
    if part.batch is None:
        return (-1, 0, 0)
    return (KIND_OF[part.batch.path.name], part.batch.argument, part.batch_from)


def _norms(form: StackLayer) -> tuple[StackNorm | None, ...]:
    """A layer's norms in the native stack's order (csrc/cpu_ops.h, add_layer)."""
    attn = form.attention
    return (form.input_norm, form.attention_out_norm, form.post_norm, form.mlp_out_norm,
            attn.q_norm, attn.k_norm)
