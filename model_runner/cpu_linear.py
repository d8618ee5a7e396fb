"""CPU projections on prepacked weights: oneDNN float32, or float16 weights through fbgemm.

A float32 model on the CPU runs its projections and LM head on a copy of each weight
laid out for a GEMM library, chosen once at load time by `--weight-dtype`:

- "auto": oneDNN's blocked float32 layout. Exact float32, so greedy output matches
  Hugging Face `generate`; markedly faster than the plain row-major GEMM on the skinny
  matmuls of decode steps (see docs/benchmarks.md).
- "float16": the weights rounded to float16 in fbgemm's packed layout; activations stay
  float32 and products accumulate in float32. Half the weight bytes per decode step, which
  is what a small decode batch on the CPU waits for. Greedy output agrees with float32 on
  most but not every token (measured in docs/benchmarks.md), as with any half-precision
  weights.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

WEIGHT_DTYPES = ("auto", "float16")


def can_pack(device: torch.device, dtype: torch.dtype, weight_dtype: str) -> bool:
    """Whether `pack_linear` supports this device, model dtype and weight dtype."""
    if device.type != "cpu" or dtype != torch.float32:
        return False
    if weight_dtype == "float16":
        return "fbgemm" in torch.backends.quantized.supported_engines
    return torch.backends.mkldnn.is_available()


def check_weight_dtype(device: torch.device, dtype: torch.dtype, weight_dtype: str) -> None:
    """ValueError unless `weight_dtype` is "auto" or usable on this device and dtype."""
    if weight_dtype != "auto" and not can_pack(device, dtype, weight_dtype):
        raise ValueError(
            f"--weight-dtype {weight_dtype} needs the CPU, --dtype float32 and a torch built "
            f"with fbgemm (got device {device.type}, dtype {str(dtype).removeprefix('torch.')})"
        )


# y = x @ weight.T + bias for x [N, in], on a packed copy of the weight
PackedLinear = Callable[[torch.Tensor], torch.Tensor]


def pack_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, weight_dtype: str
) -> PackedLinear:
    """Pack a float32 [out, in] weight (and bias) as `weight_dtype` says (see can_pack)."""
    if weight_dtype == "float16":
        return Float16Linear(weight, bias)
    return OneDNNLinear(weight, bias)


class OneDNNLinear:
    """Exact float32 on oneDNN's blocked weight layout."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        # NOTE: the batch size is only a layout hint; any number of rows works.
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_size=16)
        self.bias = None if bias is None else bias.detach()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        padded = padded_rows(rows)
        if padded != rows:
            x = F.pad(x, (0, 0, 0, padded - rows))
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")[
            :rows
        ]


class Float16Linear:
    """Weights rounded to float16 (fbgemm's packed layout), float32 activations and sums."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        bias = None if bias is None else bias.detach()
        self.packed = torch.ops.quantized.linear_prepack_fp16(weight.detach(), bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(x, self.packed)


# NOTE: oneDNN keeps a primitive (and its scratch memory) per input shape; a server sees
# every row count up to its token budget, which grew the process by ~1 GB. Row counts are
# padded to a few buckets (1, 2, 4, multiples of 8 up to 64, then of 32) so the set of
# shapes stays small; the finer buckets at the low end keep small decode batches cheap.
def padded_rows(rows: int) -> int:
    """The row count oneDNN runs for `rows` rows."""
    if rows <= 4:
        return 1 << (rows - 1).bit_length()
    step = 8 if rows <= 64 else 32
    return -(-rows // step) * step
