"""A GGUF file read as it is: its config and tokenizer from its metadata, its weights from
the memory-mapped file, one tensor at a time; no converted copy of the model.

Config, tokenizer and tensor names are transformers' own reading of the metadata
(`AutoConfig` and `AutoTokenizer` with `gguf_file`, its GGUF name map; the metadata parsed
once by gguf_metadata.py, not by gguf-py's reader at each call), made on the first start
and kept as a small folder (config.json, generation_config.json, the tokenizer's files,
gguf_names.json; no weights) under $PAGEDSERVE_CACHE (default ~/.cache/pagedserve): a
tokenizer.json reads back in a second or two. The API process reads only this folder; the
engine core the weights.

The weights (`gguf_weights`) are found through the file's tensor table (read here past the
metadata, whose vocabulary is skipped: gguf-py's `GGUFReader` parses every string of it
first, ~20 s for Gemma 3), read from the memory map, dequantized by gguf-py
(`gguf.quants.dequantize`, vectorized numpy) and named and reordered by transformers' own
GGUF tables (llama.cpp's tensor names to Hugging Face's, the Q/K row permutation of
Llama-family attention undone, Gemma's norms stored as 1 + w): the values transformers
loads from the file, to the bit. Of the block types, the CPU kernels read Q4_1 as blocks
recovered exactly from those values (kernels/block_quant.py: the default model's grouped
int8 and float16 paths), and a model packed for them takes a matrix of the other types they
read (Q4_0, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) straight from the mapped file as its
blocks, its rows reordered as transformers reorders them (`FileBlocks`: no float32 copy,
the kernels' values gguf-py's to the bit); every other type is dequantized to float32 at
load, with one log line saying so.
"""

# ruff: noqa: E402 (HF_HUB_OFFLINE must be set before transformers is imported)
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json
import logging
import math
import mmap
import shutil
import struct
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PretrainedConfig,
)
from transformers.modeling_gguf_pytorch_utils import (
    TENSOR_PROCESSORS,
    TensorProcessor,
    get_gguf_hf_weights_map,
)

from model_runner.gguf_cache import cache_root, metadata_folder_path
from model_runner.gguf_metadata import fast_reading
from model_runner.kernels.block_quant import FILE_BLOCK_FORMS
from model_runner.models.registry import model_class
from model_runner.models.weights import FileBlocks

logger = logging.getLogger(__name__)

# the types whose values the CPU kernels read as they are (F32) or as the file's own blocks
# (Q4_1, Q8_0: recovered exactly from their values, kernels/block_quant.py)
KERNEL_TYPES = frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.Q4_1,
                          GGMLQuantizationType.Q8_0})
# the types whose blocks are handed from the file to the kernels as they are (a matrix the
# model packs on the CPU: `keep_blocks`)
FILE_BLOCK_TYPES = frozenset(GGMLQuantizationType[kind.upper()] for kind in FILE_BLOCK_FORMS)


def models_dir() -> Path:
    """Where `python -m bench.fetch_gguf` puts the GGUFs it fetches and the parity tests
    look for them: $PAGEDSERVE_GGUF_DIR, else models/ under `cache_root`."""
    return Path(os.environ.get("PAGEDSERVE_GGUF_DIR") or cache_root() / "models").expanduser()


def metadata_folder(gguf: Path) -> Path:
    """The folder of `gguf`'s config, tokenizer and tensor names (no weights), written on
    first use.

    Its name carries the file's stem and a hash of its path, size and mtime, so a changed
    file is read again. It appears atomically (written aside, then renamed); a failed write
    leaves nothing behind. ValueError for a file transformers cannot read or we cannot
    serve, and for a cache folder that cannot be written (saying what to do).
    """
    folder = metadata_folder_path(gguf)
    if (folder / "config.json").is_file():
        return folder
    logger.info("reading the config and tokenizer of %s into %s (once)", gguf, folder)
    try:
        _write_aside(gguf, folder)
    except OSError as exc:
        # NOTE: a full disk, most likely (the GGUF itself was read: that is a ValueError)
        reason = exc.strerror or str(exc)
        raise ValueError(
            f"cannot write the config and tokenizer of {gguf.name} under {folder.parent}: "
            f"{reason}. Free space there, or point $PAGEDSERVE_CACHE at another folder."
        ) from exc
    return folder


