"""Llama-family causal LMs (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3) in plain torch.

Built from a Hugging Face config; reads and writes a paged KV cache through an
AttentionBackend. Shapes: T = tokens in the step (all sequences flattened), H = hidden
size, D = head_dim. q/k/v and gate/up projections are fused; `load_weights` maps the
Hugging Face checkpoint names onto them.

Tensor parallel (a `TensorParallel` given): each rank holds its slice of the attention
heads (q/k/v column-parallel, o row-parallel), of the MLP's intermediate width (gate/up
column-parallel, down row-parallel) and of the vocabulary (embedding and LM head); the
row-parallel outputs and the embedding are summed over the ranks (one all-reduce each),
the logits gathered on rank 0. `load_weights` reads only this rank's slices.
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
from model_runner.distributed.tensor_parallel import TensorParallel
from model_runner.kernels.cpu_linear import PackedLinear, pack_linear

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (k_cache, v_cache)


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
    """Self-attention with fused q/k/v, RoPE, optional per-head q/k norm (Qwen3), GQA.

    Under tensor parallelism: this rank's heads `q_heads` and `kv_heads` ([start, stop) of
    the model's), and the o projection's partial sums all-reduced."""

    def __init__(
        self, config: PretrainedConfig, head_dim: int, tp: TensorParallel | None = None
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
        self.scale = head_dim**-0.5
        model_type = config.model_type
        qkv_bias = model_type == "qwen2" or any(
            bool(getattr(config, key, False)) for key in ("attention_bias", "qkv_bias")
        )
        o_bias = model_type != "qwen2" and bool(getattr(config, "attention_bias", False))
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, qkv_bias)
        # a row-parallel bias is added once, by rank 0
        self.o_proj = Linear(self.q_size, config.hidden_size, o_bias and _is_first(tp))
        self.qk_norm = model_type in ("qwen3", "qwen3_moe")
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
        out = self.o_proj(o.view(num_tokens, self.q_size))  # [T, H]
        return out if self.tp is None else self.tp.all_reduce(out)


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
        self.down_proj = Linear(self.intermediate_size, config.hidden_size, bias and _is_first(tp))

    def forward(self, x: torch.Tensor, ops: LayerOps | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 * I]
        if ops is not None:
            out = self.down_proj(ops.silu_and_mul(gate_up))
        else:
            gate, up = gate_up.chunk(2, dim=-1)  # [T, I] each
            out = self.down_proj(F.silu(gate) * up)  # [T, H]
        return out if self.tp is None else self.tp.all_reduce(out)


def _is_first(tp: TensorParallel | None) -> bool:
    return tp is None or tp.rank == 0


class DecoderLayer(nn.Module):
    """Pre-norm residual block: attention, then the MLP (or what stands in for it: a
    mixture of experts)."""

    def __init__(
        self, config: PretrainedConfig, head_dim: int, tp: TensorParallel | None, mlp: nn.Module
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, head_dim, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp

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
    With `tp`, this rank's shard of the model (see the module docstring); `num_kv_heads`
    is then this rank's.
    """

    def __init__(self, config: PretrainedConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported activation {config.hidden_act!r} (only silu)")
        self.config = config
        self.head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        self.tp = tp
        self.num_layers = config.num_hidden_layers
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.vocab_size = config.vocab_size
        # this rank's [start, stop) of the vocabulary, in `vocab_rows` rows (zero padded)
        self.vocab_start, self.vocab_stop, vocab_rows = (
            (0, self.vocab_size, self.vocab_size) if tp is None else tp.vocab(self.vocab_size)
        )
        self.embed_tokens = nn.Embedding(vocab_rows, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, self.head_dim, tp, self.make_mlp(config, i, tp))
            for i in range(config.num_hidden_layers)
        )
        self.num_kv_heads = self.layers[0].self_attn.num_kv_heads
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, vocab_rows, bias=False)
        self.packed_lm_head: PackedLinear | None = None
        self.register_buffer("cos_cache", torch.empty(0), persistent=False)
        self.register_buffer("sin_cache", torch.empty(0), persistent=False)

    def make_mlp(
        self, config: PretrainedConfig, layer_idx: int, tp: TensorParallel | None
    ) -> nn.Module:
        """Layer `layer_idx`'s feed-forward block (a family with experts overrides it)."""
        return MLP(config, tp)

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
        x = self.embed(input_ids)  # [T, H]
        ops = self.layer_ops(attn, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, meta, kv_cache, attn, ops)
        return self.norm(x, ops)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embeddings [T, H] of input_ids [T]; vocab-parallel: each rank looks up the ids
        it holds (zeros for the others), summed over the ranks."""
        if self.tp is None:
            return self.embed_tokens(input_ids)
        local = input_ids - self.vocab_start
        elsewhere = (local < 0) | (local >= self.vocab_stop - self.vocab_start)  # [T]
        x = self.embed_tokens(local.masked_fill(elsewhere, 0))
        return self.tp.all_reduce(x.masked_fill_(elsewhere[:, None], 0.0))

    def layer_ops(self, attn: AttentionBackend, dtype: torch.dtype) -> LayerOps | None:
        """The backend's fused layer kernels when they take this model and dtype."""
        ops = attn.layer_ops
        if ops is None or dtype not in ops.dtypes:
            return None
        widths = (self.config.hidden_size, self.layers[0].mlp.intermediate_size, self.head_dim)
        return ops if all(w % ops.widths_multiple_of == 0 for w in widths) else None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head on hidden [N, H]: float32 logits [N, vocab].

        Vocab-parallel, a collective: every rank calls it; rank 0 gets the whole logits,
        the others only their slice."""
        if self.packed_lm_head is not None:
            logits = self.packed_lm_head(hidden)
        else:
            logits = F.linear(hidden, self._lm_head_weight())
        if self.tp is not None:
            logits = self.tp.gather_last_dim(logits)[:, : self.vocab_size]
        return logits.float()

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
    def load_weights(self, weights: Iterable[tuple[str, WeightSource]]) -> None:
        """Copy Hugging Face checkpoint weights (name, tensor or safetensors slice) into the
        fused parameters, reading only this rank's slice of each under tensor parallelism.

        Raises ValueError when a parameter is left without a weight or a shape differs.
        """
        params = self.checkpoint_params()
        attn, mlp = self.layers[0].self_attn, self.layers[0].mlp
        # HF module name -> (our module name, row offset in the fused weight)
        fused = {
            "q_proj": ("qkv_proj", 0),
            "k_proj": ("qkv_proj", attn.q_size),
            "v_proj": ("qkv_proj", attn.q_size + attn.kv_size),
            "gate_proj": ("gate_up_proj", 0),
            "up_proj": ("gate_up_proj", mlp.intermediate_size),
        }
        slices = self._checkpoint_slices()
        loaded: set[str] = set()
        fused_rows: dict[str, int] = {}
        for hf_name, source in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name or (name == "lm_head.weight" and self.tie_word_embeddings):
                continue
            parts = name.split(".")
            module = parts[-2] if len(parts) > 1 else ""
            target, offset = name, None
            if module in fused:
                ours, offset = fused[module]
                target = ".".join([*parts[:-2], ours, parts[-1]])
            where = slices.get(module)
            if where is not None and where[0] == 1 and parts[-1] == "bias":
                if not _is_first(self.tp):
                    continue  # a row-parallel layer's bias lives on rank 0 only, whole
                where = None
            if target not in params:
                raise ValueError(f"unexpected weight {hf_name!r} in the checkpoint")
            param = params[target]
            tensor = _read(hf_name, source, where)
            if module in ("embed_tokens", "lm_head") and tensor.shape[0] < param.shape[0]:
                tensor = F.pad(tensor, (0, 0, 0, param.shape[0] - tensor.shape[0]))
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

    def checkpoint_params(self) -> dict[str, nn.Parameter]:
        """The parameters `load_weights` fills (a family loading some itself leaves them
        out)."""
        return dict(self.named_parameters())

    def _checkpoint_slices(self) -> dict[str, tuple[int, int, int, int]]:
        """HF module name -> (dim, start, stop, size): this rank reads [start, stop) along
        `dim` of that module's checkpoint weight, `size` long there. Absent: read whole."""
        if self.tp is None:
            return {}
        attn, mlp, d = self.layers[0].self_attn, self.layers[0].mlp, self.head_dim
        config = self.config
        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        q = (attn.q_heads[0] * d, attn.q_heads[1] * d, config.num_attention_heads * d)
        kv = (attn.kv_heads[0] * d, attn.kv_heads[1] * d, num_kv_heads * d)
        rows = (*mlp.rows, config.intermediate_size)
        vocab = (self.vocab_start, self.vocab_stop, self.vocab_size)
        return {
            "q_proj": (0, *q), "k_proj": (0, *kv), "v_proj": (0, *kv), "o_proj": (1, *q),
            "gate_proj": (0, *rows), "up_proj": (0, *rows), "down_proj": (1, *rows),
            "embed_tokens": (0, *vocab), "lm_head": (0, *vocab),
        }


# A checkpoint weight: a tensor, or a safetensors slice (read only as far as indexed).
WeightSource = Any


def _read(
    name: str, source: WeightSource, where: tuple[int, int, int, int] | None
) -> torch.Tensor:
    """The whole of `source`, or its [start, stop) along dim (0 or 1) of `where`."""
    if where is None:
        return source[:]
    dim, start, stop, size = where
    shape = tuple(source.shape if isinstance(source, torch.Tensor) else source.get_shape())
    if len(shape) <= dim or shape[dim] != size:
        raise ValueError(f"weight {name!r} has shape {shape}, expected {size} along dim {dim}")
    return source[start:stop] if dim == 0 else source[:, start:stop]
