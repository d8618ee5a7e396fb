"""Gemma 2 and Gemma 3 (text) causal LMs in plain torch, over a paged KV cache.

What sets them apart from the Llama family (model_runner/models/llama.py, whose attention,
projections, weight loading and tensor parallelism they reuse): RMSNorm scaling by
(1 + w), embeddings scaled by sqrt(hidden), sandwich norms (each of attention and MLP
normed before and after), a gelu (tanh) gated MLP, the softmax scale
query_pre_attn_scalar ** -0.5, local (sliding-window) and global layers by
`layer_types`; Gemma 2 soft-caps attention scores and final logits; Gemma 3 norms q and k
per head and gives its local layers their own RoPE (rope_parameters by layer type, the
rope_local_base_freq of older configs). On the "cpu" backend its layers run the C++ layer
kernels (LayerOps: the norms on 1 + w kept in float32 once loaded, gelu's tanh form) and,
for small decode steps, the C++ decode stack (decode_stack.py), each layer declaring its
form: sandwich norms, gelu gate, its RoPE table, q/k norms, scale, soft cap and window.

Shapes: T = tokens in the step, H = hidden size, D = head_dim.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from model_runner.attention.backend import AttentionBackend, AttentionOptions, LayerOps
from model_runner.attention_metadata import AttentionMetadata
from model_runner.distributed.tensor_parallel import TensorParallel
from model_runner.kernels.cpu_kernel_table import DEFAULT_TABLE, KernelTable
from model_runner.kv_cache import KVCaches
from model_runner.models.decode_stack import (
    DEFAULT_ROPE,
    StackAttention,
    StackLayer,
    StackMLP,
    StackNorm,
    form_of,
)
from model_runner.models.layers import MLP, Attention, RMSNorm
from model_runner.models.llama import LlamaForCausalLM
from model_runner.models.rope import RopeAngles, rope_inv_freq


class GemmaRMSNorm(RMSNorm):
    """RMSNorm whose learned scale is 1 + weight (Gemma's weights are stored around 0).

    The C++ kernels multiply by `scale()`: 1 + weight in float32, kept once the weights are
    loaded (`fold`), so that the Python layers and the decode stack multiply by the same
    numbers; the checkpoint's weight stays as it is (tensor parallelism, reloading)."""

    folded: torch.Tensor | None = None

    def fold(self) -> None:
        """Keep 1 + weight for the kernels (the weights are final: the model is packed)."""
        self.folded = 1.0 + self.weight.detach().float()

    def scale(self) -> torch.Tensor:
        return self.folded if self.folded is not None else 1.0 + self.weight.detach().float()

    def forward(self, x: torch.Tensor, ops: LayerOps | None = None) -> torch.Tensor:
        if ops is not None:
            return ops.rms_norm(x, self.scale(), self.eps)
        normed = torch.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)

    def decode_stack_form(self) -> StackNorm | str:
        return StackNorm(self.scale(), self.eps)


class GemmaAttention(Attention):
    """The Llama-family attention with Gemma's scale, soft cap and (Gemma 3) per-head q/k
    norm; the model sets its layer's window (LlamaForCausalLM)."""

    def __init__(
        self, config: PretrainedConfig, head_dim: int, tp: TensorParallel | None = None
    ) -> None:
        super().__init__(config, head_dim, tp)
        self.scale = float(config.query_pre_attn_scalar) ** -0.5
        self.options = AttentionOptions(softcap=getattr(config, "attn_logit_softcapping", None))
        self.qk_norm = config.model_type == "gemma3_text"
        if self.qk_norm:
            self.q_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps)


class GemmaMLP(MLP):
    """gelu(gate, tanh approximation) * up, then down (fused gate and up projections)."""

    def forward(self, x: torch.Tensor, ops: LayerOps | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 * I]
        if ops is not None and ops.gelu_tanh_and_mul is not None:
            out = self.down_proj(ops.gelu_tanh_and_mul(gate_up))
        else:
            gate, up = gate_up.chunk(2, dim=-1)  # [T, I] each
            out = self.down_proj(F.gelu(gate, approximate="tanh") * up)  # [T, H]
        return out if self.tp is None else self.tp.all_reduce(out)

    def decode_stack_form(self) -> StackMLP | str:
        form = super().decode_stack_form()
        return form if isinstance(form, str) else replace(form, activation="gelu_tanh")


