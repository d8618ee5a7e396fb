"""The CPU kernels' one table: which op a projection runs, by its weight's form, the weight
dtype and the batch's rows.

A float32 model on the CPU packs each projection once (cpu_linear.pack_linear): a GEMM
library's copy for `--weight-dtype` (`GEMMS`) and, where the C++ kernels are built, one
small-batch path: a C++ op (torch.ops.pagedserve.<name>, csrc/, registered in
csrc/cpu_bindings.cpp) on a copy of the weight in the form that op reads. A batch of up
to the path's `max_rows` rows runs on that op, a larger one on the GEMM. Which path a
weight takes follows from the weight dtype and whether its float32 values are a GGUF's
exact Q4_1 or Q8_0 blocks (block_quant.find_blocks): `SMALL_BATCH_PATHS`, the first
whose form fits the weight's shape. A GGUF's weight in any other block type the kernels
read (`FILE_BLOCK_TYPES`: Q4_0, Q5_0, Q5_1, Q8_0 and the K-quants Q4_K, Q5_K, Q6_K) has no
float32 values: its file's blocks are packed as they are (cpu_linear.FileBlocksLinear),
its small batches on its type's path, its larger ones on `FILE_BLOCKS_GEMM`. (Q4_1 and the
default model's Q8_0 projections are read as float32 first, then as the blocks found in
those values, for the dtypes' grouped paths above.)

A path has one name everywhere: its op's, the C++ decode stack's kind for it
(csrc/cpu_decode_stack.cpp, whose constructor checks its kinds against `PATHS`), and the
block form class that feeds it (block_quant.py: its `path`).
"""

from __future__ import annotations

from dataclasses import dataclass

# NOTE: up to this many rows (a small decode batch, or a speculative verification's token
# and drafts) a projection is a stream over its weight, and the C++ matvec on the plain
# row-major weight reaches more of the memory's bandwidth than the GEMM libraries' blocked
# kernels (docs/benchmarks-runner.md: the batch-1 decode step; 1.3-1.4x at 1 to 8 rows). Its
# price is a second copy of each weight (none for a tied LM head: the embedding table),
# a sixth of it (Q4_1) or a quarter (Q8_0) where the weight has exact GGUF blocks.
# Both copies are exact float32 (or the same float16 values); only the order of the sums
# differs, as between any two GEMM kernels. The int8 matvec repeats fbgemm's arithmetic, up
# to INT8_MATVEC_MAX_ROWS rows (csrc/cpu_matvec_int8.cpp).
MATVEC_MAX_ROWS = 8
INT8_MATVEC_MAX_ROWS = 4
# the most decode rows the C++ decode stack runs where every projection has a batch path
STACK_BATCH_MAX_ROWS = 256


@dataclass(frozen=True)
class KernelPath:
    """A small-batch path: the op torch.ops.pagedserve.<name>, the weight tensors it reads
    after x (in this order), the most rows it takes, and what its form needs of the
    weight's [out, in] shape."""

    name: str
    tensors: tuple[str, ...]
    max_rows: int
    out_multiple: int = 1  # groups of eight output rows
    in_multiple: int = 1
    needs_avx2: bool = False  # built only where the kernels are built for AVX2 or wider

    def fits(self, out_features: int, in_features: int) -> bool:
        return (out_features % self.out_multiple == 0 and in_features % self.in_multiple == 0
                and (not self.needs_avx2 or _built_for_avx2()))


def _built_for_avx2() -> bool:
    """Whether the C++ kernels are built for AVX2 or wider (cpu_kernels.py builds for the
    capability torch detects)."""
    import torch

    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


