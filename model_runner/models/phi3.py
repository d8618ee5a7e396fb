"""Phi-3 (and Phi-4-mini, the same architecture): Llama whose checkpoint fuses q/k/v
(`qkv_proj`) and gate/up (`gate_up_proj`). Its partial rotary and LongRoPE are the shared
rope.py's, read from the config."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from model_runner.models.llama import LlamaForCausalLM
from model_runner.models.weights import RowRange, WeightSource


class Phi3ForCausalLM(LlamaForCausalLM):
    """A Phi-3 decoder: the Llama one, reading the fused checkpoint weights by their parts
    (so that a tensor-parallel rank reads only its own rows of each)."""

    def load_weights(self, weights: Iterable[tuple[str, WeightSource]]) -> None:
        super().load_weights(self._split_fused(weights))

    def _split_fused(
        self, weights: Iterable[tuple[str, WeightSource]]
    ) -> Iterator[tuple[str, WeightSource]]:
        """Every weight, a fused one as its parts under Llama's names (rows of it)."""
        config = self.config
        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        q, kv = config.num_attention_heads * self.head_dim, num_kv_heads * self.head_dim
        width = config.intermediate_size
        parts = {
            "qkv_proj": [("q_proj", 0, q), ("k_proj", q, q + kv), ("v_proj", q + kv, q + 2 * kv)],
            "gate_up_proj": [("gate_proj", 0, width), ("up_proj", width, 2 * width)],
        }
        for name, source in weights:
            head, _, leaf = name.rpartition(".")
            prefix, _, module = head.rpartition(".")
            if module not in parts:
                yield name, source
                continue
            for part, start, stop in parts[module]:
                yield f"{prefix}.{part}.{leaf}", RowRange(source, start, stop)
