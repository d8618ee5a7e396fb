"""CPU projections on prepacked weights: oneDNN float32 or bfloat16, or float16 / int8
through fbgemm.

A float32 model on the CPU runs its projections and LM head on a copy of each weight
laid out for a GEMM library, chosen once at load time by `--weight-dtype`:

- "auto": oneDNN's blocked float32 layout. Exact float32, so greedy output matches
  Hugging Face `generate`; markedly faster than the plain row-major GEMM on the skinny
  matmuls of decode steps (see docs/benchmarks-runner.md).
- "float16": the weights rounded to float16 in fbgemm's packed layout; activations stay
  float32 and products accumulate in float32. Half the weight bytes per decode step, which
  is what a small decode batch on the CPU waits for. Greedy output agrees with float32 on
  most but not every token (measured in docs/benchmarks-runner.md), as with any half-precision
  weights.
- "bfloat16": the weights rounded to bfloat16 in oneDNN's blocked layout, the activations
  rounded to bfloat16 on the way in, products summed in float32, the output rounded to
  bfloat16 (oneDNN's matmul) and back to float32 (BFloat16Linear). On a host with AMX
  (Sapphire Rapids and later) oneDNN runs it on AMX's bfloat16 tiles: prefill and batches
  past the small-batch rows 2-7x float32's speed and ~2x int8's. Elsewhere oneDNN's
  AVX-512 (BF16) or emulated kernels give the same numbers more slowly.
- "int8": W8A8 (int8_linear.Int8Linear). Products in int8, summed in int32: on AMX's int8
  tiles where the host grants them, elsewhere fbgemm's int8 GEMM (~1.8x the float32 FLOP
  rate on AVX2); from a batch of ~16 tokens the CPU waits for FLOPs, not weight bytes. A
  quantized model: greedy output drifts from float32
  (measured in docs/benchmarks-runner.md).

A small batch (up to eight rows, four for int8's rows) runs instead on the C++ matvec of
the projection's small-batch path, which cpu_kernel_table.py chooses by the weight dtype
and the weight's form: a row-major copy of the weight (float32 and float16 in
csrc/cpu_matvec.cpp, int8 in csrc/cpu_matvec_int8.cpp: fbgemm's numbers to the bit), or
where its float32 values are a GGUF's Q4_1 or Q8_0 blocks (the default model's), those
blocks (block_quant.py): the float32 matvec's result to the bit
(csrc/cpu_matvec_blocks.cpp), in float16 too (exact, and a quarter of float16's bytes); in
int8, those blocks' integers times int8 activations (csrc/cpu_matvec_blocks_int8.cpp).

A GGUF's weight in the blocks the kernels read from the file (Q4_0, Q5_0, Q5_1, Q8_0, Q4_K,
Q5_K, Q6_K) is packed from its file's blocks instead (`pack_linear`'s `parts`,
FileBlocksLinear): no float copy at all, every batch on those blocks; a fused projection
whose parts are of different types (Gemma 3's q and k in Q5_0, v in Q8_0) runs each run of
one type on its own blocks, outputs side by side (SplitLinear).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from model_runner.kernels.block_quant import GGUFBlocks, block_runs
from model_runner.kernels.cpu_kernel_table import (
    DEFAULT_TABLE,
    PATHS,
    KernelTable,
    matrix_unit_path,
    small_batch_path,
)
from model_runner.kernels.cpu_kernels import cpu_kernels_available
from model_runner.kernels.int8_linear import Int8Linear, int8_tiles, takes_int8_tiles
from model_runner.kernels.small_batch import DecodeForm, SmallBatchPath, SplitDecodeForm


def can_pack(device: torch.device, dtype: torch.dtype, weight_dtype: str) -> bool:
    """Whether `pack_linear` supports this device, model dtype and weight dtype."""
    if device.type != "cpu" or dtype != torch.float32:
        return False
    if weight_dtype in ("float16", "int8"):
        return "fbgemm" in torch.backends.quantized.supported_engines
    if weight_dtype == "bfloat16":
        return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return torch.backends.mkldnn.is_available()


def check_weight_dtype(device: torch.device, dtype: torch.dtype, weight_dtype: str) -> None:
    """ValueError unless `weight_dtype` is "auto" or usable on this device and dtype."""
    if weight_dtype != "auto" and not can_pack(device, dtype, weight_dtype):
        raise ValueError(
            f"--weight-dtype {weight_dtype} needs the CPU, --dtype float32 and a torch built "
            f"with {'oneDNN on a CPU with AVX-512' if weight_dtype == 'bfloat16' else 'fbgemm'}"
            f" (got device {device.type}, dtype {str(dtype).removeprefix('torch.')})"
        )


def matvec_weight(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """The row-major copy of `weight` the C++ matvec reads, or None without the kernels or
    for a width it cannot read."""
    if not cpu_kernels_available() or not PATHS["matvec"].fits(*weight.shape):
        return None
    return weight.detach().to(dtype).contiguous()


# y = x @ weight.T + bias for x [N, in], on a packed copy of the weight; `decode_form()`
# gives its small-batch copy as the C++ decode stack takes it, or None
PackedLinear = Callable[[torch.Tensor], torch.Tensor]


@torch.no_grad()
def pack_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, weight_dtype: str,
    table: KernelTable = DEFAULT_TABLE, kept: bool = False,
    parts: Sequence[tuple[int, GGUFBlocks]] = (),
) -> PackedLinear:
    """Pack a float32 [out, in] weight (and bias) as `weight_dtype` says (see can_pack),
    its small batches as `table` says (cpu_kernel_table.py). `kept`: the model keeps the
    weight itself anyway (a tied LM head: the embedding table), so that float32 runs its
    larger batches on it (torch's GEMM) rather than on a reordered copy. `parts`: rows of
    it left in a GGUF's blocks (row offset, blocks): packed as they are where they cover it
    (FileBlocksLinear, or SplitLinear for parts of several types), else dequantized into it
    first."""
    runs = block_runs(parts, tuple(weight.shape)) if parts else None
    if runs is not None and len(runs) == 1:
        return FileBlocksLinear(runs[0], bias, weight_dtype, table)
    if runs is not None:
        return SplitLinear(runs, bias, weight_dtype, table)
    for offset, part in parts:  # parts beside float rows
        weight.detach()[offset : offset + part.shape[0]].copy_(part.dequantized())
    if weight_dtype == "float16":
        return Float16Linear(weight, bias, table)
    if weight_dtype == "bfloat16":
        return BFloat16Linear(weight, bias, table)
    if weight_dtype == "int8":
        return Int8Linear(weight, bias, table)
    return OneDNNLinear(weight, bias, table, kept)


class FloatMatvecCopy(SmallBatchPath):
    """The small batches of a float32 or float16 projection (OneDNNLinear, Float16Linear):
    the weight's exact GGUF blocks where it has them (block_quant.py), else its row-major
    copy in the projection's dtype, or neither without the kernels."""

    bias: torch.Tensor | None

    def _copy_for_matvec(
        self, weight: torch.Tensor, weight_dtype: str, table: KernelTable
    ) -> None:
        self._choose_path(weight, weight_dtype, table)
        if self.path is not None and self.path.name == "matvec":
            dtype = torch.float32 if weight_dtype == "auto" else torch.float16
            self.rows_weight = matvec_weight(weight, dtype)

    def _matvec(self, x: torch.Tensor) -> torch.Tensor | None:
        """x's projection on the copy, or None past the path's rows or without one."""
        if x.shape[0] > self.max_rows:
            return None
        if self.blocks is not None:
            return self.blocks(x, self.bias)
        if self.rows_weight is not None:
            return torch.ops.pagedserve.matvec(x, self.rows_weight, self.bias)
        return None

    def decode_form(self) -> DecodeForm | None:
        if self.path is None:
            return None
        tensors = self.blocks.tensors if self.blocks is not None else (self.rows_weight,)
        return DecodeForm(self.path, tensors, self.bias)


class OneDNNLinear(FloatMatvecCopy):
    """Exact float32 on oneDNN's blocked weight layout, or (`kept`: a weight the model
    holds anyway, the tied LM head's embedding table) on the weight itself through torch's
    GEMM: no second float32 copy of the table (671 MB for Gemma 3's 262k rows)."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, table: KernelTable = DEFAULT_TABLE,
        kept: bool = False,
    ) -> None:
        # NOTE: the batch size is only a layout hint; any number of rows works.
        self.weight = weight.detach() if kept else torch.ops.mkldnn._reorder_linear_weight(
            weight.detach(), batch_size=16)
        self.kept = kept
        self.bias = None if bias is None else bias.detach()
        self._copy_for_matvec(weight, "auto", table)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matvec(x)
        if y is not None:
            return y
        if self.kept:
            return F.linear(x, self.weight, self.bias)
        return onednn_linear(x, self.weight, self.bias)


class Float16Linear(FloatMatvecCopy):
    """Weights rounded to float16 (fbgemm's packed layout), float32 activations and sums.

    A weight with exact GGUF blocks (block_quant.py) is read from them in small batches
    instead: its exact values in a quarter of float16's bytes (as vLLM keeps a GGUF's
    blocks whatever the dtype); Q4_1 blocks times the activations split in three int8
    planes (q4_1_planes_matvec: float32's precision, not its bits), Q8_0 ones as in float32.
    Larger batches keep fbgemm."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, table: KernelTable = DEFAULT_TABLE
    ) -> None:
        self.bias = None if bias is None else bias.detach()
        self.packed = torch.ops.quantized.linear_prepack_fp16(weight.detach(), self.bias)
        self._copy_for_matvec(weight, "float16", table)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matvec(x)
        return y if y is not None else torch.ops.quantized.linear_dynamic_fp16(x, self.packed)


class BFloat16Linear(FloatMatvecCopy):
    """Weights and activations rounded to bfloat16 for oneDNN's matmul (AMX where the host
    has it), float32 sums, the output rounded to bfloat16 and returned in float32 (the bias
    added in float32). Small batches as float16's (the exact GGUF blocks, or a float16 row
    copy: the same bytes as bfloat16, more of the mantissa): a matvec waits for the weight's
    bytes, not for multiplies."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, table: KernelTable = DEFAULT_TABLE
    ) -> None:
        self.weight = torch.ops.mkldnn._reorder_linear_weight(
            weight.detach().to(torch.bfloat16), batch_size=16)
        self.bias = None if bias is None else bias.detach()
        self._copy_for_matvec(weight, "bfloat16", table)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matvec(x)
        if y is not None:
            return y
        y = onednn_linear(x.to(torch.bfloat16), self.weight, None).float()
        return y if self.bias is None else y.add_(self.bias)


# The rows from which a GGUF weight's batch under --weight-dtype bfloat16 is worth
# dequantizing the whole weight for: once for all its rows, then AMX's matmul (Gemma 3's
# gate and up, 4,096 x 640 in Q5_0, on two cores of the Xeon: 3.9 ms at 128 rows on the
# panels, 0.9 + 0.9 ms so; 10.5 against ~2 at 512; at 16 rows the panels win)
BF16_GEMM_MIN_ROWS = 64


class FileBlocksLinear(SmallBatchPath):
    """A GGUF weight on its file's blocks (block_quant.GGUFBlocks), the only copy of it:
    small batches on its type's path (cpu_kernel_table.py), larger ones on its panels
    dequantized on the fly (file_blocks_gemm); float32 sums of its dequantized values
    (csrc/cpu_matvec_file_blocks.cpp). Under `--weight-dtype bfloat16` a batch of
    BF16_GEMM_MIN_ROWS rows or more runs as BFloat16Linear's batches do instead: the
    weight dequantized to bfloat16 for the call (no copy kept), oneDNN's bfloat16 matmul
    (AMX tiles where the host has them), float32 sums. Where the kernel table has a
    matrix-unit path for the blocks (cpu_kernel_table.matrix_unit_path: AMX's int8
    tiles), batches from its rows on take it. Under `--weight-dtype int8` on a host that
    grants AMX's int8 tiles, batches past the small-batch rows take the weight as rotated
    int8 rows instead (int8_linear.Int8Tiles, W8A8, a copy beside the blocks as the default
    model's int8 keeps): one scale a row, where the blocks' tiles combine every 32 weights'
    sums on their own scale; Q8_0's blocks, bytes already, stay on theirs."""

    def __init__(
        self, blocks: GGUFBlocks, bias: torch.Tensor | None, weight_dtype: str,
        table: KernelTable = DEFAULT_TABLE,
    ) -> None:
        self.form = blocks
        self.bias = None if bias is None else bias.detach()
        self.path = small_batch_path(weight_dtype, blocks.kind, *blocks.shape)
        self.blocks = None if self.path is None else blocks
        # the path's op: the type's exact one or its int8-activation one (the kernel table's)
        self.op = None if self.path is None else getattr(torch.ops.pagedserve, self.path.name)
        self.rows_weight = None
        self.bfloat16_batches = weight_dtype == "bfloat16"
        self.int8_tiles = (int8_tiles(blocks.dequantized())
                           if weight_dtype == "int8" and blocks.kind != "q8_0_file"
                           and takes_int8_tiles(*blocks.shape) else None)
        matrix_unit = (matrix_unit_path(weight_dtype, blocks.kind, blocks.shape[0])
                       if cpu_kernels_available() and self.int8_tiles is None else None)
        self.matrix_unit = (None if matrix_unit is None
                            else getattr(torch.ops.pagedserve, matrix_unit.name))
        self.matrix_unit_min_rows = 0 if matrix_unit is None else matrix_unit.min_rows
        self.use_table(table)

    def use_table(self, table: KernelTable) -> None:
        """Small batches up to the rows `table` gives the path, and below the matrix
        unit's."""
        super().use_table(table)
        if self.matrix_unit is not None:
            self.max_rows = min(self.max_rows, self.matrix_unit_min_rows - 1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.stride(-1) != 1:
            x = x.contiguous()
        if x.shape[0] <= self.max_rows and self.op is not None:
            return self.op(x, *self.form.tensors, self.bias)
        if self.int8_tiles is not None:
            return self.int8_tiles(x, self.bias)
        if self.matrix_unit is not None and x.shape[0] >= self.matrix_unit_min_rows:
            return self.matrix_unit(x, self.form.blocks, self.form.code, self.bias)
        if self.bfloat16_batches and x.shape[0] >= BF16_GEMM_MIN_ROWS:
            weight = self.form.dequantized().to(torch.bfloat16)
            y = F.linear(x.to(torch.bfloat16), weight).float()
            return y if self.bias is None else y.add_(self.bias)
        return self.form.gemm(x, self.bias)

    def decode_form(self) -> DecodeForm | None:
        if self.path is None or self.blocks is None:
            return None
        if self.int8_tiles is not None:
            return DecodeForm(self.path, self.blocks.tensors, self.bias, 0,
                              self.int8_tiles.decode_form(self.bias), self.path.max_rows + 1)
        batch = None if self.matrix_unit is None else DecodeForm(
            PATHS["file_blocks_amx_gemm"], (self.form.blocks,), self.bias, self.form.code)
        return DecodeForm(self.path, self.blocks.tensors, self.bias, 0, batch,
                          self.matrix_unit_min_rows)


class SplitLinear:
    """A GGUF weight whose rows are runs of blocks of different types (block_quant.
    block_runs: Gemma 3's fused q/k/v with v in Q8_0), each run on its own blocks
    (FileBlocksLinear), one call each, the outputs side by side: no float copy of any."""

    def __init__(
        self, runs: Sequence[GGUFBlocks], bias: torch.Tensor | None, weight_dtype: str,
        table: KernelTable = DEFAULT_TABLE,
    ) -> None:
        bounds = [0, *itertools.accumulate(run.shape[0] for run in runs)]
        self.runs = [
            FileBlocksLinear(run, None if bias is None else bias.detach()[start:stop],
                             weight_dtype, table)
            for run, start, stop in zip(runs, bounds, bounds[1:], strict=False)]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.stride(-1) != 1:
            x = x.contiguous()
        return torch.cat([run(x) for run in self.runs], dim=1)

    def use_table(self, table: KernelTable) -> None:
        for run in self.runs:
            run.use_table(table)

    def decode_form(self) -> SplitDecodeForm | None:
        forms = [run.decode_form() for run in self.runs]
        if any(form is None for form in forms):
            return None
        return SplitDecodeForm(tuple(form for form in forms if form is not None))


# NOTE: oneDNN keeps a primitive (and its scratch memory) per input shape; a server sees
# every row count up to its token budget, which grew the process by ~1 GB. Row counts are
# padded to a few buckets (1, 2, 4, multiples of 8 up to 64, then of 32) so the set of
# shapes stays small; the finer buckets at the low end keep small decode batches cheap.
def onednn_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x @ weight.T + bias on oneDNN's packed `weight` (its dtype x's), x's rows padded to
    a bucket (`padded_rows`: few shapes for oneDNN's primitive cache)."""
    rows = x.shape[0]
    padded = padded_rows(rows)
    if padded != rows:
        x = F.pad(x, (0, 0, 0, padded - rows))
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")[:rows]


def padded_rows(rows: int) -> int:
    """The row count oneDNN runs for `rows` rows."""
    if rows <= 4:
        return 1 << (rows - 1).bit_length()
    step = 8 if rows <= 64 else 32
    return -(-rows // step) * step
