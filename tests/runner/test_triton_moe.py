"""The fused MoE Triton kernel (model_runner/kernels/triton_moe.py) against the torch path
of model_runner/models/moe.py: random routings, uneven loads, idle experts, one token;
gpt-oss's biases and clamped SwiGLU.

Without CUDA they run in Triton's interpreter (tests/support/triton_interpreter.py); on
CUDA (`python -m bench.gpu_check`) the same tests run compiled kernels.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.triton_interpreter import DEVICE, ON_CUDA, import_triton, interpreted

import_triton()

from model_runner.config import ModelConfig  # noqa: E402
from model_runner.kernels import triton_moe  # noqa: E402
from model_runner.loader import load_model  # noqa: E402
from model_runner.models import moe  # noqa: E402
from model_runner.models.moe import experts_torch  # noqa: E402
from tests.support.model_helpers import (  # noqa: E402
    CONFIGS,
    RunnerLoop,
    TinyModel,
    greedy_seqs,
    make_model_folder,
)

triton_moe = interpreted(triton_moe, "_down_kernel")


def _experts(num_experts: int, hidden: int, width: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(0)
    w13 = torch.randn(num_experts, 2 * width, hidden, generator=gen) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, width, generator=gen) * width**-0.5
    return w13.to(DEVICE, dtype), w2.to(DEVICE, dtype)


def _routing(num_tokens: int, top_k: int, probs: torch.Tensor, seed: int):
    """ids [T, K] (distinct experts per token, drawn from `probs`) and weights [T, K]."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.multinomial(probs, top_k, generator=gen) for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k, generator=gen)
    return ids.to(DEVICE), weights.to(DEVICE)


# probabilities of 8 experts: even; skewed with two idle; one taking nearly everything
EVEN = torch.ones(8)
SKEWED = torch.tensor([8.0, 4.0, 0.0, 2.0, 1.0, 0.0, 0.5, 0.25])
HOT = torch.tensor([1000.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "num_tokens,top_k,probs",
    [(37, 2, EVEN), (45, 2, SKEWED), (23, 3, HOT), (1, 2, SKEWED)],
    ids=["even", "skewed-two-idle", "one-hot-expert", "one-token"],
)
def test_fused_experts_match_the_torch_path(num_tokens, top_k, probs, dtype):
    if dtype == torch.bfloat16 and not ON_CUDA:
        # NOTE: Triton 3.x's interpreter multiplies bfloat16 bit patterns as integers in
        # tl.dot (see test_triton_attention.py), so bf16 is checked on a GPU only
        pytest.skip("Triton's interpreter computes tl.dot on bfloat16 bit patterns; GPU only")
    hidden, width = 64, 48  # width not a power of two: the last column block is partial
    w13, w2 = _experts(8, hidden, width, dtype)
    ids, weights = _routing(num_tokens, top_k, probs, seed=num_tokens)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(1)).to(
        DEVICE, dtype
    )
    out = triton_moe.fused_experts(x, weights, ids, w13, w2)
    ref = experts_torch(x.cpu(), weights.cpu(), ids.cpu(), w13.cpu(), w2.cpu())
    assert out.dtype == dtype and out.shape == x.shape
    if dtype == torch.float32:
        torch.testing.assert_close(out.cpu(), ref, atol=1e-5, rtol=1e-5)
    else:  # a few rounding steps of the largest value (sums in another order)
        atol = (2**-5 if dtype == torch.bfloat16 else 2**-8) * ref.abs().amax().item()
        torch.testing.assert_close(out.cpu(), ref, atol=atol, rtol=0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("down_bias", [True, False], ids=["down-bias", "no-down-bias"])
def test_gpt_oss_experts_match_the_torch_path(dtype, down_bias):
    """gpt-oss's experts: biases on gate/up and down (none on down: a tensor-parallel
    rank other than 0) and the clamped SwiGLU, its clamps biting on both sides."""
    hidden, width, limit, alpha = 64, 48, 1.0, 1.702
    w13, w2 = _experts(8, hidden, width, dtype)
    gen = torch.Generator().manual_seed(2)
    b13 = torch.randn(8, 2 * width, generator=gen).to(DEVICE, dtype)
    b2 = torch.randn(8, hidden, generator=gen).to(DEVICE, dtype) if down_bias else None
    ids, weights = _routing(45, 2, SKEWED, seed=4)
    x = (torch.randn(45, hidden, generator=gen) * 2).to(DEVICE, dtype)
    gate_up = torch.einsum("th,eih->tei", x.float().cpu(), w13.float().cpu()) + b13.cpu()
    assert bool((gate_up > limit).any()) and bool((gate_up < -limit).any())
    out = triton_moe.fused_experts(x, weights, ids, w13, w2, b13, b2, limit, alpha)

    def clamped(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))

    ref = experts_torch(x.cpu(), weights.cpu(), ids.cpu(), w13.cpu(), w2.cpu(), b13.cpu(),
                        None if b2 is None else b2.cpu(), clamped)
    if dtype == torch.float32:
        torch.testing.assert_close(out.cpu(), ref, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(out.cpu(), ref, atol=2**-8 * ref.abs().amax().item(),
                                   rtol=0.0)


def test_alignment_gives_each_tile_one_expert():
    ids, _ = _routing(45, 2, SKEWED, seed=3)
    sorted_pairs, tile_experts = triton_moe.align_by_expert(ids, 8, block_m=16)
    sorted_pairs, tile_experts = sorted_pairs.cpu(), tile_experts.cpu()
    flat = ids.flatten().cpu()
    counts = torch.bincount(flat, minlength=8)
    assert counts[2] == counts[5] == 0
    used = tile_experts[tile_experts >= 0]
    # each expert with pairs gets ceil(count / 16) tiles, in expert order; idle ones none
    assert used.tolist() == [e for e in range(8) for _ in range(-(-int(counts[e]) // 16))]
    rows = sorted_pairs.view(-1, 16)[: len(used)]
    real = rows < len(flat)
    assert sorted(rows[real].tolist()) == list(range(len(flat)))  # every pair once
    assert (flat[rows[real].long()] == used[:, None].expand_as(rows)[real]).all()
    assert (sorted_pairs[len(used) * 16 :] == len(flat)).all()  # the rest is padding


def test_a_moe_model_on_the_fused_kernel_matches_generate(tmp_path, monkeypatch):
    """Qwen2-MoE (routed and shared experts) with every MoE layer on the fused kernel,
    float32: the same greedy tokens as Hugging Face."""
    if not ON_CUDA:  # the CPU runs the torch path: swap the kernel in for it
        monkeypatch.setattr(moe, "experts_torch", triton_moe.fused_experts)
    hf = make_model_folder(tmp_path, CONFIGS["qwen2_moe"]())
    loaded = load_model(ModelConfig(model=str(tmp_path), dtype="float32", num_kv_blocks=1))
    tiny = TinyModel(hf, loaded)
    seqs = greedy_seqs([5, 12, 3], max_tokens=5, seed=7)
    outputs = RunnerLoop(tiny.runner(block_size=4)).run(seqs)
    assert outputs == [tiny.generate(s.prompt, 5) for s in seqs]