# In the C++ decode stack's kind order: its constructor checks the names and the tensor
# counts (csrc/cpu_decode_stack.cpp).
PATHS: dict[str, KernelPath] = {path.name: path for path in (
    # float32 or float16 rows (csrc/cpu_matvec.cpp)
    KernelPath("matvec", ("weight",), MATVEC_MAX_ROWS, in_multiple=8),
    # exact GGUF blocks, float32 sums: the float32 matvec's numbers (csrc/cpu_matvec_blocks.cpp)
    KernelPath("q4_1_matvec", ("qs", "d", "m"), MATVEC_MAX_ROWS),
    KernelPath("q8_0_matvec", ("qs", "d"), MATVEC_MAX_ROWS),
    # rotated int8 rows: fbgemm's W8A8 numbers (csrc/cpu_matvec_int8.cpp)
    KernelPath("int8_matvec", ("weight", "weight_scales"), INT8_MATVEC_MAX_ROWS),
    # blocks in groups of eight rows times int8 activations (csrc/cpu_matvec_blocks_int8.cpp)
    KernelPath("q4_1_int8_matvec", ("qs", "d", "m"), MATVEC_MAX_ROWS, out_multiple=8),
    KernelPath("q8_0_int8_matvec", ("qs", "d"), MATVEC_MAX_ROWS, out_multiple=8),
    # Q4_1 groups times float32 activations split in three int8 planes (float32's precision)
    KernelPath("q4_1_planes_matvec", ("qs", "d", "m"), MATVEC_MAX_ROWS, out_multiple=8),
    # a GGUF's blocks as the file has them (super-blocks of 256 weights, blocks of 32),
    # exact on their dequantized values, float32 sums (csrc/cpu_matvec_file_blocks.cpp)
    KernelPath("q4_k_matvec", ("blocks",), MATVEC_MAX_ROWS, in_multiple=256),
    KernelPath("q5_k_matvec", ("blocks",), MATVEC_MAX_ROWS, in_multiple=256),
    KernelPath("q6_k_matvec", ("blocks",), MATVEC_MAX_ROWS, in_multiple=256),
    KernelPath("q4_0_matvec", ("blocks",), MATVEC_MAX_ROWS, in_multiple=32),
    KernelPath("q5_0_matvec", ("blocks",), MATVEC_MAX_ROWS, in_multiple=32),
    KernelPath("q5_1_matvec", ("blocks",), MATVEC_MAX_ROWS, in_multiple=32),
    # (q8_0_matvec above reads Q8_0 found in float32 values, its scales apart)
    KernelPath("q8_0_file_matvec", ("blocks",), MATVEC_MAX_ROWS, in_multiple=32),
    # the same blocks times activations in two int8 planes per 32, llama.cpp's byte products
    # (csrc/cpu_matvec_file_blocks_int8.cpp: AVX-512 VNNI or AVX2 byte products, chosen at
    # run time; on a build without AVX2 `needs_avx2` leaves them out)
    KernelPath("q4_k_int8_matvec", ("blocks",), MATVEC_MAX_ROWS, in_multiple=256, needs_avx2=True),
    KernelPath("q5_k_int8_matvec", ("blocks",), MATVEC_MAX_ROWS, in_multiple=256, needs_avx2=True),
    KernelPath("q6_k_int8_matvec", ("blocks",), MATVEC_MAX_ROWS, in_multiple=256, needs_avx2=True),
    KernelPath("q4_0_int8_matvec", ("blocks",), MATVEC_MAX_ROWS, in_multiple=32, needs_avx2=True),
    KernelPath("q5_0_int8_matvec", ("blocks",), MATVEC_MAX_ROWS, in_multiple=32, needs_avx2=True),
    KernelPath("q5_1_int8_matvec", ("blocks",), MATVEC_MAX_ROWS, in_multiple=32, needs_avx2=True),
    KernelPath("q8_0_file_int8_matvec", ("blocks",), MATVEC_MAX_ROWS, in_multiple=32,
               needs_avx2=True),
    # not small-batch paths: the matrix-unit paths below (int8_tiles_granted,
    # MATRIX_UNIT_PATHS), which the decode stack runs past a projection's small-batch rows
    KernelPath("int8_amx_gemm", ("tiles", "weight_scales"), STACK_BATCH_MAX_ROWS),
    KernelPath("file_blocks_amx_gemm", ("blocks",), STACK_BATCH_MAX_ROWS),
)}

