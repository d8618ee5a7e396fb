"""A model folder's tokenizer files read without transformers' tokenizer: what the engine
core needs of them (its grammar tokenizer's JSON, the EOS token's id).

The core encodes and decodes no text: loading transformers' tokenizer there only to hand
llguidance its JSON cost ~2.5 s of every start and ~300 MB that stayed (a 262k-token
vocabulary's freed strings, interleaved with the model's memory). The API process, which
encodes, loads the tokenizer (model_runner/loader.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class TokenizerFiles:
    """What the core reads of `folder`'s tokenizer.json and tokenizer_config.json, read
    once at start (the parsed JSON is not kept: 165 MB for a 262k-token vocabulary)."""

    def __init__(self, folder: Path) -> None:
        try:
            text = (folder / "tokenizer.json").read_text()
            spec: dict[str, Any] = json.loads(text)
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read the tokenizer of {folder}: {e}") from e
        config = folder / "tokenizer_config.json"
        special = json.loads(config.read_text()) if config.is_file() else {}
        self.eos_token_id = _special_token_id(spec, special.get("eos_token"))
        if spec.get("truncation") is not None or spec.get("padding") is not None:
            text = json.dumps({**spec, "truncation": None, "padding": None})
        self._json = text

    def llguidance_json(self) -> str:
        """tokenizer.json with no truncation or padding (what the API process's tokenizer
        holds once loaded, and what llguidance reads)."""
        return self._json


def _special_token_id(spec: dict[str, Any], token: object) -> int | None:
    """The id of a special token of tokenizer_config.json (a string, or an AddedToken's
    dict), from tokenizer.json's added tokens or vocabulary, as transformers finds it;
    None when it names none."""
    content = token.get("content") if isinstance(token, dict) else token
    if not isinstance(content, str):
        return None
    for added in spec.get("added_tokens") or ():
        if added.get("content") == content:
            return int(added["id"])
    vocab = (spec.get("model") or {}).get("vocab")
    if isinstance(vocab, dict):
        found = vocab.get(content)
        return None if found is None else int(found)
    if isinstance(vocab, list):  # Unigram: [piece, score] by id
        return next((i for i, (piece, _) in enumerate(vocab) if piece == content), None)
    return None
