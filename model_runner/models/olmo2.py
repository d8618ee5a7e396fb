"""OLMo 2: no pre-norms; each block's output is normed before it joins the residual
(`post_attention_layernorm`, `post_feedforward_layernorm`), and q and k are RMS-normed
over the whole projection (all heads at once, not per head) before RoPE.

Its norms apply the weight in float32, before the cast back to the model dtype (Llama's
after), so they run the torch code: the backends' fused norms round as Llama's does.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from model_runner.attention.backend import AttentionBackend, LayerOps
from model_runner.attention_metadata import AttentionMetadata
from model_runner.distributed.tensor_parallel import TensorParallel
from model_runner.models.layers import MLP, Attention, RMSNorm
from model_runner.models.llama import LlamaForCausalLM
from model_runner.models.rope import apply_rope


class Olmo2RMSNorm(RMSNorm):
    """RMSNorm with the weight applied in float32 (always the torch code)."""

    def forward(self, x: torch.Tensor, ops: LayerOps | None = None) -> torch.Tensor:
        normed = torch.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (self.weight * normed).to(x.dtype)

    def decode_stack_form(self) -> str:
        return "always the torch code (not the C++ stack's)"


class Olmo2Attention(Attention):
    """Attention whose q and k are normed over the whole projection, then rotated.

    Under tensor parallelism a rank holds part of each projection: the sums of squares
    are summed over the ranks (one all-reduce of [T, 2]); `q_norm` and `k_norm` hold this
    rank's slice of the weights."""

    def __init__(
        self,
        config: PretrainedConfig,
        head_dim: int,
        tp: TensorParallel | None = None,
        *,
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__(config, head_dim, tp, rotary_dim=rotary_dim)
        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.q_norm = RMSNorm(self.q_size, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.kv_size, config.rms_norm_eps)
        self.q_width = config.num_attention_heads * head_dim  # the whole projections'
        self.k_width = num_kv_heads * head_dim
        # a KV head replicated on several ranks (fewer KV heads than ranks) counts once
        self.kv_replicas = 1 if tp is None else max(1, tp.world_size // num_kv_heads)

    def decode_stack_form(self) -> str:
        return "q and k normed over the whole projection (not in the C++ stack)"

    def qkv(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ops: LayerOps | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self._norm_whole(q, k)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, heads, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, kv_heads, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _norm_whole(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, q_size] and k [T, kv_size] RMS-normed over the whole projections."""
        q32, k32 = q.float(), k.float()
        sums = torch.stack(  # [T, 2]: this rank's sums of squares
            [q32.square().sum(-1), k32.square().sum(-1) / self.kv_replicas], dim=-1
        )
        if self.tp is not None:
            self.tp.all_reduce(sums)
        q32 = q32 * torch.rsqrt(sums[:, :1] / self.q_width + self.q_norm.eps)
        k32 = k32 * torch.rsqrt(sums[:, 1:] / self.k_width + self.k_norm.eps)
        return (self.q_norm.weight * q32).to(q.dtype), (self.k_norm.weight * k32).to(k.dtype)


class Olmo2DecoderLayer(nn.Module):
    """Post-norm residual block: x + norm(attention(x)), then x + norm(mlp(x))."""

    def __init__(
        self, config: PretrainedConfig, self_attn: nn.Module, tp: TensorParallel | None = None
    ) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.post_attention_layernorm = Olmo2RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, tp)
        self.post_feedforward_layernorm = Olmo2RMSNorm(config.hidden_size, config.rms_norm_eps)

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
        h = self.self_attn(x, cos, sin, meta, kv_cache, attn, ops)
        x = x + self.post_attention_layernorm(h)
        return x + self.post_feedforward_layernorm(self.mlp(x, ops))


class Olmo2ForCausalLM(LlamaForCausalLM):
    """An OLMo 2 decoder: post-norm layers and an OLMo 2 final norm."""

    def __init__(self, config: PretrainedConfig, tp: TensorParallel | None = None) -> None:
        super().__init__(config, tp)
        self.norm = Olmo2RMSNorm(config.hidden_size, config.rms_norm_eps)

    def make_layer(
        self, config: PretrainedConfig, layer_id: int, tp: TensorParallel | None
    ) -> nn.Module:
        attention = Olmo2Attention(config, self.head_dim, tp, rotary_dim=self.rotary_dim)
        return Olmo2DecoderLayer(config, attention, tp)

    def checkpoint_slices(self) -> dict[str, tuple[int, int, int, int]]:
        slices = super().checkpoint_slices()
        if slices:  # the norms' weights are sliced as the projections' rows
            slices.update(q_norm=slices["q_proj"], k_norm=slices["k_proj"])
        return slices
