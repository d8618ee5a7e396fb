"""GGUF files of three families, each in its own types and in Q8_0, through the loader and
the runner against Hugging Face's own reading of the same file (tests/support/gguf_parity.py):
greedy tokens equal HF's wherever its top-1/top-2 margin allows, and teacher-forced top-1
agreement at least 99% over 512 tokens of English text.

- SmolLM2-135M (the default, real): its own Q4_1 in test_smollm2_parity.py; its Q8_0 made
  from it with gguf-py (tests/support/gguf_q8_0.py) on the first run, then kept.
- Gemma 3 270M (real, `python -m bench.fetch_gguf gemma3-270m`): Q4_K_M as published, Q8_0
  made from it as SmolLM2's; skipped without the file.
- Qwen3 (made: random weights in Qwen3's shape, converted and quantized by llama.cpp's own
  tools, `python -m bench.tiny_qwen_gguf`): Q8_0 and Q4_K_M; skipped without the files.

The files are looked for where bench.fetch_gguf puts them (`models_dir`: $PAGEDSERVE_GGUF_DIR,
else models/ under $PAGEDSERVE_CACHE or ~/.cache/pagedserve).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from model_runner.config import ModelConfig
from model_runner.gguf_file import cache_root, models_dir
from model_runner.loader import load_model_spec
from model_runner.model_source import default_gguf_path
from tests.support.gguf_parity import FileParity, file_parity
from tests.support.gguf_q8_0 import write_q8_0

pytestmark = pytest.mark.e2e

GEMMA = "gemma-3-270m-q4_k_m.gguf"
# id -> (the file, or the file its Q8_0 is made from; made here)
FILES = {
    "smollm2-q8_0": (None, True),
    "gemma3-q4_k_m": (GEMMA, False),
    "gemma3-q8_0": (GEMMA, True),
    "qwen3-q8_0": ("qwen3-tiny-q8_0.gguf", False),
    "qwen3-q4_k_m": ("qwen3-tiny-q4_k_m.gguf", False),
}
MIN_TOP1_AGREEMENT = 0.99


def q8_0_twin(path: Path) -> Path:
    """`path`'s Q8_0 twin, made once and kept under $PAGEDSERVE_CACHE by the source's path,
    size and mtime (as the loader keeps a GGUF's config and tokenizer: a later run reads
    both back instead of making them again)."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    twin = cache_root() / "q8_0-twins" / f"{path.stem}-{key.hexdigest()[:12]}.Q8_0.gguf"
    if not twin.is_file():
        twin.parent.mkdir(parents=True, exist_ok=True)
        aside = twin.with_suffix(".partial")
        write_q8_0(path, aside)
        aside.replace(twin)
    return twin


@pytest.fixture(scope="module", params=list(FILES))
def parity(request) -> FileParity:
    """The file's parity figures, once per module."""
    name, make_q8_0 = FILES[request.param]
    path = default_gguf_path() if name is None else models_dir() / name
    if not path.is_file():
        pytest.skip(f"{path} is absent (docs/benchmarks-runner.md says how to get or make it)")
    return file_parity(q8_0_twin(path) if make_q8_0 else path)


def test_greedy_tokens_are_hugging_faces_where_its_margin_allows(parity):
    for greedy in parity.greedy:
        assert greedy.equal, (parity.name, greedy)
    assert sum(g.num_clear for g in parity.greedy) >= len(parity.greedy) * 8, parity


def test_teacher_forced_top1_agrees_with_hugging_face(parity):
    assert parity.num_positions == 512
    assert parity.top1_agreement >= MIN_TOP1_AGREEMENT, parity


def test_a_gemma_chat_ends_at_its_end_of_turn() -> None:
    """The file names only <eos> (1); its template ends a turn with <end_of_turn> (106),
    which Hugging Face's generation config and llama.cpp stop at too."""
    path = models_dir() / GEMMA
    if not path.is_file():
        pytest.skip(f"{path} is absent (docs/benchmarks-runner.md says how to get or make it)")
    spec = load_model_spec(ModelConfig(model=str(path)), with_tokenizer=False)
    assert spec.eos_token_ids == {1, 106}
