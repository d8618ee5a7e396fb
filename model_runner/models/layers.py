"""The layers every decoder family here is built from: linear projections (on packed CPU
weights when packed), RMSNorm, self-attention over the paged KV cache and the SwiGLU MLP,
whole or as one tensor-parallel rank's shard.

Shapes: T = tokens in the step (all sequences flattened), H = hidden size, D = head_dim,
R = the rotated dims of a head (D, or fewer with partial rotary). q/k/v and gate/up
projections are fused. Under tensor parallelism each rank holds a slice of the attention
heads (q/k/v column-parallel, o row-parallel) and of the MLP's intermediate width
(gate/up column-parallel, down row-parallel); the row-parallel outputs are summed over
the ranks (one all-reduce each).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from model_runner.attention.backend import (
    FULL_ATTENTION,
    AttentionBackend,
    AttentionOptions,
    LayerOps,
)
from model_runner.attention_metadata import AttentionMetadata
from model_runner.distributed.tensor_parallel import TensorParallel
from model_runner.kernels.block_quant import GGUFBlocks
from model_runner.kernels.cpu_kernel_table import DEFAULT_TABLE, KernelTable
from model_runner.kernels.cpu_linear import PackedLinear, pack_linear
from model_runner.kernels.small_batch import ProjectionForm
from model_runner.models.decode_stack import StackAttention, StackMLP, StackNorm, form_of
from model_runner.models.rope import apply_rope

if TYPE_CHECKING:
    from model_runner.lora_layers import LoRAProjection


class Linear(nn.Linear):
    """nn.Linear that may run on a packed copy of its weight (CPU, see cpu_linear.py).

    `pack` is called once after the weights are loaded; the packed copy is then the only
    one (the plain weight is dropped, so the weights are not held twice). `lora`: its
    LoRA adapters (model_runner/lora_layers.py), whose deltas follow the base projection
    on the rows of the step's adapters.
    """

    packed: PackedLinear | None = None
    lora: LoRAProjection | None = None

    def pack(
        self, weight_dtype: str, table: KernelTable = DEFAULT_TABLE,
        parts: Sequence[tuple[int, GGUFBlocks]] = (),
    ) -> None:
        """`parts`: rows of the weight left in a GGUF's blocks (cpu_linear.py)."""
        self.packed = pack_linear(self.weight, self.bias, weight_dtype, table, parts=parts)
        self.weight = dropped(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias) if self.packed is None else self.packed(x)
        lora = self.lora
        if lora is not None and lora.step.runs:
            return lora.apply_(x, out)
        return out

    def decode_form(self) -> ProjectionForm | str:
        """Its small-batch copy as the C++ decode stack holds it, or why there is none."""
        form = None if self.packed is None else self.packed.decode_form()
        return "not on a small-batch C++ path" if form is None else form


def dropped(weight: nn.Parameter) -> nn.Parameter:
    """An empty stand-in for a weight whose packed copy replaced it."""
    return nn.Parameter(weight.new_empty(0), requires_grad=False)


def is_first(tp: TensorParallel | None) -> bool:
    """Whether this process adds a row-parallel layer's bias (rank 0 only, once)."""
    return tp is None or tp.rank == 0


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale (no bias, no mean)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, ops: LayerOps | None = None) -> torch.Tensor:
        if ops is not None:
            return ops.rms_norm(x, self.weight, self.eps)
        # NOTE: normalise in float32 and cast back before the weight, as Hugging Face does,
        # so bfloat16 runs round the same way; one fused kernel instead of five ops.
        normed = torch.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)

    def scale(self) -> torch.Tensor:
        """What the C++ kernels multiply the normed rows by (LayerOps): the weight."""
        return self.weight

    def decode_stack_form(self) -> StackNorm | str:
        """This norm as the C++ decode stack runs it (decode_stack.py), or why not."""
        return StackNorm(self.scale().detach(), self.eps)


