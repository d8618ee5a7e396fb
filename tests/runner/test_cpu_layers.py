"""The C++ float32 layer kernels (csrc/cpu_layers.cpp) against the model's torch code,
and a whole model on them against Hugging Face."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model_runner.attention.cpu_backend import LAYER_OPS
from model_runner.kernels.cpu_kernels import load_cpu_kernels
from model_runner.models.gemma import GemmaRMSNorm
from model_runner.models.layers import RMSNorm
from model_runner.models.rope import apply_rope

load_cpu_kernels()
ops = torch.ops.pagedserve


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_rms_norm_matches_the_torch_norm(rows: int) -> None:
    norm = RMSNorm(576, 1e-5)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(rows, 576) * 3
    torch.testing.assert_close(norm(x, LAYER_OPS), norm(x), atol=1e-5, rtol=1e-5)


def test_rms_norm_reads_strided_rows() -> None:
    norm = RMSNorm(64, 1e-6)
    x = torch.randn(7, 128)[:, 32:96]  # rows 128 apart
    torch.testing.assert_close(norm(x, LAYER_OPS), norm(x.contiguous()), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_rope_rotates_query_and_key_heads_in_place(head_dim: int) -> None:
    rows, heads, kv_heads = 9, 6, 2
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(rows, width)
    angles = torch.rand(rows, head_dim // 2) * 10
    cos, sin = angles.cos(), angles.sin()
    q = qkv[:, : heads * head_dim].view(rows, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(rows, kv_heads, head_dim)
    expected = torch.cat([apply_rope(q, cos, sin).flatten(1), apply_rope(k, cos, sin).flatten(1),
                          qkv[:, (heads + kv_heads) * head_dim :]], dim=1)
    ops.rope_(qkv, cos, sin, heads + kv_heads, head_dim)
    torch.testing.assert_close(qkv, expected, atol=1e-5, rtol=1e-5)  # values untouched


@pytest.mark.parametrize("head_dim", [16, 128])
def test_qk_norm_rope_norms_each_query_and_key_head_then_rotates(head_dim: int) -> None:
    rows, heads, kv_heads = 5, 4, 2
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim) * 3
    angles = torch.rand(rows, head_dim // 2) * 10
    cos, sin = angles.cos(), angles.sin()
    q_norm, k_norm = RMSNorm(head_dim, 1e-6), RMSNorm(head_dim, 1e-6)
    torch.nn.init.normal_(q_norm.weight)
    torch.nn.init.normal_(k_norm.weight)
    q = qkv[:, : heads * head_dim].view(rows, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(rows, kv_heads, head_dim)
    expected = torch.cat([apply_rope(q_norm(q), cos, sin).flatten(1),
                          apply_rope(k_norm(k), cos, sin).flatten(1),
                          qkv[:, (heads + kv_heads) * head_dim :]], dim=1)
    LAYER_OPS.rope_(qkv, cos, sin, heads, kv_heads, head_dim,
                    (q_norm.weight.detach(), k_norm.weight.detach(), 1e-6))
    torch.testing.assert_close(qkv, expected, atol=1e-5, rtol=1e-5)  # values untouched


def test_silu_and_mul_matches_torch() -> None:
    x = torch.randn(13, 2 * 1536) * 8  # wide enough to reach exp's clamped range
    x[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -90.0])
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_and_mul(x), F.silu(gate) * up, atol=1e-5, rtol=1e-5)


def test_gelu_tanh_and_mul_matches_torch() -> None:
    x = torch.randn(13, 2 * 1536) * 8
    x[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -90.0])
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(ops.gelu_tanh_and_mul(x), F.gelu(gate, approximate="tanh") * up,
                               atol=1e-5, rtol=1e-5)


def test_gemmas_norm_multiplies_by_one_plus_its_weight_in_the_kernel() -> None:
    norm = GemmaRMSNorm(640, 1e-6)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(3, 640) * 3
    torch.testing.assert_close(norm(x, LAYER_OPS), norm(x), atol=1e-5, rtol=1e-5)
    unfolded = norm(x, LAYER_OPS)
    norm.fold()  # 1 + w kept: the same numbers to the bit
    assert torch.equal(norm(x, LAYER_OPS), unfolded)


def test_kernels_reject_what_they_do_not_take() -> None:
    with pytest.raises(RuntimeError, match="float32"):
        ops.rms_norm(torch.randn(2, 64, dtype=torch.float64), torch.ones(64), 1e-5)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        ops.rms_norm(torch.randn(2, 60), torch.ones(60), 1e-5)
    with pytest.raises(RuntimeError, match="weight"):
        ops.rms_norm(torch.randn(2, 64), torch.ones(32), 1e-5)
    with pytest.raises(RuntimeError, match="head_dim"):
        ops.rope_(torch.randn(2, 64), torch.ones(2, 4), torch.ones(2, 4), 2, 8)
    with pytest.raises(RuntimeError, match="cos and sin"):
        ops.rope_(torch.randn(2, 64), torch.ones(3, 8), torch.ones(3, 8), 2, 16)
