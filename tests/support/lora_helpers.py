"""Tiny random LoRA adapters made with `peft` (non-zero: init_lora_weights=False) on a
tiny model, saved as PEFT folders, with the `PeftModel` that generates the reference."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# three adapters that differ in rank, targets and scaling
ADAPTER_SPECS = {
    "all": dict(r=8, lora_alpha=16, target_modules=ALL_PROJECTIONS),
    "attn": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"]),
    "mlp": dict(r=16, lora_alpha=4, target_modules=["gate_proj", "up_proj", "down_proj"],
                use_rslora=True),
}


@dataclass
class TinyAdapter:
    name: str
    path: str
    peft: PeftModel  # the base model with this adapter, for generate


def make_adapter(folder: Path, hf_model: torch.nn.Module, name: str, seed: int,
                 **spec: object) -> TinyAdapter:
    """A random adapter of `spec` (LoraConfig's keys) on a copy of `hf_model`, saved to
    `folder`; its weights scaled up so that it changes the greedy tokens."""
    torch.manual_seed(seed)
    config = LoraConfig(init_lora_weights=False, **spec)  # type: ignore[arg-type]
    model = get_peft_model(copy.deepcopy(hf_model), config)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "lora_B" in param_name:
                param.mul_(4.0)
    model.eval()
    model.save_pretrained(folder)
    return TinyAdapter(name, str(folder), model)


def make_adapters(root: Path, hf_model: torch.nn.Module) -> dict[str, TinyAdapter]:
    """The three adapters of ADAPTER_SPECS on `hf_model`, under `root`."""
    return {name: make_adapter(root / name, hf_model, name, seed, **spec)
            for seed, (name, spec) in enumerate(ADAPTER_SPECS.items())}


def edit_config(folder: Path, **changes: object) -> None:
    """Change keys of a PEFT folder's adapter_config.json."""
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))