class Attention(nn.Module):
    """Self-attention with fused q/k/v, RoPE, optional per-head q/k norm (Qwen3), GQA.

    RoPE turns the first `rotary_dim` dims of each head (default all; 0: a layer without
    positions, NoPE); `scale` multiplies the scores (default D ** -0.5).
    Under tensor parallelism: this rank's heads `q_heads` and `kv_heads` ([start, stop) of
    the model's), and the o projection's partial sums all-reduced. `options`: the layer's
    sliding window and soft cap, passed to the backend."""

    options: AttentionOptions = FULL_ATTENTION

    def __init__(
        self,
        config: PretrainedConfig,
        head_dim: int,
        tp: TensorParallel | None = None,
        *,
        rotary_dim: int | None = None,
        scale: float | None = None,
    ) -> None:
        super().__init__()
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        self.tp = tp
        self.q_heads, self.kv_heads = (
            ((0, num_heads), (0, num_kv_heads)) if tp is None
            else tp.heads(num_heads, num_kv_heads)
        )
        self.num_heads = self.q_heads[1] - self.q_heads[0]
        self.num_kv_heads = self.kv_heads[1] - self.kv_heads[0]
        self.head_dim = head_dim
        self.rotary_dim = head_dim if rotary_dim is None else rotary_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        model_type = config.model_type
        qkv_bias = model_type == "qwen2" or any(
            bool(getattr(config, key, False)) for key in ("attention_bias", "qkv_bias")
        )
        o_bias = model_type != "qwen2" and bool(getattr(config, "attention_bias", False))
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, qkv_bias)
        # a row-parallel bias is added once, by rank 0
        self.o_proj = Linear(self.q_size, config.hidden_size, o_bias and is_first(tp))
        self.qk_norm = model_type in ("qwen3", "qwen3_moe")
        if self.qk_norm:
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        cos: torch.Tensor,  # [T, R / 2]
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionBackend,
        ops: LayerOps | None = None,
    ) -> torch.Tensor:
        q, k, v = self.qkv(self.qkv_proj(x), cos, sin, ops)
        k_cache, v_cache = kv_cache
        attn.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        # o: [T, heads, D]
        o = attn.paged_attention(q, k_cache, v_cache, meta, self.scale, options=self.options)
        out = self.o_proj(o.view(x.shape[0], self.q_size))  # [T, H]
        return out if self.tp is None else self.tp.all_reduce(out)

    def decode_stack_form(self) -> StackAttention | str:
        """This attention as the C++ decode stack runs it (decode_stack.py), or why not."""
        if self.tp is not None:
            return "a tensor-parallel shard (its output is all-reduced)"
        if self.rotary_dim not in (0, self.head_dim):
            return f"RoPE on {self.rotary_dim} of {self.head_dim} dims (partial)"
        if self.qk_norm and not self.rotary_dim:
            return "q/k norms without RoPE (the layer kernels norm them with RoPE)"
        if self.head_dim % 16:
            return f"head_dim {self.head_dim}, not a multiple of 16"
        qkv, o = self.qkv_proj.decode_form(), self.o_proj.decode_form()
        if isinstance(qkv, str):
            return f"qkv_proj: {qkv}"
        if isinstance(o, str):
            return f"o_proj: {o}"
        q_norm = k_norm = None
        if self.qk_norm:  # run with RoPE, as the "cpu" LayerOps.rope_ runs them
            q_norm = form_of(self.q_norm, "q_norm", StackNorm)
            k_norm = form_of(self.k_norm, "k_norm", StackNorm)
            for norm in (q_norm, k_norm):
                if isinstance(norm, str):
                    return norm
        options = self.options
        return StackAttention(
            self.num_heads, self.num_kv_heads, self.head_dim, options.sliding_window or 0,
            self.scale, options.softcap or 0.0,
            None if options.sinks is None else options.sinks.detach(), qkv, o, q_norm, k_norm,
            rotates=self.rotary_dim > 0,
        )

    def qkv(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ops: LayerOps | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The projected rows [T, (heads + 2 * kv_heads) * D] as q [T, heads, D], k and v
        [T, kv_heads, D]: q and k normed (Qwen3) and rotated."""
        num_tokens = qkv.shape[0]
        fused_rope = (
            ops is not None
            and self.rotary_dim == self.head_dim
            and (ops.takes_qk_norm or not self.qk_norm)
        )
        if fused_rope:  # q and k normed (Qwen3) and rotated in place, in qkv
            norms = None
            if self.qk_norm:  # one eps for both (config.rms_norm_eps)
                norms = (self.q_norm.scale(), self.k_norm.scale(), self.q_norm.eps)
            ops.rope_(qkv, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim, norms)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, heads, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, kv_heads, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if not fused_rope:
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            if self.rotary_dim:
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return q, k, v


class MLP(nn.Module):
    """SwiGLU feed-forward with fused gate and up projections.

    Under tensor parallelism: this rank's `rows` ([start, stop) of the intermediate
    width, `width` or the config's), and the down projection's partial sums all-reduced."""

    def __init__(
        self, config: PretrainedConfig, tp: TensorParallel | None = None, width: int | None = None
    ) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        width = width or config.intermediate_size
        self.tp = tp
        self.rows = (0, width) if tp is None else tp.split(width)
        self.intermediate_size = self.rows[1] - self.rows[0]
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.intermediate_size, bias)
        self.down_proj = Linear(self.intermediate_size, config.hidden_size, bias and is_first(tp))

    def forward(self, x: torch.Tensor, ops: LayerOps | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 * I]
        if ops is not None:
            out = self.down_proj(ops.silu_and_mul(gate_up))
        else:
            gate, up = gate_up.chunk(2, dim=-1)  # [T, I] each
            out = self.down_proj(F.silu(gate) * up)  # [T, H]
        return out if self.tp is None else self.tp.all_reduce(out)

    def decode_stack_form(self) -> StackMLP | str:
        """This MLP as the C++ decode stack runs it (decode_stack.py), or why not."""
        if self.tp is not None:
            return "a tensor-parallel shard (its output is all-reduced)"
        gate_up, down = self.gate_up_proj.decode_form(), self.down_proj.decode_form()
        if isinstance(gate_up, str):
            return f"gate_up_proj: {gate_up}"
        if isinstance(down, str):
            return f"down_proj: {down}"
        return StackMLP(gate_up, down)
