"""Rotary position embeddings read from a Hugging Face config: the settings, the inverse
frequencies of each supported RoPE type, the cos/sin of a step's positions and the
rotation itself."""

from __future__ import annotations

import math
from typing import Any

import torch
from transformers import PretrainedConfig

ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")


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


def rotary_dim(config: PretrainedConfig, head_dim: int) -> int:
    """How many of a head's `head_dim` dims are rotated (`partial_rotary_factor`, Phi-3
    and others; all by default)."""
    factor = rope_parameters(config).get("partial_rotary_factor")
    if factor is None:
        factor = getattr(config, "partial_rotary_factor", None) or 1.0
    return int(head_dim * float(factor))


def rope_inv_freq(config: PretrainedConfig, dim: int, long: bool = False) -> torch.Tensor:
    """Inverse frequencies [dim / 2] (float32) of the config's RoPE type, for a rotary
    width `dim`; ValueError for an unsupported type.

    LongRoPE has two sets, for positions below and from `original_max_position_embeddings`:
    the short one, or the long one with `long` (see RopeAngles.of).
    """
    params = rope_parameters(config)
    rope_type = params["rope_type"]
    base = float(params["rope_theta"])
    powers = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if rope_type == "longrope":
        factors = torch.tensor(params["long_factor" if long else "short_factor"])
        return 1.0 / (factors.float() * powers)
    inv_freq = 1.0 / powers
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params)
    if rope_type == "yarn":
        original = _original_max_positions(config)
        return _yarn_inv_freq(inv_freq, params, dim, _yarn_factor(config), original)
    raise ValueError(
        f"unsupported RoPE type {rope_type!r} (supported: {', '.join(ROPE_TYPES)})"
    )


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    factor = float(params["factor"])
    low_freq_factor = float(params["low_freq_factor"])
    high_freq_factor = float(params["high_freq_factor"])
    old_context_len = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are slowed down by `factor`, short ones kept, the band between
    # interpolated smoothly
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_context_len / low_freq_factor, inv_freq / factor, inv_freq)
    is_medium = (wavelen >= old_context_len / high_freq_factor) & (
        wavelen <= old_context_len / low_freq_factor
    )
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(
    inv_freq: torch.Tensor, params: dict[str, Any], dim: int, factor: float, original: int
) -> torch.Tensor:
    """YaRN: the dims that turn fewer than `beta_slow` times over the original context
    are slowed down by `factor` (interpolated), those that turn more than `beta_fast`
    times kept (extrapolated), a linear ramp between them (its ends rounded outwards
    unless `truncate` is false)."""
    base = float(params["rope_theta"])
    beta_fast = float(params.get("beta_fast") or 32)
    beta_slow = float(params.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:  # the dim turning `rotations` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = (torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low or 0.001)
    kept = 1 - ramp.clamp(0, 1)  # 1: extrapolated, 0: interpolated
    return inv_freq / factor * (1 - kept) + inv_freq * kept


def _original_max_positions(config: PretrainedConfig) -> int:
    params = rope_parameters(config)
    value = params.get("original_max_position_embeddings") or getattr(
        config, "original_max_position_embeddings", None
    )
    return int(value or config.max_position_embeddings)


def _attention_factor(config: PretrainedConfig) -> float:
    """The scale of cos and sin: LongRoPE's and YaRN's `attention_factor`, else their
    papers' (from how far the context was stretched); 1 for the other types."""
    params = rope_parameters(config)
    if params["rope_type"] not in ("longrope", "yarn"):
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    if params["rope_type"] == "yarn":
        return _yarn_mscale(params, _yarn_factor(config))
    original = _original_max_positions(config)
    factor = params.get("factor") or config.max_position_embeddings / original
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(original))


def _yarn_factor(config: PretrainedConfig) -> float:
    """YaRN's stretch of the context: `factor`, else the context over the original one."""
    factor = rope_parameters(config).get("factor")
    return float(factor or config.max_position_embeddings / _original_max_positions(config))


def _yarn_mscale(params: dict[str, Any], factor: float) -> float:
    """YaRN's attention scaling: 0.1 ln(factor) + 1, or the ratio of two such with
    `mscale` and `mscale_all_dim` (DeepSeek's form)."""

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = params.get("mscale"), params.get("mscale_all_dim")
    if m and m_all:
        return mscale(factor, m) / mscale(factor, m_all)
    return mscale(factor)


class RopeAngles:
    """cos and sin [T, R / 2] of a step's positions, computed for them as Hugging Face
    computes them (float32: positions times inverse frequencies, times the attention
    factor), then cast to the model's dtype: no table of every position (Gemma 3's two
    RoPEs at 32k positions held 64 MiB; a 128k-context Llama's one, 64 MiB too)."""

    def __init__(self, inv_freq: torch.Tensor, scale: float, dtype: torch.dtype) -> None:
        self.inv_freq = inv_freq  # [R / 2] float32, on the model's device
        self.scale = scale
        self.dtype = dtype

    @classmethod
    def of(
        cls, config: PretrainedConfig, dim: int, max_positions: int, device: torch.device,
        dtype: torch.dtype,
    ) -> RopeAngles:
        """The config's RoPE for a rotary width `dim` and a context of `max_positions`.

        NOTE: LongRoPE takes its long factors when the context (`max_positions`, the served
        max_model_len) reaches past `original_max_position_embeddings`, else the short ones,
        for every position, as vLLM does. Hugging Face picks by each sequence's length, and
        recomputes the whole sequence when it grows past: a paged cache cannot, so its
        short-factor answers are served with `--max-model-len` at most the original length.
        """
        long = max_positions > _original_max_positions(config)
        inv_freq = rope_inv_freq(config, dim, long).to(device)
        return cls(inv_freq, _attention_factor(config), dtype)

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = torch.outer(positions.to(torch.float32), self.inv_freq)  # [T, R / 2]
        cos, sin = freqs.cos(), freqs.sin()
        if self.scale != 1.0:
            cos, sin = cos.mul_(self.scale), sin.mul_(self.scale)
        return cos.to(self.dtype), sin.to(self.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate halves (the Hugging Face layout) of the first 2 * cos.shape[-1] dims of each
    head, the rest passed through (partial rotary). x: [T, heads, D]; cos, sin: [T, R / 2].
    """
    rotary = 2 * cos.shape[-1]
    x_rot, x_pass = x[..., :rotary], x[..., rotary:]
    x1, x2 = x_rot.chunk(2, dim=-1)  # [T, heads, R / 2] each
    cos, sin = cos[:, None, :], sin[:, None, :]
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated if rotary == x.shape[-1] else torch.cat((rotated, x_pass), dim=-1)