# A file's blocks are read as they are whatever the weight dtype: the file's bits are the
# model (a dtype is for weights that arrive as floats); but under int8, on a host that grants
# AMX's int8 tiles, batches past the small-batch rows take the weight's rotated int8 rows
# (cpu_linear.FileBlocksLinear, int8_tiles_granted). Each type -> its exact path.
FILE_BLOCK_TYPES = {"q4_k": "q4_k_matvec", "q5_k": "q5_k_matvec", "q6_k": "q6_k_matvec",
                    "q4_0": "q4_0_matvec", "q5_0": "q5_0_matvec", "q5_1": "q5_1_matvec",
                    "q8_0_file": "q8_0_file_matvec"}
# NOTE: by default (and under int8) a file's blocks take llama.cpp's integer dot products:
# the blocks' integers times x in two int8 planes per 32 values (16 bits of x: within 1/508
# of a block's int8 step, where llama.cpp's one plane moved Gemma 3's logits by up to 0.7),
# 1.3-1.65x the exact float32 kernels, which are bound by dequantizing every weight
# (docs/benchmarks-runner.md, issue 45), but for Q8_0 (below). float16 and bfloat16 promise
# float32 sums: the exact paths.
FILE_BLOCK_INT8_PATHS = {kind: path.replace("_matvec", "_int8_matvec")
                         for kind, path in FILE_BLOCK_TYPES.items()}

# (weight dtype, the weight's GGUF blocks: "q4_1", "q8_0" (exact in its float32 values),
# a type of FILE_BLOCK_TYPES (kept from the file) or None) -> the small-batch paths it may
# take, the first that fits
SMALL_BATCH_PATHS: dict[tuple[str, str | None], tuple[str, ...]] = {
    ("auto", "q4_1"): ("q4_1_matvec",),
    ("auto", "q8_0"): ("q8_0_matvec",),
    ("auto", None): ("matvec",),
    # float16 promises float32 sums, not float32's bits: Q4_1 blocks in planes
    ("float16", "q4_1"): ("q4_1_planes_matvec", "q4_1_matvec"),
    ("float16", "q8_0"): ("q8_0_matvec",),
    ("float16", None): ("matvec",),
    # bfloat16 is for the GEMM's larger batches (AMX): small ones as float16's
    ("bfloat16", "q4_1"): ("q4_1_planes_matvec", "q4_1_matvec"),
    ("bfloat16", "q8_0"): ("q8_0_matvec",),
    ("bfloat16", None): ("matvec",),
    ("int8", "q4_1"): ("q4_1_int8_matvec", "int8_matvec"),
    ("int8", "q8_0"): ("q8_0_int8_matvec", "int8_matvec"),
    ("int8", None): ("int8_matvec",),
    **{(dtype, kind): (FILE_BLOCK_INT8_PATHS[kind], path) for dtype in ("auto", "int8")
       for kind, path in FILE_BLOCK_TYPES.items()},
    # Q8_0's weights are bytes already, made in one multiply: its exact path is as fast as
    # two planes' byte products (a tied 262k-row LM head, one thread: 14.4 against 15.5 ms)
    ("auto", "q8_0_file"): ("q8_0_file_matvec",),
    **{(dtype, kind): (path,) for dtype in ("float16", "bfloat16")
       for kind, path in FILE_BLOCK_TYPES.items()},
}

# the weight dtype -> the GEMM that runs every batch past its small-batch path's rows
GEMMS = {
    "auto": "oneDNN float32 (mkldnn._linear_pointwise)",
    "float16": "fbgemm float16 weights (quantized.linear_dynamic_fp16)",
    "bfloat16": "oneDNN bfloat16 weights and activations, float32 sums (AMX tiles where the "
                "host has them)",
    "int8": "fbgemm W8A8 (quantized.linear_dynamic); AMX's int8 tiles where granted "
            "(int8_amx_gemm, int8_tiles_granted)",
}
# a file's blocks' larger batches, whatever the weight dtype: panels of its rows
# dequantized into a thread's buffer (csrc/cpu_matvec_file_blocks.cpp): no second copy
FILE_BLOCKS_GEMM = "file_blocks_gemm"


@dataclass(frozen=True)
class MatrixUnitPath:
    """A file's blocks' batches of `min_rows` rows or more on the host's matrix unit: the
    op torch.ops.pagedserve.<name>(x, blocks, kind, bias), taken where the host has the
    unit and the kernel grants it (`granted`, an op of no arguments), for weights whose
    out features are a multiple of `out_multiple`, under the weight dtypes of
    FILE_BLOCK_INT8_PATHS (its arithmetic is theirs)."""

    name: str
    granted: str
    min_rows: int
    out_multiple: int = 16


