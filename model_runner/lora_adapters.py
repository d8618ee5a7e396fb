"""A LoRA adapter read from its PEFT folder and checked whole before anything holds it.

A PEFT folder holds `adapter_config.json` (`r`, `lora_alpha`, `target_modules`,
`use_rslora`) and `adapter_model.safetensors` (`...layers.{i}.self_attn.q_proj.lora_A.weight`
[r, in] and `lora_B.weight` [out, r]). Adapters on the projections q, k, v, o, gate, up
and down are served; one on the embedding or the LM head, one that saves whole modules,
DoRA, biases or per-module ranks are refused with an `AdapterError` naming why. The
scale (lora_alpha / r, or / sqrt(r) with rsLoRA) is folded into the B matrices here.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(
    r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$"
)
# config keys whose non-empty values change what the adapter computes beyond LoRA
_REFUSED_OPTIONS = {
    "use_dora": "DoRA (use_dora)",
    "modules_to_save": "whole saved modules (modules_to_save)",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "lora_bias": "LoRA biases (lora_bias)",
    "trainable_token_indices": "trained token embeddings (trainable_token_indices)",
    "layer_replication": "replicated layers (layer_replication)",
    "target_parameters": "adapted parameters (target_parameters)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
}


class AdapterError(ValueError):
    """A LoRA folder that cannot be served, with why (the API answers it as a 4xx)."""


@dataclass(frozen=True)
class LoRAAdapter:
    """An adapter's weights: (layer, projection) -> (A [r, in], B [out, r] times the
    scale), on the CPU in float32 until a model takes them."""

    name: str
    path: str
    rank: int
    weights: Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class AdapterLayout:
    """A PEFT folder checked against the model from its config and its weights' names and
    shapes alone (no weight read): its rank, scale, and each (layer, projection)'s keys
    of A and B in the safetensors file."""

    rank: int
    scale: float
    keys: Mapping[tuple[int, str], tuple[str, str]]


def check_adapter(
    name: str, path: str, max_rank: int, shapes: Mapping[str, tuple[int, int]],
    num_layers: int,
) -> AdapterLayout:
    """The adapter in the PEFT folder `path`, checked against the model without reading
    its weights (milliseconds): `shapes` maps a projection to its (out, in) sizes; a rank
    over `max_rank` is refused."""
    folder = Path(path)
    config = _read_config(folder)
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise AdapterError(f"{folder / CONFIG_FILE}: r must be a positive integer and "
                           "lora_alpha a number")
    if rank > max_rank:
        raise AdapterError(f"LoRA adapter {name!r} has rank {rank}, over --max-lora-rank "
                           f"{max_rank}")
    _check_options(folder, config)
    scale = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    halves: dict[tuple[int, str], dict[str, tuple[str, tuple[int, ...]]]] = {}
    for key, shape in _read_shapes(folder).items():
        match = _KEY.search(key)
        if match is None or match.group(2) not in PROJECTIONS:
            raise AdapterError(f"{folder / WEIGHTS_FILE}: {key!r} is not a LoRA weight of "
                               f"a served projection ({', '.join(PROJECTIONS)})")
        layer, projection, half = int(match.group(1)), match.group(2), match.group(3)
        if layer >= num_layers or projection not in shapes:
            raise AdapterError(f"{folder / WEIGHTS_FILE}: {key!r} names no projection of "
                               "this model")
        halves.setdefault((layer, projection), {})[half] = (key, shape)
    keys = {}
    for (layer, projection), pair in halves.items():
        out_size, in_size = shapes[projection]
        a, b = pair.get("A"), pair.get("B")
        where = f"{folder / WEIGHTS_FILE}: layer {layer} {projection}"
        if a is None or b is None:
            raise AdapterError(f"{where} lacks its lora_A or lora_B")
        if a[1] != (rank, in_size) or b[1] != (out_size, rank):
            raise AdapterError(f"{where} has shapes {a[1]} and {b[1]}, "
                               f"expected {(rank, in_size)} and {(out_size, rank)}")
        keys[(layer, projection)] = (a[0], b[0])
    if not keys:
        raise AdapterError(f"{folder / WEIGHTS_FILE} holds no LoRA weights")
    return AdapterLayout(rank, scale, keys)


def read_adapter(
    name: str, path: str, max_rank: int, shapes: Mapping[str, tuple[int, int]],
    num_layers: int,
) -> LoRAAdapter:
    """The adapter in the PEFT folder `path`, checked (`check_adapter`) and read."""
    layout = check_adapter(name, path, max_rank, shapes, num_layers)
    tensors = _read_tensors(Path(path))
    weights = {where: (tensors[a].float(), tensors[b].float() * layout.scale)
               for where, (a, b) in layout.keys.items()}
    return LoRAAdapter(name, str(Path(path)), layout.rank, weights)


def _read_config(folder: Path) -> dict[str, Any]:
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except FileNotFoundError as exc:
        raise AdapterError(f"no {CONFIG_FILE} in {folder}: not a PEFT LoRA folder") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{folder / CONFIG_FILE} cannot be read: {exc}") from exc
    if not isinstance(config, dict):
        raise AdapterError(f"{folder / CONFIG_FILE} is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{folder / CONFIG_FILE}: peft_type {config['peft_type']!r}, "
                           "only LORA is served")
    return config


def _check_options(folder: Path, config: dict[str, Any]) -> None:
    where = folder / CONFIG_FILE
    for key, what in _REFUSED_OPTIONS.items():
        if config.get(key):
            raise AdapterError(f"{where}: {what} is not served")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{where}: LoRA biases (bias={config['bias']!r}) are not served")
    targets = config.get("target_modules")
    names = [targets] if isinstance(targets, str) else targets
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise AdapterError(f"{where}: target_modules must be a list of module names")
    refused = [n for n in names if n.split(".")[-1] not in PROJECTIONS]
    if refused:
        raise AdapterError(
            f"{where}: target_modules {refused} are not served: adapters apply to "
            f"{', '.join(PROJECTIONS)} (not the embedding or the LM head)"
        )


def _read_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """The safetensors file's tensor names and shapes, from its header alone."""
    try:
        with safe_open(folder / WEIGHTS_FILE, framework="pt") as weights:
            return {key: tuple(weights.get_slice(key).get_shape()) for key in weights.keys()}
    except FileNotFoundError as exc:
        raise AdapterError(f"no {WEIGHTS_FILE} in {folder}") from exc
    except (OSError, SafetensorError) as exc:
        raise AdapterError(f"{folder / WEIGHTS_FILE} cannot be read: {exc}") from exc


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(folder / WEIGHTS_FILE)
    except FileNotFoundError as exc:
        raise AdapterError(f"no {WEIGHTS_FILE} in {folder}") from exc
    except (OSError, SafetensorError) as exc:
        raise AdapterError(f"{folder / WEIGHTS_FILE} cannot be read: {exc}") from exc
