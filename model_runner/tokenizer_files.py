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

_HEAD_BYTES = 1 << 22  # where the added tokens are looked for first


class TokenizerFiles:
    """What the core reads of `folder`'s tokenizer.json and tokenizer_config.json.

    At start only the EOS token's id, from the JSON's entries before the vocabulary
    (`_leading_entries`: tokenizers writes the added tokens first; ~0.05 s where a parse of
    the whole 262k-token file took ~1 s and 165 MB); the whole text later, for the grammar
    tokenizer (built after the core is ready)."""

    def __init__(self, folder: Path) -> None:
        self._path = folder / "tokenizer.json"
        try:
            data = self._path.read_bytes()
            try:  # NOTE: the added tokens are within the first MiBs (Gemma 3's: 1.2 MB)
                spec = _leading_entries(data[:_HEAD_BYTES].decode(errors="ignore"))
            except ValueError:
                spec = _leading_entries(data.decode())
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read the tokenizer of {folder}: {e}") from e
        config = folder / "tokenizer_config.json"
        eos_token = (json.loads(config.read_text()) if config.is_file() else {}).get("eos_token")
        self.eos_token_id = _special_token_id(spec, eos_token)
        if self.eos_token_id is None and eos_token is not None and "model" not in spec:
            self.eos_token_id = _special_token_id(json.loads(data), eos_token)  # a vocab's

    def llguidance_json(self) -> str:
        """tokenizer.json with no truncation or padding (what the API process's tokenizer
        holds once loaded, and what llguidance reads); an OSError or ValueError where the
        file cannot be read."""
        text = self._path.read_text()
        spec = _leading_entries(text)
        if spec.get("truncation") is None and spec.get("padding") is None:
            return text
        return json.dumps({**json.loads(text), "truncation": None, "padding": None})


def _leading_entries(text: str) -> dict[str, Any]:
    """The top-level entries of a tokenizer.json up to its added tokens, parsed one at a
    time (all of them, the vocabulary's "model" included, when the added tokens come last
    or are missing); a ValueError for text that is not a JSON object."""
    decoder = json.JSONDecoder()
    entries: dict[str, Any] = {}
    at = _skip(text, 0)
    if text[at:at + 1] != "{":
        raise ValueError("tokenizer.json is not a JSON object")
    at = _skip(text, at + 1)
    while text[at:at + 1] == '"' and "added_tokens" not in entries:
        key, at = decoder.raw_decode(text, at)
        at = _skip(text, at)
        if text[at:at + 1] != ":":
            raise ValueError(f"tokenizer.json: no ':' after {key!r}")
        entries[key], at = decoder.raw_decode(text, _skip(text, at + 1))
        at = _skip(text, at)
        at = _skip(text, at + 1) if text[at:at + 1] == "," else at
    return entries


def _skip(text: str, at: int) -> int:
    """The index of the first non-whitespace character of `text` from `at`."""
    while at < len(text) and text[at] in " \t\r\n":
        at += 1
    return at


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