def _write_aside(gguf: Path, folder: Path) -> None:
    """Write into a folder aside, renamed to `folder` once whole; the folder aside is
    removed whatever happens."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{gguf.stem}-", dir=folder.parent))
    try:
        _write_metadata(gguf, tmp)
        try:
            tmp.rename(folder)
        except OSError:
            # another process wrote the same folder first; use theirs
            if not (folder / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_metadata(gguf: Path, out: Path) -> None:
    """transformers' config, generation config and tokenizer of `gguf`, saved in `out`."""
    kwargs = {"gguf_file": gguf.name, "local_files_only": True}
    try:
        with fast_reading(gguf):
            hf_config = AutoConfig.from_pretrained(gguf.parent, **kwargs)
            model_class(hf_config)
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
            names = hf_names(hf_config, _read_header(gguf).architecture)
    except (ValueError, KeyError, OSError, NotImplementedError) as e:
        raise ValueError(f"cannot read GGUF file {gguf}: {e}") from e
    config_dict = hf_config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict["dtype"] = "float32"  # what the blocks are dequantized to
    (out / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True))
    generation = GenerationConfig.from_model_config(hf_config)
    generation.eos_token_id = end_of_generation(generation.eos_token_id,
                                                tokenizer.added_tokens_encoder)
    generation.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / NAMES_FILE).write_text(json.dumps(names, indent=0, sort_keys=True))


NAMES_FILE = "gguf_names.json"  # in the metadata folder: GGUF tensor name -> Hugging Face's
# The tokens that end a turn in the chat templates of the common families. A GGUF names
# one EOS (Gemma 3's is <eos>, while its template ends each turn with <end_of_turn>, which
# is what the model says when done): a chat would run on past its answer to max_tokens.
# Hugging Face's generation configs list both; llama.cpp stops on such tokens too.
END_OF_TURN_TOKENS = ("<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>")


def end_of_generation(eos: int | list[int] | None, added_tokens: dict[str, int]
                      ) -> list[int] | int | None:
    """`eos` and the ids of the END_OF_TURN_TOKENS among a tokenizer's added tokens
    (content -> id): the ids a generation stops at."""
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    ids += [added_tokens[t] for t in END_OF_TURN_TOKENS
            if t in added_tokens and added_tokens[t] not in ids]
    return ids[0] if len(ids) == 1 else (ids or None)


def hf_names(hf_config: PretrainedConfig, architecture: str) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face's, as transformers maps them (from the names of its
    model for `hf_config`, built on the meta device): kept with the metadata, so that a
    start after the first imports no transformers model."""
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(hf_config)
    return dict(get_gguf_hf_weights_map(hf_model, _processor(hf_config, architecture)))


def read_hf_names(folder: Path) -> dict[str, str]:
    """The names `metadata_folder` kept."""
    return dict(json.loads((folder / NAMES_FILE).read_text()))


def _processor(hf_config: PretrainedConfig, architecture: str) -> TensorProcessor:
    """transformers' processing of `architecture`'s tensors (the Q/K permutation undone,
    Gemma's norms as w, not 1 + w)."""
    return TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=hf_config.to_dict())


def gguf_weights(
    gguf: Path, hf_config: PretrainedConfig, names: dict[str, str], keep_blocks: bool = False,
) -> Iterator[tuple[str, torch.Tensor | FileBlocks]]:
    """Every weight of `gguf` under its Hugging Face name (`names`: `hf_names`), as
    float32, read one tensor at a time from the memory-mapped file (the values transformers
    loads from it); with `keep_blocks` (the model packs its projections on the CPU kernels)
    a matrix of FILE_BLOCK_TYPES as its blocks in the mapped file instead (`FileBlocks`)."""
    header = _read_header(gguf)
    _log_dequantized(gguf, header, keep_blocks)
    processor = _processor(hf_config, header.architecture)
    with gguf.open("rb") as f:
        # NOTE: copy-on-write, so that the blocks are writable tensors without a copy
        blob = np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY), np.uint8)
    # the MoE processors gather per-expert tensors here (kwargs as transformers passes them)
    parsed: dict[str, Any] = {"tensors": {}}
    for info in header.tensors:
        raw = blob[info.offset : info.offset + info.nbytes]
        kept = _file_blocks(raw, info, processor, names) if keep_blocks else None
        if kept is not None:
            yield kept
            continue
        values = _dequantized(raw, info)
        result = processor.process(weights=values, name=info.name, tensor_key_mapping=names,
                                   parsed_parameters=parsed)
        if result.name in names:
            # NOTE: writable and contiguous: F32 tensors are views of the read-only map
            yield names[result.name], torch.from_numpy(np.require(result.weights, np.float32,
                                                                  ["C", "W"]))
    yield from parsed["tensors"].items()


def _file_blocks(
    raw: np.ndarray, info: TensorInfo, processor: TensorProcessor, names: dict[str, str]
) -> tuple[str, FileBlocks] | None:
    """A FILE_BLOCK_TYPES matrix's blocks under its Hugging Face name, its rows in
    transformers' order, or None (another type, or a processor that does more than reorder
    its rows).

    The processor is run on the row numbers (Llama's Q/K permutation undone on them), and
    the blocks' rows, each a whole number of blocks, are taken in that order."""
    form = FILE_BLOCK_FORMS.get(info.kind.name.lower())
    if form is None or len(info.shape) != 2:
        return None
    rows = info.shape[0]
    numbers = np.arange(rows, dtype=np.float64)
    result = processor.process(weights=numbers[:, None], name=info.name,
                               tensor_key_mapping=names, parsed_parameters={"tensors": {}})
    order = np.asarray(result.weights)
    if result.name not in names or order.shape != (rows, 1):
        return None
    order = order[:, 0]
    if not np.array_equal(np.sort(order), numbers):
        return None
    table = raw.reshape(rows, -1)
    if not np.array_equal(order, numbers):
        table = table[order.astype(np.int64)]
    return names[result.name], FileBlocks(form(torch.from_numpy(table), info.shape[1]))


