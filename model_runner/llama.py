"""Llama-family causal LMs (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3) in plain torch.

Built from a Hugging Face config; reads and writes a paged KV cache through an
AttentionBackend. Shapes: T = tokens in the step (all sequences flattened), H = hidden
size, D = head_dim. q/k/v and gate/up projections are fused; `load_weights` maps the
Hugging Face checkpoint names onto them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from model_runner.attention.backend import AttentionBackend, LayerOps
from model_runner.attention_metadata import AttentionMetadata
from model_runner.cpu_linear import PackedLinear, pack_linear

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (k_cache, v_cache)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def rope_parameters(config: PretrainedConfig) -> dict[str, Any]:
    """RoPE settings as one dict (rope_theta, rope_type, and the type's own fields).

    transformers 5 keeps them in `config.rope_parameters`; older configs have rope_theta
    and rope_scaling as separate attributes.
    """
    params = getattr(config, "rope_parameters", None)
    if params:
        params = dict(params)
    else:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def rope_inv_freq(config: PretrainedConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [D / 2] (float32) for default, linear and llama3 RoPE."""
    params = rope_parameters(config)
    rope_type = params["rope_type"]
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        factor = float(params["factor"])
        low_freq_factor = float(params["low_freq_factor"])
        high_freq_factor = float(params["high_freq_factor"])
        old_context_len = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        # long wavelengths are slowed down by `factor`, short ones kept, the band between
        # interpolated smoothly
        smooth = (old_context_len / wavelen - low_freq_factor) / (
            high_freq_factor - low_freq_factor
        )
        smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        scaled = torch.where(
            wavelen > old_context_len / low_freq_factor, inv_freq / factor, inv_freq
        )
        is_medium = (wavelen >= old_context_len / high_freq_factor) & (
            wavelen <= old_context_len / low_freq_factor
        )
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"unsupported RoPE type {rope_type!r} (supported: default, linear, llama3)")


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate halves (the Hugging Face layout). x: [T, heads, D]; cos, sin: [T, D / 2]."""
    x1, x2 = x.chunk(2, dim=-1)  # [T, heads, D / 2] each
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Linear(nn.Linear):
    """nn.Linear that may run on a packed copy of its weight (CPU, see cpu_linear.py).

    `pack` is called once after the weights are loaded; the packed copy is then the only
    one (the plain weight is dropped, so the weights are not held twice).
    """

    packed: PackedLinear | None = None

    def pack(self, weight_dtype: str) -> None:
        self.packed = pack_linear(self.weight, self.bias, weight_dtype)
        self.weight = _dropped(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return self.packed(x)


def _dropped(weight: nn.Parameter) -> nn.Parameter:
    """An empty stand-in for a weight whose packed copy replaced it."""
    return nn.Parameter(weight.new_empty(0), requires_grad=False)


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


class Attention(nn.Module):
    """Self-attention with fused q/k/v, RoPE, optional per-head q/k norm (Qwen3), GQA."""

    def __init__(self, config: PretrainedConfig, head_dim: int) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        model_type = config.model_type
        qkv_bias = model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
        o_bias = model_type != "qwen2" and bool(getattr(config, "attention_bias", False))
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, o_bias)
        self.qk_norm = model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)

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
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (heads + 2 * kv_heads) * D]
        fused_rope = ops is not None and (ops.takes_qk_norm or not self.qk_norm)
        if fused_rope:  # q and k normed (Qwen3) and rotated in place, in qkv
            norms = None
            if self.qk_norm:  # one eps for both (config.rms_norm_eps)
                norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
            ops.rope_(qkv, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim, norms)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, heads, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, kv_heads, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if not fused_rope:
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_cache, v_cache = kv_cache
        attn.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        o = attn.paged_attention(q, k_cache, v_cache, meta, self.scale)  # [T, heads, D]
        return self.o_proj(o.view(num_tokens, self.q_size))  # [T, H]


class MLP(nn.Module):
    """SwiGLU feed-forward with fused gate and up projections."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias)

    def forward(self, x: torch.Tensor, ops: LayerOps | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 * I]
        if ops is not None:
            return self.down_proj(ops.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)  # [T, I] each
        return self.down_proj(F.silu(gate) * up)  # [T, H]


class DecoderLayer(nn.Module):
    """Pre-norm residual block: attention, then MLP."""

    def __init__(self, config: PretrainedConfig, head_dim: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, head_dim)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionBackend,
        ops: LayerOps | None = None,
    ) -> torch.Tensor:
        """`ops`: the backend's fused kernels for the norms, RoPE and SwiGLU, or None for
        the torch code."""
        h = self.input_layernorm(x, ops)
        x = x + self.self_attn(h, cos, sin, meta, kv_cache, attn, ops)
        return x + self.mlp(self.post_attention_layernorm(x, ops), ops)


