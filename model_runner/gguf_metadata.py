"""A GGUF's metadata laid out as gguf-py's `GGUFReader` lays it out (its `fields`, the
names of its `tensors`), read in one pass: all that transformers' GGUF reading asks of a
reader, for its config and tokenizer.

transformers reads a GGUF's config and its tokenizer (`load_gguf_checkpoint`, once for
each) through a `GGUFReader` built at each call, which takes every value of the metadata
as its own numpy view of the memory-mapped file: ~17 s for Gemma 3's vocabulary of 262k
strings, twice. Inside `fast_reading(path)` transformers gets a `MetadataReader` of the
file instead: the same fields part by part (a number as a 1-tuple, a string as bytes,
where gguf-py holds small arrays; transformers reads both alike), parsed once for every
call, in about a second; and gguf-py's tensor-name maps made once each. transformers' own
reading stays the reference (tests/runner/test_gguf_metadata.py holds the two to the same
result).
"""

from __future__ import annotations

import functools
import mmap
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import gguf

# metadata value types of a fixed width (u8, i8, u16, i16, u32, i32, f32, bool, u64, i64, f64)
FIXED_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9


class ReaderField(NamedTuple):
    """One key's parts as gguf-py's `ReaderField` has them: the key's length and bytes, the
    value's type, then the value's parts; `data` indexes the parts that hold values."""

    offset: int
    name: str
    parts: list[Any]
    data: list[int]
    types: list[int]


class ReaderTensor(NamedTuple):
    """A tensor of the table, by name (all transformers reads of it without the weights)."""

    name: str


class MetadataReader:
    """A GGUF file's `fields` and `tensors` (names only); ValueError for a file that is no
    GGUF of version 2 or 3."""

    def __init__(self, path: str | Path) -> None:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as blob:
            self.fields, self.tensors = _parse(blob)


@contextmanager
def fast_reading(path: Path) -> Iterator[None]:
    """transformers' GGUF reading of `path`, inside the block, on one `MetadataReader` of
    it (any other file still gets gguf-py's reader) and on gguf-py's tensor-name map made
    once per architecture and layer count (transformers' name mapping makes one per
    module: 313 for Gemma 3 270M, ~2 s).

    NOTE: transformers imports both from gguf at each call, so the module's names are
    what it finds."""
    reader = MetadataReader(path)
    original_reader, original_names = gguf.GGUFReader, gguf.get_tensor_name_map

    def reader_of(other: str | Path, *args: Any, **kwargs: Any) -> Any:
        if Path(other).resolve() == path.resolve():
            return reader
        return original_reader(other, *args, **kwargs)

    gguf.GGUFReader = reader_of  # type: ignore[assignment,misc]
    gguf.get_tensor_name_map = functools.cache(original_names)
    try:
        yield
    finally:
        gguf.GGUFReader = original_reader  # type: ignore[misc]
        gguf.get_tensor_name_map = original_names


def _parse(blob: mmap.mmap) -> tuple[dict[str, ReaderField], list[ReaderTensor]]:
    (version,) = struct.unpack_from("<I", blob, 4)
    if bytes(blob[:4]) != b"GGUF" or version not in (2, 3):
        raise ValueError("not a GGUF file of version 2 or 3")
    tensor_count, kv_count = struct.unpack_from("<QQ", blob, 8)
    fields = {  # gguf-py's fields of the header itself
        "GGUF.version": ReaderField(4, "GGUF.version", [(version,)], [0], [4]),
        "GGUF.tensor_count": ReaderField(8, "GGUF.tensor_count", [(tensor_count,)], [0], [10]),
        "GGUF.kv_count": ReaderField(16, "GGUF.kv_count", [(kv_count,)], [0], [10]),
    }
    pos = 24
    for _ in range(kv_count):
        start = pos
        key, pos = _string(blob, pos)
        (kind,) = struct.unpack_from("<I", blob, pos)
        parts: list[Any] = [(len(key),), key, (kind,)]
        data, types, pos = _value_parts(blob, pos + 4, kind, parts)
        name = key.decode("utf-8")
        if name in fields:
            raise ValueError(f"duplicate metadata key {name}")
        fields[name] = ReaderField(start, name, parts, data, types)
    tensors = []
    for _ in range(tensor_count):
        tensor_name, pos = _string(blob, pos)
        (dims,) = struct.unpack_from("<I", blob, pos)
        pos += 4 + 8 * dims + 12  # the shape, the type and the data offset
        tensors.append(ReaderTensor(tensor_name.decode("utf-8")))
    return fields, tensors


def _string(blob: mmap.mmap, pos: int) -> tuple[bytes, int]:
    (length,) = struct.unpack_from("<Q", blob, pos)
    return blob[pos + 8 : pos + 8 + length], pos + 8 + length


def _value_parts(
    blob: mmap.mmap, pos: int, kind: int, parts: list[Any]
) -> tuple[list[int], list[int], int]:
    """A value of type `kind` at `pos` appended to `parts` as gguf-py splits it: the
    indices of its value parts, its types (an array's: ARRAY and its items'), the position
    past it."""
    if kind in FIXED_FORMATS:
        fmt = FIXED_FORMATS[kind]
        parts.append(struct.unpack_from(fmt, blob, pos))
        return [len(parts) - 1], [kind], pos + struct.calcsize(fmt)
    if kind == STRING:
        text, end = _string(blob, pos)
        parts += [(len(text),), text]
        return [len(parts) - 1], [kind], end
    if kind != ARRAY:
        raise ValueError(f"unknown metadata value type {kind}")
    item, count = struct.unpack_from("<IQ", blob, pos)
    parts += [(item,), (count,)]
    pos += 12
    if item in FIXED_FORMATS:  # one part per number, as gguf-py has them
        fmt = FIXED_FORMATS[item]
        first = len(parts)
        parts += [(value,) for value in struct.unpack_from(f"<{count}{fmt[1]}", blob, pos)]
        types = [kind, item] if count else [kind]
        return list(range(first, len(parts))), types, pos + count * struct.calcsize(fmt)
    data, types = [], [kind]
    for index in range(count):
        item_data, item_types, pos = _value_parts(blob, pos, item, parts)
        data += item_data
        if index == 0:
            types += item_types
    return data, types, pos
