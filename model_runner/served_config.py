"""What a model folder's config says about serving it, read as JSON (no transformers): its
config.json, and the ids a generation ends at (generation_config.json's EOS, the config's,
the tokenizer's), computed here once for the API process (from the JSON) and the engine
core (model_runner/loader.py, from transformers' config of the same folder).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def read_config_json(folder: Path) -> dict[str, Any]:
    """The folder's config.json; ValueError naming the file when it cannot be read."""
    path = folder / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the config of {folder}: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"cannot read the config of {folder}: {path} is no JSON object")
    return config


def served_eos_token_ids(
    folder: Path, config: Mapping[str, Any], tokenizer_eos_token_id: int | None
) -> frozenset[int]:
    """The ids that end a generation: generation_config.json's `eos_token_id`, the config's
    and the tokenizer's EOS (each an id, a list of ids, or none)."""
    ids: set[int] = set()

    def add(value: object) -> None:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)

    generation = folder / "generation_config.json"
    if generation.is_file():
        try:
            add(json.loads(generation.read_text()).get("eos_token_id"))
        except (OSError, ValueError, AttributeError) as e:
            raise ValueError(f"cannot read {generation}: {e}") from e
    add(config.get("eos_token_id"))
    add(tokenizer_eos_token_id)
    return frozenset(ids)
