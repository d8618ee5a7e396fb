"""gpt-oss (GptOssForCausalLM) in plain torch, over a paged KV cache.

The Llama-family decoder (llama.py) with q/k/v/o biases, YaRN RoPE (rope.py), sliding
and full layers alternating by `layer_types` (sliding_windows.py), attention sinks (one
learned logit per head joining its softmax denominator: `AttentionOptions.sinks`, which
every backend reads) and a mixture of experts in every layer's MLP seat: moe.py's block
with gpt-oss's router bias, the experts' biases and its clamped SwiGLU (on moe.py's
grouped torch path, or on CUDA the fused Triton kernel, which takes both).

The checkpoint stacks each layer's experts: `gate_up_proj` [E, H, 2I] with gate and up
interleaved (even and odd columns), `down_proj` [E, I, H], and their biases; they are
loaded here into moe.py's layout (gate rows, then up rows). Quantized (MXFP4) checkpoints
are refused: dequantize them first. Tensor parallel: each rank holds its heads' sinks
and its slice of every expert's width, as the other families do.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable
from dataclasses import replace

import torch
from torch import nn
from transformers import PretrainedConfig

from model_runner.distributed.tensor_parallel import TensorParallel
from model_runner.models.layers import Attention, is_first
from model_runner.models.llama import LlamaForCausalLM
from model_runner.models.moe import MoE, expert_width, experts_torch
from model_runner.models.weights import WeightSource, read, shape_of

# a feed-forward weight: layers.{i}.mlp.{router.weight | router.bias | experts.<name>}
_FEED_FORWARD = re.compile(r"layers\.(\d+)\.mlp\.(router\.(?:weight|bias)|experts\.\w+)")


class GptOssAttention(Attention):
    """The Llama-family attention (biases from `attention_bias`) with this rank's heads'
    sinks, which the model hands the backend on the layer's options once loaded."""

    def __init__(
        self,
        config: PretrainedConfig,
        head_dim: int,
        tp: TensorParallel | None = None,
        *,
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__(config, head_dim, tp, rotary_dim=rotary_dim)
        self.sinks = nn.Parameter(torch.empty(self.num_heads))


class GptOssMoE(MoE):
    """moe.py's block with a router bias and gpt-oss's experts: biases on gate/up and
    down, and the clamped SwiGLU (`swiglu_limit`, `swiglu_alpha`).

    NOTE: the router takes the top k of the logits and a softmax over those k, which is
    the softmax over every expert renormalised over the k: MoE's default routing."""

    router_bias = True

    def __init__(self, config: PretrainedConfig, tp: TensorParallel | None = None) -> None:
        super().__init__(config, tp)
        self.w13_bias = nn.Parameter(torch.empty(self.num_experts, 2 * self.intermediate_size))
        # the down projection is row-parallel: its bias is added once, by rank 0
        self.w2_bias = (
            nn.Parameter(torch.empty(self.num_experts, config.hidden_size)) if is_first(tp)
            else None
        )
        self.limit = float(config.swiglu_limit)
        self.alpha = float(config.swiglu_alpha)

    def experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """MoE's paths, each told of the biases and the clamped activation: the fused
        Triton kernel on CUDA, the grouped torch path elsewhere."""
        if x.is_cuda:
            from model_runner.kernels.triton_moe import fused_experts

            return fused_experts(x, weights, ids, self.w13, self.w2, self.w13_bias,
                                 self.w2_bias, self.limit, self.alpha)
        return experts_torch(
            x, weights, ids, self.w13, self.w2, self.w13_bias, self.w2_bias, self.clamped_swiglu
        )

    def clamped_swiglu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """(up + 1) * gate * sigmoid(alpha * gate), gate clamped above at the limit, up on
        both sides."""
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


class GptOssForCausalLM(LlamaForCausalLM):
    """gpt-oss: built and loaded as LlamaForCausalLM is, with its own attention and
    experts (see the module docstring)."""

    def __init__(self, config: PretrainedConfig, tp: TensorParallel | None = None) -> None:
        if getattr(config, "quantization_config", None):
            raise ValueError(
                "quantized gpt-oss checkpoints (MXFP4) are not supported: dequantize to "
                "bfloat16 first"
            )
        super().__init__(config, tp)

    def make_attention(
        self, config: PretrainedConfig, layer_id: int, tp: TensorParallel | None
    ) -> nn.Module:
        return GptOssAttention(config, self.head_dim, tp, rotary_dim=self.rotary_dim)

    def make_mlp(
        self, config: PretrainedConfig, layer_id: int, tp: TensorParallel | None
    ) -> nn.Module:
        return GptOssMoE(config, tp)

    def checkpoint_params(self) -> dict[str, nn.Parameter]:
        return {name: p for name, p in self.named_parameters() if ".mlp." not in name}

    def checkpoint_slices(self) -> dict[str, tuple[int, int, int, int]]:
        """The Llama slices, and this rank's heads of each layer's sinks (the only
        weight of `self_attn` itself)."""
        slices = super().checkpoint_slices()
        if self.tp is not None:
            start, stop = self.layers[0].self_attn.q_heads
            slices["self_attn"] = (0, start, stop, self.config.num_attention_heads)
        return slices

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, WeightSource]]) -> None:
        """The Llama loader's, with the experts' weights taken aside by `_Experts`; then
        each layer's sinks go on its attention options (float32, as the kernels read
        them, so that no step converts them)."""
        experts = _Experts(self)
        super().load_weights(itertools.filterfalse(lambda w: experts.take(*w), weights))
        experts.check_complete()
        for layer in self.layers:
            attn = layer.self_attn
            attn.options = replace(attn.options, sinks=attn.sinks.detach().float())