# NOTE: AMX's int8 tiles (csrc/file_blocks_amx_tiles.h), x in the int8 paths' two planes,
# 16 weight rows unpacked to bytes once for every 16 rows of x (Q8_0's bytes read in
# place), each sub-block's tile products issued into a second set of tiles before the
# previous one's sums are combined. Measured against the paths they replace, 2 threads
# (docs/benchmarks-runner.md, issue 45): Gemma 3's tied 262k-row Q8_0 LM head at 4 rows 6.5 ms
# against the exact matvec's 9.5, 8 rows 6.8 / 17, 16 rows 7.5 / 34 (panels); the other
# types past the small-batch paths' 8 rows, Q6_K too (its scale per 16 halves each tile
# product, yet [640, 2048] at 16 rows 0.22 ms against its float panels' 0.31, 44 rows 0.40
# against 0.55-0.76).
MATRIX_UNIT_PATHS = {
    "q8_0_file": MatrixUnitPath("file_blocks_amx_gemm", "amx_int8_granted", min_rows=4),
    **{kind: MatrixUnitPath("file_blocks_amx_gemm", "amx_int8_granted",
                            min_rows=MATVEC_MAX_ROWS + 1)
       for kind in ("q4_0", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")},
}


# NOTE: int8 rows (Int8Linear: rotated, a grid per weight row) past their small-batch path
# on AMX's int8 tiles (csrc/cpu_int8_amx.cpp): each row of x on its own 8-bit grid, the
# byte products summed in int32 over the whole row, one scaling; fbgemm elsewhere. On the
# default model's shapes, 2 threads (docs/benchmarks.md, issue 45): a layer's four
# projections at 16 rows 0.15 ms against fbgemm's 0.26 (with the rotation), 512 rows 3.7
# against 5.8; the 16-request decode step 25 -> 16 ms.
def int8_tiles_granted(out_features: int, in_features: int) -> bool:
    """Whether an [out, in] weight's int8 rows run on AMX's int8 tiles (int8_amx_gemm): the
    shape fits its tiles (out a multiple of 16, in of 64) and the host grants them."""
    if out_features % 16 or in_features % 64:
        return False
    import torch

    return bool(torch.ops.pagedserve.amx_int8_granted())


def matrix_unit_path(weight_dtype: str, blocks: str | None, out_features: int
                     ) -> MatrixUnitPath | None:
    """The matrix-unit path of a file's `blocks` under `weight_dtype`, or None (no such
    path, another dtype, a shape it does not take, or a host without the unit)."""
    path = MATRIX_UNIT_PATHS.get(blocks or "")
    if path is None or weight_dtype not in ("auto", "int8") or out_features % path.out_multiple:
        return None
    import torch

    return path if getattr(torch.ops.pagedserve, path.granted)() else None


def small_batch_path(
    weight_dtype: str, blocks: str | None, out_features: int, in_features: int
) -> KernelPath | None:
    """The small-batch path of an [out, in] weight with `blocks` ("q4_1", "q8_0", a type of
    FILE_BLOCK_TYPES or None) under `weight_dtype`, or None: every batch on the GEMM."""
    for name in SMALL_BATCH_PATHS[(weight_dtype, blocks)]:
        if PATHS[name].fits(out_features, in_features):
            return PATHS[name]
    return None


@dataclass(frozen=True)
class KernelTable:
    """The table as a model runs it: each path's rows, or at most `max_rows` (0: every
    batch on the GEMM, the small-batch paths and the decode stack off; bench.step_profile's
    comparison). A model takes it when packed (`pack_weights`) or later
    (`use_kernel_table`)."""

    max_rows: int | None = None

    def rows(self, path: KernelPath | None) -> int:
        """The most rows `path` runs (0 for no path)."""
        if path is None:
            return 0
        return path.max_rows if self.max_rows is None else min(path.max_rows, self.max_rows)


DEFAULT_TABLE = KernelTable()
GEMM_ONLY = KernelTable(max_rows=0)
