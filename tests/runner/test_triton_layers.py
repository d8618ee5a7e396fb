"""The Triton layer kernels (norms, RoPE with Qwen3's q/k norm, SwiGLU) against the
model's torch code, and whole models on them against Hugging Face.

Without CUDA they run in Triton's interpreter (tests/support/triton_interpreter.py); on
CUDA (`python -m bench.gpu_check`) the same tests run compiled kernels.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.support.triton_interpreter import DEVICE, import_triton, interpreted

import_triton()

from model_runner.attention.backend import AttentionBackend  # noqa: E402
from model_runner.config import ModelConfig  # noqa: E402
from model_runner.kernels import triton_attention as ta  # noqa: E402
from model_runner.kernels import triton_attention_kernels  # noqa: E402
from model_runner.kernels import triton_layers as tl_ops  # noqa: E402
from model_runner.loader import load_model  # noqa: E402
from model_runner.models.layers import RMSNorm  # noqa: E402
from model_runner.models.rope import apply_rope  # noqa: E402
from tests.support.model_helpers import (  # noqa: E402
    CONFIGS,
    RunnerLoop,
    TinyModel,
    greedy_seqs,
    make_model_folder,
)

interpreted(triton_attention_kernels, "prefill_kernel")  # `ta` reads them at each call
tl_ops = interpreted(tl_ops, "_rope_kernel")


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """float32: the same math in another order. bfloat16: a few rounding steps of the
    largest value apart (the reference rounds after every op, and one step in a product
    before a cancelling subtraction is then the whole difference; the interpreter also
    truncates float32 to bfloat16 where a GPU rounds to nearest)."""
    assert out.dtype == ref.dtype
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    else:
        atol = 2**-5 * ref.abs().amax().item()
        torch.testing.assert_close(out, ref, atol=atol, rtol=0.0)


DTYPES = [torch.float32, torch.bfloat16]


def randn(*shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(sum(shape))
    return (torch.randn(*shape, generator=gen) * scale).to(device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [64, 576])  # 576: SmolLM2, not a power of two
def test_rms_norm_matches_the_torch_norm(dtype: torch.dtype, width: int) -> None:
    norm = RMSNorm(width, 1e-5).to(device=DEVICE, dtype=dtype)
    torch.nn.init.normal_(norm.weight)
    x = randn(7, width, dtype=dtype, scale=3.0)
    assert_close(norm(x, tl_ops.TRITON_LAYER_OPS), norm(x))


def test_rms_norm_reads_strided_rows() -> None:
    norm = RMSNorm(64, 1e-6).to(DEVICE)
    x = randn(5, 128, dtype=torch.float32)[:, 32:96]  # rows 128 apart
    assert_close(norm(x, tl_ops.TRITON_LAYER_OPS), norm(x.contiguous()))


def rope_inputs(dtype: torch.dtype, head_dim: int, rows: int = 6, heads: int = 4,
                kv_heads: int = 2):
    qkv = randn(rows, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    angles = torch.rand(rows, head_dim // 2, generator=torch.Generator().manual_seed(1)) * 30
    cos, sin = (a.to(device=DEVICE, dtype=dtype) for a in (angles.cos(), angles.sin()))
    q = qkv[:, : heads * head_dim].view(rows, heads, head_dim)
    k = qkv[:, heads * head_dim: (heads + kv_heads) * head_dim].view(rows, kv_heads, head_dim)
    return qkv, cos, sin, q, k, heads, kv_heads


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [48, 128])  # 48: halves of 24, padded to 32
def test_rope_rotates_query_and_key_heads_in_place(dtype: torch.dtype, head_dim: int) -> None:
    qkv, cos, sin, q, k, heads, kv_heads = rope_inputs(dtype, head_dim)
    values = qkv[:, (heads + kv_heads) * head_dim:].clone()
    expected_q, expected_k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    tl_ops.rope_(qkv, cos, sin, heads, kv_heads, head_dim)
    assert_close(q, expected_q)
    assert_close(k, expected_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], values)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_after_the_per_head_qk_norm(dtype: torch.dtype) -> None:
    head_dim = 64
    qkv, cos, sin, q, k, heads, kv_heads = rope_inputs(dtype, head_dim)
    q_norm, k_norm = (RMSNorm(head_dim, 1e-6).to(device=DEVICE, dtype=dtype) for _ in "qk")
    torch.nn.init.normal_(q_norm.weight)
    torch.nn.init.normal_(k_norm.weight, mean=2.0)  # a wrong weight per head shows
    expected_q = apply_rope(q_norm(q), cos, sin)
    expected_k = apply_rope(k_norm(k), cos, sin)
    tl_ops.rope_(qkv, cos, sin, heads, kv_heads, head_dim,
                 (q_norm.weight, k_norm.weight, 1e-6))
    assert_close(q, expected_q)
    assert_close(k, expected_k)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # exp(200): inf, as on GPUs
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_torch(dtype: torch.dtype) -> None:
    x = randn(5, 2 * 1600, dtype=dtype, scale=8.0)  # two column tiles, the second partial
    x[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -90.0], dtype=dtype)
    gate, up = x.chunk(2, dim=-1)
    assert_close(tl_ops.silu_and_mul(x), F.silu(gate) * up)


def test_kernels_reject_strided_columns() -> None:
    x = randn(4, 128, dtype=torch.float32)
    with pytest.raises(ValueError, match="contiguous columns"):
        tl_ops.rms_norm(x[:, ::2], torch.ones(64, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="contiguous columns"):
        tl_ops.silu_and_mul(x.t())
    with pytest.raises(ValueError, match="contiguous rows"):
        tl_ops.rope_(x[:, ::2], x[:, :32], x[:, :32], 1, 0, 64)


def test_empty_batches() -> None:
    x = torch.empty(0, 64, device=DEVICE)
    assert tl_ops.rms_norm(x, torch.ones(64, device=DEVICE), 1e-6).shape == (0, 64)
    assert tl_ops.silu_and_mul(x).shape == (0, 32)
    tl_ops.rope_(torch.empty(0, 256, device=DEVICE), x[:, :16], x[:, :16], 2, 1, 64)


@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
def test_models_on_the_triton_layers_match_generate(tmp_path, arch: str) -> None:
    """Every layer through the Triton kernels (Qwen3's q/k norm inside the RoPE kernel),
    float32: the same greedy tokens as Hugging Face."""
    hf = make_model_folder(tmp_path, CONFIGS[arch]())
    loaded = load_model(ModelConfig(model=str(tmp_path), dtype="float32", num_kv_blocks=1))
    tiny = TinyModel(hf, loaded)
    runner = tiny.runner(block_size=4)
    runner.attn = AttentionBackend("triton", ta.write_kv_cache, ta.paged_attention,
                                   tl_ops.TRITON_LAYER_OPS)
    assert runner.model.layer_ops(runner.attn, torch.float32) is tl_ops.TRITON_LAYER_OPS
    seqs = greedy_seqs([5, 12, 3], max_tokens=5, seed=7)
    assert RunnerLoop(runner).run(seqs) == [tiny.generate(s.prompt, 5) for s in seqs]
