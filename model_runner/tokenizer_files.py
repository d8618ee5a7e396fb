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
    """tokenizer.json (parsed once) and tokenizer_config.json of `folder`."""

    def __init__(self, folder: Path) -> None:
        try:
            self._spec: dict[str, Any] = json.loads((folder / "tokenizer.json").read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read the tokenizer of {folder}: {e}") from e
        config = folder / "tokenizer_config.json"
        self._config: dict[str, Any] = json.loads(config.read_text()) if config.is_file() else {}

    def llguidance_json(self) -> str:
        """tokenizer.json with no truncation or padding (what the API process's tokenizer
        holds once loaded, and what llguidance reads)."""
        return json.dumps({**self._spec, "truncation": None, "padding": None})

    @property
    def eos_token_id(self) -> int | None:
        """The EOS token's id, as transformers' tokenizer gives it."""
        return self.special_token_id("eos_token")

    def special_token_id(self, name: str) -> int | None:
        """The id of tokenizer_config.json's `name` ("eos_token"), from the added tokens or
        the vocabulary; None when it names none."""
        token = self._config.get(name)
        content = token.get("content") if isinstance(token, dict) else token
        if not isinstance(content, str):
            return None
        for added in self._spec.get("added_tokens") or ():
            if added.get("content") == content:
                return int(added["id"])
        vocab = (self._spec.get("model") or {}).get("vocab")
        if isinstance(vocab, dict):
            found = vocab.get(content)
            return None if found is None else int(found)
        if isinstance(vocab, list):  # Unigram: [piece, score] by id
            return next((i for i, (piece, _) in enumerate(vocab) if piece == content), None)
        return None
