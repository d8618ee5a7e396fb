"""Granite (IBM Granite 3): Llama with four multipliers from the config: the embeddings'
(`embedding_multiplier`), the attention scores' scale (`attention_multiplier`, instead of
head_dim ** -0.5), each block's output before it joins the residual
(`residual_multiplier`) and the logits' divisor (`logits_scaling`)."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn
from transformers import PretrainedConfig

from model_runner.attention.backend import AttentionBackend, LayerOps
from model_runner.attention_metadata import AttentionMetadata
from model_runner.distributed.tensor_parallel import TensorParallel
from model_runner.models.decode_stack import StackLayer
from model_runner.models.layers import Attention
from model_runner.models.llama import DecoderLayer, LlamaForCausalLM


class GraniteDecoderLayer(DecoderLayer):
    """Llama's pre-norm block with each block's output scaled by `residual_multiplier`."""

    def __init__(self, config: PretrainedConfig, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__(config, self_attn, mlp)
        self.residual_multiplier = float(config.residual_multiplier)

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
        h = self.input_layernorm(x, ops)
        h = self.self_attn(h, cos, sin, meta, kv_cache, attn, ops)
        x = x + h * self.residual_multiplier
        h = self.mlp(self.post_attention_layernorm(x, ops), ops)
        return x + h * self.residual_multiplier

    def decode_stack_form(self) -> StackLayer | str:
        form = super().decode_stack_form()
        if isinstance(form, str):
            return form
        return replace(form, residual_multiplier=self.residual_multiplier)


class GraniteForCausalLM(LlamaForCausalLM):
    """A Granite decoder: the Llama one with the config's multipliers."""

    def make_layer(
        self, config: PretrainedConfig, layer_id: int, tp: TensorParallel | None
    ) -> nn.Module:
        return GraniteDecoderLayer(
            config, self.make_attention(config, layer_id, tp), self.make_mlp(config, layer_id, tp)
        )

    def make_attention(
        self, config: PretrainedConfig, layer_id: int, tp: TensorParallel | None
    ) -> nn.Module:
        scale = float(config.attention_multiplier)
        return Attention(config, self.head_dim, tp, rotary_dim=self.rotary_dim, scale=scale)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids) * float(self.config.embedding_multiplier)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / float(self.config.logits_scaling)
