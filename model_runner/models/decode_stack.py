"""A Llama-style model's decoder layers in one C++ call for decode steps of a few rows.

At batch 1 a step of the default model does ~10 ms of arithmetic, and its Python layers
add ~3 ms of op calls around it (a dozen a layer: docs/benchmarks.md, the batch-1 decode
step). `DecodeStack` hands the layers' weights to csrc/cpu_decode_stack.cpp once, which
then runs every layer of a decode step with the kernels the Python layers call on the
"cpu" backend, in their order: the same hidden states to the bit (tests/runner/
test_decode_stack.py). `LlamaForCausalLM.forward` runs it when `takes` says so, the
Python layers otherwise (prefill chunks, verifications, larger batches, other backends).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from model_runner.attention_metadata import AttentionMetadata
from model_runner.kernels.cpu_kernel_table import DEFAULT_TABLE, PATHS, KernelPath, KernelTable
from model_runner.kernels.cpu_kernels import cpu_kernels_available
from model_runner.kernels.cpu_linear import DecodeForm
from model_runner.kv_cache import KVCaches

# the C++ stack's projection kinds: each path's place in the table and its tensor count
KIND_OF = {name: kind for kind, name in enumerate(PATHS)}
TENSORS_PER_KIND = [len(path.tensors) for path in PATHS.values()]


class DecodeStack:
    """The native stack of a model's layers and the most rows it runs under the model's
    kernel table (the fewest its projections' paths take)."""

    def __init__(self, native: torch.ScriptObject, paths: set[KernelPath],
                 table: KernelTable) -> None:
        self.native = native
        self.paths = paths
        self.use_table(table)
        # the caches split into the k and v lists the native stack takes, once per cache
        self._split: tuple[KVCaches, list[torch.Tensor], list[torch.Tensor]] | None = None

    def use_table(self, table: KernelTable) -> None:
        """Run decode steps of up to the rows `table` gives every projection's path."""
        self.max_rows = min(table.rows(path) for path in self.paths)

    def takes(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        """Whether this step is one it runs: decodes only, one row each, few enough rows."""
        return meta.num_decode_seqs == meta.num_seqs == num_tokens <= self.max_rows

    def __call__(
        self,
        x: torch.Tensor,  # [T, H]
        cos: torch.Tensor,  # [T, D / 2]
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: KVCaches,
    ) -> torch.Tensor:
        """The residual stream after the last layer (before the final norm): [T, H]."""
        if self._split is None or self._split[0] is not kv_caches:
            self._split = (kv_caches, [k for k, _ in kv_caches], [v for _, v in kv_caches])
        _, k_caches, v_caches = self._split
        return self.native.forward(
            x, cos, sin, meta.slot_mapping, meta.block_tables, meta.context_lens,
            k_caches, v_caches,
        )


def build_decode_stack(
    layers: Sequence[nn.Module], table: KernelTable = DEFAULT_TABLE
) -> DecodeStack | None:
    """The stack of `layers` (each a pre-norm DecoderLayer of a Llama-style Attention,
    full RoPE and no q/k norm, and an MLP, with packed projections: the caller checks the
    types), or None where a projection has no small-batch C++ form or the kernels are
    missing."""
    if not cpu_kernels_available():
        return None
    native = torch.classes.pagedserve.DecodeStack(list(PATHS), TENSORS_PER_KIND)
    paths: set[KernelPath] = set()
    empty = torch.empty(0)
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        forms: list[DecodeForm] = []
        for projection in projections:
            form = None if projection.packed is None else projection.packed.decode_form()
            if form is None:
                return None
            forms.append(form)
        if layer.input_layernorm.eps != layer.post_attention_layernorm.eps:
            return None
        options = attn.options
        native.add_layer(
            layer.input_layernorm.weight.detach(),
            layer.post_attention_layernorm.weight.detach(),
            float(layer.input_layernorm.eps),
            [attn.num_heads, attn.num_kv_heads, attn.head_dim, options.sliding_window or 0],
            float(attn.scale),
            float(options.softcap or 0.0),
            empty if options.sinks is None else options.sinks.detach(),
            [KIND_OF[form.path.name] for form in forms],
            [form.rotation_block for form in forms],
            [tensor for form in forms for tensor in form.tensors],
            [empty if form.bias is None else form.bias for form in forms],
        )
        paths.update(form.path for form in forms)
    return DecodeStack(native, paths, table)
