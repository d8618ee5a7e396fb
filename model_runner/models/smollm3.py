"""SmolLM3: Llama whose every `no_rope_layer_interval`-th layer attends without positions
(NoPE), as `no_rope_layers` marks them (0: no RoPE)."""

from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from model_runner.distributed.tensor_parallel import TensorParallel
from model_runner.models.layers import Attention
from model_runner.models.llama import LlamaForCausalLM


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """A SmolLM3 decoder: the Llama one with its NoPE layers' RoPE left out."""

    def make_attention(
        self, config: PretrainedConfig, layer_id: int, tp: TensorParallel | None
    ) -> nn.Module:
        rotary_dim = self.rotary_dim if config.no_rope_layers[layer_id] else 0
        return Attention(config, self.head_dim, tp, rotary_dim=rotary_dim)