class GemmaDecoderLayer(nn.Module):
    """Sandwich-normed residual block: x + post_norm(attn(pre_norm(x))), then the same
    around the MLP. `rope_key` names the RoPE table of its layer type."""

    def __init__(
        self,
        config: PretrainedConfig,
        head_dim: int,
        layer_type: str,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.rope_key = layer_type if _rope_by_layer_type(config) else DEFAULT_ROPE
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.self_attn = GemmaAttention(config, head_dim, tp)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.mlp = GemmaMLP(config, tp)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        cos: torch.Tensor,  # [T, D / 2]
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionBackend,
        ops: LayerOps | None = None,
    ) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x, ops), cos, sin, meta, kv_cache, attn, ops)
        x = x + self.post_attention_layernorm(h, ops)
        h = self.mlp(self.pre_feedforward_layernorm(x, ops), ops)
        return x + self.post_feedforward_layernorm(h, ops)

    def decode_stack_form(self) -> StackLayer | str:
        """This layer as the C++ decode stack repeats it (decode_stack.py), or why not."""
        parts = {}
        for name, kind in [("input_layernorm", StackNorm), ("self_attn", StackAttention),
                           ("post_attention_layernorm", StackNorm),
                           ("pre_feedforward_layernorm", StackNorm), ("mlp", StackMLP),
                           ("post_feedforward_layernorm", StackNorm)]:
            form = form_of(getattr(self, name), name, kind)
            if isinstance(form, str):
                return form
            parts[name] = form
        return StackLayer(
            parts["input_layernorm"], parts["pre_feedforward_layernorm"], parts["self_attn"],
            parts["mlp"], attention_out_norm=parts["post_attention_layernorm"],
            mlp_out_norm=parts["post_feedforward_layernorm"], rope=self.rope_key,
        )


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 (Gemma2ForCausalLM) and Gemma 3 text (Gemma3ForCausalLM) decoders.

    Built and loaded as LlamaForCausalLM is (the checkpoint names and the tensor-parallel
    shards are the same); its own layers, RoPE tables, scaled embeddings and soft-capped
    logits.
    """

    def __init__(self, config: PretrainedConfig, tp: TensorParallel | None = None) -> None:
        activation = getattr(config, "hidden_activation", None) or "gelu_pytorch_tanh"
        if activation != "gelu_pytorch_tanh":
            raise ValueError(f"unsupported activation {activation!r} (only gelu_pytorch_tanh)")
        super().__init__(config, tp)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.final_softcap = getattr(config, "final_logit_softcapping", None)
        self.ropes: dict[str, RopeAngles] = {}  # by rope key, once `init_rope` sets them

    def make_layer(
        self, config: PretrainedConfig, layer_id: int, tp: TensorParallel | None
    ) -> nn.Module:
        layer_types = config.layer_types or ["full_attention"] * config.num_hidden_layers
        return GemmaDecoderLayer(config, self.head_dim, layer_types[layer_id], tp)

    def init_rope(self, max_positions: int) -> None:
        """Each RoPE the layers use (no attention factor; `max_positions` picks nothing)."""
        weight = self.embed_tokens.weight
        for key in {layer.rope_key for layer in self.layers}:
            params = self.config.rope_parameters
            params = params[key] if key != DEFAULT_ROPE else params
            inv_freq = rope_inv_freq(SimpleNamespace(rope_parameters=params), self.head_dim)
            self.ropes[key] = RopeAngles(inv_freq.to(weight.device), 1.0, weight.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        kv_caches: KVCaches,
        attn: AttentionBackend,
    ) -> torch.Tensor:
        """Hidden states after the final norm: [T, H]."""
        ropes = {key: rope(positions) for key, rope in self.ropes.items()}  # [T, D / 2] each
        x = self.embed(input_ids)  # [T, H]
        ops = self.layer_ops(attn, x.dtype)
        if self.decode_stack is not None and self.runs_decode_stack(meta, x, attn, ops):
            x = self.decode_stack(x, ropes, meta, kv_caches, *self.stacked_lora())
        else:
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                x = layer(x, *ropes[layer.rope_key], meta, kv_cache, attn, ops)
        return self.norm(x, ops)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embeddings [T, H] times sqrt(hidden), rounded to the model's dtype first as
        Hugging Face does."""
        x = super().embed(input_ids)
        return x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)

    def layer_ops(self, attn: AttentionBackend, dtype: torch.dtype) -> LayerOps | None:
        """The backend's layer kernels when they gate by gelu too (the norms multiply by
        `GemmaRMSNorm.scale()`)."""
        ops = super().layer_ops(attn, dtype)
        return ops if ops is not None and ops.gelu_tanh_and_mul is not None else None

    def pack_weights(self, weight_dtype: str, table: KernelTable = DEFAULT_TABLE) -> None:
        """As LlamaForCausalLM's, the norms' 1 + w kept first (`GemmaRMSNorm.fold`)."""
        for module in self.modules():
            if isinstance(module, GemmaRMSNorm):
                module.fold()
        super().pack_weights(weight_dtype, table)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """As LlamaForCausalLM's, soft-capped by final_logit_softcapping when set."""
        logits = super().compute_logits(hidden)
        if self.final_softcap is None:
            return logits
        return torch.tanh(logits / self.final_softcap) * self.final_softcap


def _rope_by_layer_type(config: PretrainedConfig) -> bool:
    """Whether rope_parameters holds one RoPE per layer type (Gemma 3)."""
    params = getattr(config, "rope_parameters", None) or {}
    return "full_attention" in params or "sliding_attention" in params