# gguf-py dequantizes 16 rows at a time; rows of a narrow model (Gemma 3 270M's are 640
# wide) are joined into rows of about this many values first: the same values, ~10x faster
_JOINED_ROW = 1 << 16


def _dequantized(raw: np.ndarray, info: TensorInfo) -> np.ndarray:
    """A tensor's bytes as float32 values of its shape (gguf-py's dequantize)."""
    rows = math.prod(info.shape[:-1])
    joined = math.gcd(rows, max(1, _JOINED_ROW // info.shape[-1]))
    values = dequantize(raw.reshape(rows // joined, -1), info.kind)
    return values.reshape(info.shape)


class TensorInfo(NamedTuple):
    """One tensor of the file: its name, shape (torch's order), type and bytes."""

    name: str
    shape: tuple[int, ...]
    kind: GGMLQuantizationType
    offset: int  # from the start of the file
    nbytes: int


class Header(NamedTuple):
    architecture: str
    tensors: tuple[TensorInfo, ...]


def _read_header(gguf: Path) -> Header:
    """The architecture and tensor table of `gguf` (GGUF v2 or v3), no tensor data read;
    ValueError for a file that is not one or holds a type gguf-py does not know."""
    try:
        with gguf.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as blob:
            return _parse_header(blob)
    except (ValueError, KeyError, struct.error) as e:
        raise ValueError(f"cannot read GGUF file {gguf}: {e}") from e


def _parse_header(blob: mmap.mmap) -> Header:
    if bytes(blob[:4]) != b"GGUF" or struct.unpack_from("<I", blob, 4)[0] not in (2, 3):
        raise ValueError("not a GGUF file of version 2 or 3")
    tensor_count, kv_count = struct.unpack_from("<QQ", blob, 8)
    pos, metadata = 24, dict[str, Any]()
    for _ in range(kv_count):
        key, pos = _string(blob, pos)
        metadata[key], pos = _value(blob, pos + 4, struct.unpack_from("<I", blob, pos)[0])
    entries = []
    for _ in range(tensor_count):
        name, pos = _string(blob, pos)
        (dims,) = struct.unpack_from("<I", blob, pos)
        shape = tuple(reversed(struct.unpack_from(f"<{dims}Q", blob, pos + 4)))
        kind, offset = struct.unpack_from("<IQ", blob, pos + 4 + 8 * dims)
        pos += 4 + 8 * dims + 12
        entries.append((name, shape, GGMLQuantizationType(kind), offset))
    alignment = int(metadata.get("general.alignment", 32))
    data_start = -(-pos // alignment) * alignment
    tensors = tuple(
        TensorInfo(name, shape, kind, data_start + offset, _nbytes(kind, shape))
        for name, shape, kind, offset in entries)
    return Header(str(metadata["general.architecture"]), tensors)


# metadata value types of a fixed width (u8, i8, u16, i16, u32, i32, f32, bool, u64, i64, f64)
_FIXED = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
          11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def _string(blob: mmap.mmap, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", blob, pos)
    return blob[pos + 8 : pos + 8 + length].decode("utf-8"), pos + 8 + length


def _value(blob: mmap.mmap, pos: int, kind: int) -> tuple[object, int]:
    """One metadata value and the position past it (an array: its length only)."""
    if kind in _FIXED:
        return struct.unpack_from(_FIXED[kind], blob, pos)[0], pos + struct.calcsize(_FIXED[kind])
    if kind == _STRING:
        return _string(blob, pos)
    if kind != _ARRAY:
        raise ValueError(f"unknown metadata value type {kind}")
    item, count = struct.unpack_from("<IQ", blob, pos)
    pos += 12
    if item in _FIXED:
        return count, pos + count * struct.calcsize(_FIXED[item])
    for _ in range(count):  # strings (a vocabulary): walked, not kept
        _, pos = _value(blob, pos, item)
    return count, pos


def _nbytes(kind: GGMLQuantizationType, shape: tuple[int, ...]) -> int:
    block, size = GGML_QUANT_SIZES[kind]
    return math.prod(shape) // block * size


def _log_dequantized(gguf: Path, header: Header, keep_blocks: bool) -> None:
    """One line naming the tensor types no kernel reads as they are stored."""
    read = KERNEL_TYPES | (FILE_BLOCK_TYPES if keep_blocks else frozenset())
    types = Counter(info.kind for info in header.tensors if info.kind not in read)
    if types:
        listed = ", ".join(f"{count} {kind.name}" for kind, count in sorted(types.items()))
        logger.info("%s: %s tensors have no kernel here: dequantized to float32 at load",
                    gguf.name, listed)