class _Experts:
    """Loads every layer's router and experts (this rank's slice of each expert's width)
    into the stacked parameters, de-interleaving gate and up."""

    def __init__(self, model: GptOssForCausalLM) -> None:
        self.model = model
        self.params = {n: p for n, p in model.named_parameters() if ".mlp." in n}
        self.loaded: set[str] = set()

    def take(self, hf_name: str, source: WeightSource) -> bool:
        """Copy `hf_name` if it is a router or experts weight (True), else leave it."""
        match = _FEED_FORWARD.fullmatch(hf_name.removeprefix("model."))
        if match is None:
            return False
        prefix, what = f"layers.{match[1]}.mlp.", match[2]
        start, stop = self.model.layers[int(match[1])].mlp.rows
        width = expert_width(self.model.config)
        if what.startswith("router."):
            self._copy(hf_name, prefix + "gate." + what.removeprefix("router."), source[:])
        elif what == "experts.gate_up_proj":  # [E, H, 2I] -> w13 [E, 2I, H]
            gate_up = _gate_then_up(_pairs(hf_name, source, start, stop, width))
            self._copy(hf_name, prefix + "w13", gate_up.transpose(1, 2))
        elif what == "experts.gate_up_proj_bias":  # [E, 2I]
            self._copy(hf_name, prefix + "w13_bias",
                       _gate_then_up(_pairs(hf_name, source, start, stop, width)))
        elif what == "experts.down_proj":  # [E, I, H] -> w2 [E, H, I]
            down = read(hf_name, source, (1, start, stop, width))
            self._copy(hf_name, prefix + "w2", down.transpose(1, 2))
        elif what == "experts.down_proj_bias":
            if is_first(self.model.tp):  # a row-parallel bias lives on rank 0 only
                self._copy(hf_name, prefix + "w2_bias", source[:])
        else:
            raise ValueError(f"unexpected weight {hf_name!r} in the checkpoint")
        return True

    def _copy(self, hf_name: str, target: str, tensor: torch.Tensor) -> None:
        param = self.params.get(target)
        if param is None:
            raise ValueError(f"unexpected weight {hf_name!r} in the checkpoint")
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(f"weight {hf_name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(param.shape)}")
        param.copy_(tensor)
        self.loaded.add(target)

    def check_complete(self) -> None:
        """ValueError naming the feed-forward parameters no weight came for."""
        missing = sorted(set(self.params) - self.loaded)
        if missing:
            raise ValueError(f"checkpoint lacks weights for {', '.join(missing[:5])}")


def _pairs(
    hf_name: str, source: WeightSource, start: int, stop: int, width: int
) -> torch.Tensor:
    """The interleaved (gate, up) columns of units [start, stop) of a [..., 2 * width]
    weight: columns 2 * start .. 2 * stop, read alone."""
    shape = shape_of(source)
    if shape[-1] != 2 * width:
        raise ValueError(f"weight {hf_name!r} has shape {shape}, expected {2 * width} last")
    return source[(*(slice(None),) * (len(shape) - 1), slice(2 * start, 2 * stop))]


def _gate_then_up(pairs: torch.Tensor) -> torch.Tensor:
    """[..., 2n] with gate and up interleaved -> [..., 2n], the n gates then the n ups."""
    return torch.cat([pairs[..., ::2], pairs[..., 1::2]], dim=-1)
