"""Mixture-of-experts families: Qwen3-MoE, Qwen2-MoE and Mixtral.

Each is the Llama-family decoder (Qwen3-MoE with Qwen3's per-head q/k norm, Qwen2-MoE
with q/k/v biases) whose sparse layers hold a `MoE` block (model_runner/models/moe.py)
in place of the MLP: every layer, or those `decoder_sparse_step` picks and
`mlp_only_layers` leaves out. The feed-forward weights of every layer are loaded here
(the checkpoint's per-expert names into the stacked weights, read as this rank's slice
under tensor parallelism); everything else by the Llama loader.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from model_runner.distributed.tensor_parallel import TensorParallel
from model_runner.models.layers import MLP
from model_runner.models.llama import LlamaForCausalLM
from model_runner.models.moe import MoE, expert_width
from model_runner.models.weights import WeightSource, read

# a feed-forward weight: layers.{i}.{mlp | block_sparse_moe (Mixtral)}.{rest}
_FEED_FORWARD = re.compile(r"layers\.(\d+)\.(?:mlp|block_sparse_moe)\.(.+)\.weight")
_EXPERT = re.compile(r"experts\.(\d+)\.(\w+)")
# a projection's part: 0 gate, 1 up (rows of the fused gate/up weight), 2 down
_PARTS = {"gate_proj": 0, "up_proj": 1, "down_proj": 2, "w1": 0, "w3": 1, "w2": 2}


def is_sparse(config: PretrainedConfig, layer_idx: int) -> bool:
    """Whether layer `layer_idx` holds experts (Hugging Face's rule)."""
    if layer_idx in (getattr(config, "mlp_only_layers", None) or []):
        return False
    return (layer_idx + 1) % int(getattr(config, "decoder_sparse_step", 1) or 1) == 0


class MoeForCausalLM(LlamaForCausalLM):
    """A Llama-family decoder with mixture-of-experts layers (see the module docstring)."""

    def make_mlp(
        self, config: PretrainedConfig, layer_idx: int, tp: TensorParallel | None
    ) -> nn.Module:
        return MoE(config, tp) if is_sparse(config, layer_idx) else MLP(config, tp)

    def checkpoint_params(self) -> dict[str, nn.Parameter]:
        return {name: p for name, p in self.named_parameters() if ".mlp." not in name}

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, WeightSource]]) -> None:
        """The Llama loader's, with the feed-forward weights taken aside by `_FeedForward`."""
        feed_forward = _FeedForward(self)
        super().load_weights(itertools.filterfalse(lambda w: feed_forward.take(*w), weights))
        feed_forward.check_complete()


class _FeedForward:
    """Loads the feed-forward weights of every layer: dense MLPs, routers, experts
    (stacked) and shared experts, each counted until its parameter is whole."""

    def __init__(self, model: MoeForCausalLM) -> None:
        self.model = model
        self.params = dict(model.named_parameters())
        self.modules = dict(model.named_modules())
        self.num_loaded: dict[str, int] = {}

    def take(self, hf_name: str, source: WeightSource) -> bool:
        """Copy `hf_name` if it is a feed-forward weight (True), else leave it (False)."""
        match = _FEED_FORWARD.fullmatch(hf_name.removeprefix("model."))
        if match is None:
            return False
        layer, rest = int(match[1]), match[2]
        block = self.model.layers[layer].mlp
        expert = _EXPERT.fullmatch(rest)
        if isinstance(block, MoE) and expert is not None and expert[2] in _PARTS:
            self._expert(hf_name, source, layer, block, int(expert[1]), _PARTS[expert[2]])
        elif rest in ("gate", "shared_expert_gate"):
            self._copy(hf_name, f"layers.{layer}.mlp.{rest}.weight", source[:])
        else:
            module, _, proj = rest.rpartition(".")
            self._mlp(hf_name, source, f"layers.{layer}.mlp" + (module and f".{module}"), proj)
        return True

    def _expert(
        self, hf_name: str, source: WeightSource, layer: int, block: MoE, expert: int, part: int
    ) -> None:
        if expert >= block.num_experts:
            raise ValueError(f"unexpected weight {hf_name!r} in the checkpoint")
        target = f"layers.{layer}.mlp." + ("w2" if part == 2 else "w13")
        tensor = read(hf_name, source, _where(block.rows, expert_width(self.model.config), part))
        width = block.intermediate_size
        rows = slice(part * width, (part + 1) * width) if part < 2 else slice(None)
        self._copy(hf_name, target, tensor, (expert, rows))

    def _mlp(self, hf_name: str, source: WeightSource, path: str, proj: str) -> None:
        module = self.modules.get(path) if proj in _PARTS else None
        if not isinstance(module, MLP):
            raise ValueError(f"unexpected weight {hf_name!r} in the checkpoint")
        part = _PARTS[proj]
        config = self.model.config
        full = config.intermediate_size
        if path.endswith("shared_expert"):
            full = config.shared_expert_intermediate_size
        tensor = read(hf_name, source, _where(module.rows, full, part))
        width = module.intermediate_size
        if part == 2:
            self._copy(hf_name, f"{path}.down_proj.weight", tensor)
        else:
            rows = slice(part * width, (part + 1) * width)
            self._copy(hf_name, f"{path}.gate_up_proj.weight", tensor, (rows,))

    def _copy(
        self, hf_name: str, target: str, tensor: torch.Tensor, index: tuple = ()
    ) -> None:
        param = self.params.get(target)
        if param is None:
            raise ValueError(f"unexpected weight {hf_name!r} in the checkpoint")
        dest = param[index] if index else param
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ValueError(
                f"weight {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
            )
        dest.copy_(tensor)
        self.num_loaded[target] = self.num_loaded.get(target, 0) + 1

    def check_complete(self) -> None:
        """ValueError naming the feed-forward parameters some weight never came for."""
        missing = [
            name
            for name in self.params
            if ".mlp." in name and self.num_loaded.get(name, 0) < self._num_pieces(name)
        ]
        if missing:
            raise ValueError(f"checkpoint lacks weights for {', '.join(missing[:5])}")

    def _num_pieces(self, name: str) -> int:
        """How many checkpoint weights make parameter `name` whole."""
        num_experts = self.params[name].shape[0]
        if name.endswith(".w13"):
            return 2 * num_experts
        if name.endswith(".w2"):
            return num_experts
        return 2 if name.endswith("gate_up_proj.weight") else 1


def _where(rows: tuple[int, int], full: int, part: int) -> tuple[int, int, int, int]:
    """This rank's slice of a gate/up (rows) or down (columns) weight `full` wide."""
    return (1 if part == 2 else 0, rows[0], rows[1], full)