class LlamaForCausalLM(nn.Module):
    """A Llama-family decoder over a paged KV cache.

    Build it (cheaply under `torch.device("meta")`), move it with `to_empty`, then call
    `load_weights` and `init_rope_cache`. `forward` returns the final-norm hidden states of
    every token; `compute_logits` applies the LM head to the rows that sample.
    """

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model type {config.model_type!r} "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported activation {config.hidden_act!r} (only silu)")
        self.config = config
        self.head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or (
            config.num_attention_heads
        )
        self.num_layers = config.num_hidden_layers
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, self.head_dim) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.packed_lm_head: PackedLinear | None = None
        self.register_buffer("cos_cache", torch.empty(0), persistent=False)
        self.register_buffer("sin_cache", torch.empty(0), persistent=False)

    def init_rope_cache(self, max_positions: int) -> None:
        """Precompute cos and sin for positions 0..max_positions-1 on the model's device."""
        inv_freq = rope_inv_freq(self.config, self.head_dim)  # [D / 2]
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        device, dtype = self.embed_tokens.weight.device, self.embed_tokens.weight.dtype
        # NOTE: computed in float32 and cast to the model dtype, as Hugging Face does.
        self.cos_cache = freqs.cos().to(device=device, dtype=dtype)  # [max_positions, D / 2]
        self.sin_cache = freqs.sin().to(device=device, dtype=dtype)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        kv_caches: KVCaches,
        attn: AttentionBackend,
    ) -> torch.Tensor:
        """Hidden states after the final norm: [T, H]."""
        cos, sin = self.cos_cache[positions], self.sin_cache[positions]  # [T, D / 2]
        x = self.embed_tokens(input_ids)  # [T, H]
        ops = self.layer_ops(attn, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, meta, kv_cache, attn, ops)
        return self.norm(x, ops)

    def layer_ops(self, attn: AttentionBackend, dtype: torch.dtype) -> LayerOps | None:
        """The backend's fused layer kernels when they take this model and dtype."""
        ops = attn.layer_ops
        if ops is None or dtype not in ops.dtypes:
            return None
        widths = (self.config.hidden_size, self.config.intermediate_size, self.head_dim)
        return ops if all(w % ops.widths_multiple_of == 0 for w in widths) else None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head on hidden [N, H]: float32 logits [N, vocab]."""
        if self.packed_lm_head is not None:
            return self.packed_lm_head(hidden).float()
        return F.linear(hidden, self._lm_head_weight()).float()

    def _lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight

    def pack_weights(self, weight_dtype: str) -> None:
        """Pack every projection and the LM head for the CPU (see cpu_linear.can_pack)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack(weight_dtype)
        self.packed_lm_head = pack_linear(self._lm_head_weight(), None, weight_dtype)
        if not self.tie_word_embeddings:  # a tied one is the embedding table too
            self.lm_head.weight = _dropped(self.lm_head.weight)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face checkpoint tensors (name, tensor) into the fused parameters.

        Raises ValueError when a parameter is left without a weight or a shape differs.
        """
        params = dict(self.named_parameters())
        # HF name piece -> (our name piece, row offset in the fused weight)
        q_size = self.config.num_attention_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        fused = {
            "q_proj": ("qkv_proj", 0),
            "k_proj": ("qkv_proj", q_size),
            "v_proj": ("qkv_proj", q_size + kv_size),
            "gate_proj": ("gate_up_proj", 0),
            "up_proj": ("gate_up_proj", self.config.intermediate_size),
        }
        loaded: set[str] = set()
        fused_rows: dict[str, int] = {}
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name or (name == "lm_head.weight" and self.tie_word_embeddings):
                continue
            parts = name.split(".")
            target, offset = name, None
            for i, part in enumerate(parts):
                if part in fused:
                    ours, offset = fused[part]
                    target = ".".join([*parts[:i], ours, *parts[i + 1 :]])
                    break
            if target not in params:
                raise ValueError(f"unexpected weight {hf_name!r} in the checkpoint")
            param = params[target]
            if offset is None:
                if tuple(param.shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"weight {hf_name!r} has shape {tuple(tensor.shape)}, "
                        f"expected {tuple(param.shape)}"
                    )
                param.copy_(tensor)
                loaded.add(target)
            else:
                rows = tensor.shape[0]
                if offset + rows > param.shape[0] or tuple(tensor.shape[1:]) != tuple(
                    param.shape[1:]
                ):
                    raise ValueError(f"weight {hf_name!r} has an unexpected shape")
                param[offset : offset + rows].copy_(tensor)
                fused_rows[target] = fused_rows.get(target, 0) + rows
                if fused_rows[target] == param.shape[0]:
                    loaded.add(target)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks weights for {', '.join(missing[:5])}")
