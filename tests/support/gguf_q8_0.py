"""A GGUF's Q8_0 twin, made with gguf-py alone: every matrix's values (dequantized from
whatever blocks the file holds) written again as Q8_0 blocks, the rest as it was.

    python -m tests.support.gguf_q8_0 SRC.gguf DST.gguf

The metadata is copied key by key (gguf-py's own gguf_new_metadata.py does the same),
`general.file_type` set to Q8_0. A 1-D tensor (norms, biases) stays F32 (as llama-quantize
leaves it); a matrix whose rows are not whole blocks of 32 too. The copy is what
llama.cpp's `llama-quantize SRC DST Q8_0` would make from an F32 file: gguf-py's Q8_0 is
llama.cpp's reference rounding.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
from gguf.constants import GGML_QUANT_SIZES, Keys
from gguf.quants import dequantize, quantize

Q8_0 = GGMLQuantizationType.Q8_0


def _copy_metadata(reader: GGUFReader, writer: GGUFWriter) -> None:
    for field in reader.fields.values():
        if field.name == Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # the writer's own
        if field.name == Keys.General.FILE_TYPE:
            writer.add_file_type(LlamaFileType.MOSTLY_Q8_0)
            continue
        kind = field.types[0]
        sub_type = field.types[-1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub_type)


def q8_0_values(values: np.ndarray) -> tuple[np.ndarray, GGMLQuantizationType]:
    """A tensor's float32 values as written in the twin: Q8_0 blocks, or F32 as they are."""
    block_size = GGML_QUANT_SIZES[Q8_0][0]
    if values.ndim < 2 or values.shape[-1] % block_size:
        return values, GGMLQuantizationType.F32
    return quantize(values, Q8_0), Q8_0


def write_q8_0(src: Path, dst: Path) -> None:
    """The Q8_0 twin of the GGUF `src`, into `dst`."""
    reader = GGUFReader(src)
    arch = reader.fields[Keys.General.ARCHITECTURE].contents()
    writer = GGUFWriter(dst, arch, use_temp_file=True)
    _copy_metadata(reader, writer)
    for tensor in reader.tensors:
        values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        data, dtype = q8_0_values(values)
        writer.add_tensor(tensor.name, data, raw_dtype=dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", type=Path)
    parser.add_argument("dst", type=Path)
    args = parser.parse_args(argv)
    write_q8_0(args.src, args.dst)
    print(args.dst)
    return 0


if __name__ == "__main__":
    sys.exit(main())
