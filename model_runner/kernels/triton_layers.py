"""Triton kernels for the elementwise parts of a Llama layer on CUDA: the norms, RoPE
(with Qwen3's per-head q/k norm) and SwiGLU, one kernel each.

In torch each of these is several kernels (a cast, the op, a cast back, a multiply; RoPE's
halves, products and concatenation): at decode batch sizes a layer is then ~40 launches
for ~6 matmul-sized ones, and a CUDA-graph replay is bound by them. The model's torch code
(model_runner/models/layers.py) is the reference; every kernel rounds where it does, so a
bfloat16 model gives the same values (math in float32, rounded to the model dtype after
each op the reference runs in that dtype).

CPU tests run these kernels under Triton's interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from model_runner.attention.backend import LayerOps


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    """x (float32) rounded to DTYPE and back: what a torch op in DTYPE stores."""
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    out_ptr,
    x_ptr,
    weight_ptr,
    stride_x,
    stride_out,
    eps,
    WIDTH: tl.constexpr,
    BLOCK: tl.constexpr,  # next_pow2(WIDTH)
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < WIDTH
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / WIDTH + eps)
    dtype = out_ptr.dtype.element_ty
    y = _round(x * inv_rms, dtype) * w  # normalised, cast back, then the weight
    tl.store(out_ptr + row * stride_out + offs, y.to(dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / sqrt(mean(x^2) + eps)) per row of x [T, H] (last dim contiguous)."""
    _check_rows(x, "rms_norm")
    rows, width = x.shape
    out = torch.empty((rows, width), dtype=x.dtype, device=x.device)
    if rows:
        block = triton.next_power_of_2(width)
        _rms_norm_kernel[(rows,)](
            out, x, weight, x.stride(0), out.stride(0), eps,
            WIDTH=width, BLOCK=block, num_warps=_warps(block),
        )
    return out


@triton.jit
def _rope_kernel(
    qkv_ptr,  # [T, (num_heads + 2 * num_kv_heads) * head_dim], q and k rotated in place
    cos_ptr,  # [T, head_dim / 2]
    sin_ptr,
    q_norm_ptr,  # [head_dim], read when QK_NORM
    k_norm_ptr,
    stride_qkv,
    stride_cos,
    eps,
    NUM_HEADS: tl.constexpr,  # query heads; the kv heads follow them
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,  # next_pow2(HEAD_DIM / 2)
    QK_NORM: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)  # 0 .. num_heads + num_kv_heads - 1
    offs = tl.arange(0, HALF)
    mask = offs < HEAD_DIM // 2
    dtype = qkv_ptr.dtype.element_ty
    x_ptr = qkv_ptr + token * stride_qkv + head * HEAD_DIM
    x1 = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + HEAD_DIM // 2 + offs, mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:  # Qwen3: RMSNorm over each head before the rotation
        inv_rms = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0))
                                / HEAD_DIM + eps)
        if head < NUM_HEADS:
            norm_ptr = q_norm_ptr
        else:
            norm_ptr = k_norm_ptr
        w1 = tl.load(norm_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(norm_ptr + HEAD_DIM // 2 + offs, mask=mask, other=0.0).to(tl.float32)
        x1 = _round(_round(x1 * inv_rms, dtype) * w1, dtype)
        x2 = _round(_round(x2 * inv_rms, dtype) * w2, dtype)
    cos = tl.load(cos_ptr + token * stride_cos + offs, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_cos + offs, mask=mask, other=0.0).to(tl.float32)
    # the reference's x1 * cos - x2 * sin, x2 * cos + x1 * sin, each product rounded
    y1 = _round(x1 * cos, dtype) - _round(x2 * sin, dtype)
    y2 = _round(x2 * cos, dtype) + _round(x1 * sin, dtype)
    tl.store(x_ptr + offs, y1.to(dtype), mask=mask)
    tl.store(x_ptr + HEAD_DIM // 2 + offs, y2.to(dtype), mask=mask)


def rope_(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> None:
    """Rotate the query and key heads of the fused qkv rows [T, (heads + 2 kv_heads) D]
    in place (values untouched); cos, sin: [T, D / 2] in qkv's dtype. `qk_norm`: (q
    weight, k weight, eps) of a per-head RMSNorm applied first (Qwen3)."""
    num_tokens = qkv.shape[0]
    if num_tokens == 0:
        return
    if qkv.stride(1) != 1 or cos.stride(1) != 1 or sin.stride() != cos.stride():
        raise ValueError("rope_: qkv, cos and sin need contiguous rows, cos and sin alike")
    q_norm, k_norm, eps = qk_norm if qk_norm is not None else (qkv, qkv, 0.0)
    half = triton.next_power_of_2(head_dim // 2)
    _rope_kernel[(num_tokens, num_heads + num_kv_heads)](
        qkv, cos, sin, q_norm, k_norm, qkv.stride(0), cos.stride(0), eps,
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, HALF=half, QK_NORM=qk_norm is not None,
        num_warps=1,
    )


@triton.jit
def _silu_and_mul_kernel(
    out_ptr,  # [T, I]
    x_ptr,  # [T, 2 I]: gate, then up
    stride_x,
    stride_out,
    WIDTH: tl.constexpr,  # I
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < WIDTH
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + WIDTH + offs, mask=mask, other=0.0).to(tl.float32)
    silu = _round(gate / (1.0 + tl.exp(-gate)), dtype)
    tl.store(out_ptr + row * stride_out + offs, (silu * up).to(dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of x [T, 2 I] = [gate | up]: [T, I]."""
    _check_rows(x, "silu_and_mul")
    rows, width = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, width), dtype=x.dtype, device=x.device)
    if rows:
        block = min(1024, triton.next_power_of_2(width))
        _silu_and_mul_kernel[(rows, triton.cdiv(width, block))](
            out, x, x.stride(0), out.stride(0), WIDTH=width, BLOCK=block,
            num_warps=_warps(block),
        )
    return out


def _check_rows(x: torch.Tensor, name: str) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"{name}: rows [T, width] with contiguous columns, got "
                         f"shape {tuple(x.shape)} strides {x.stride()}")


def _warps(block: int) -> int:
    return max(1, min(8, block // 256))


TRITON_LAYER_OPS = LayerOps(
    name="triton",
    dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}),
    rms_norm=rms_norm,
    rope_=rope_,
    silu_and_mul=silu_and_mul,
    takes_qk_norm=True,
)
