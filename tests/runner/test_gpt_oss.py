"""gpt-oss's own parts against Hugging Face (float32): YaRN RoPE, the experts block
(router bias, interleaved gate/up with biases, clamped SwiGLU), the whole model's logits
with every bias and sink away from its init, greedy tokens over two tensor-parallel ranks
(gloo), and its checkpoint's loading.

The greedy parity with HF `generate` (one at a time, batched and chunked on every CPU
backend, from the prefix cache, after a preemption) runs in test_gemma.py over the tiny
config (WINDOWED_CONFIGS["gpt_oss"]), its window of 8 crossed by the contexts.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GptOssConfig, Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

from model_runner.config import ModelConfig
from model_runner.distributed.tp_workers import start_tensor_parallel
from model_runner.loader import load_model
from model_runner.models.gpt_oss import GptOssForCausalLM, GptOssMoE
from model_runner.models.moe import route
from model_runner.models.rope import RopeAngles
from tests.support.model_helpers import (
    MIN_MARGIN,
    TINY,
    WINDOWED_CONFIGS,
    RunnerLoop,
    Seq,
    TinyModel,
    assert_chunked_logits_match_hf,
    clear_margin_generations,
    make_model_folder,
    prompts,
)

CONFIG = WINDOWED_CONFIGS["gpt_oss"]

YARN_CASES = {
    # gpt-oss's own: no truncation of the ramp
    "gpt-oss": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096},
    # Qwen3's long context: the ramp's ends rounded, the default betas
    "qwen3": {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
              "original_max_position_embeddings": 32768},
    # DeepSeek's form of the scaling
    "mscale": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 1.0,
               "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096},
    "attention_factor": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0,
                         "attention_factor": 0.8, "original_max_position_embeddings": 2048},
}


@pytest.mark.parametrize("case", list(YARN_CASES))
def test_yarn_matches_hf(case: str) -> None:
    """cos and sin, frequencies and attention scaling, as HF's rotary embedding has them."""
    params = YARN_CASES[case]
    make = GptOssConfig if case == "gpt-oss" else Qwen3Config
    config = make(**dict(TINY, head_dim=64, max_position_embeddings=131072),
                  rope_parameters=params)
    inv_freq, scaling = ROPE_INIT_FUNCTIONS["yarn"](config)
    assert scaling != 1.0
    positions = torch.tensor([0.0, 1.0, 77.0, 5000.0, 100000.0])
    rope = RopeAngles.of(config, 64, 100001, torch.device("cpu"), torch.float32)
    cos, sin = rope(positions.long())
    freqs = torch.outer(positions, inv_freq)
    torch.testing.assert_close(cos, freqs.cos() * scaling)
    torch.testing.assert_close(sin, freqs.sin() * scaling)


def _blocks() -> tuple[GptOssMLP, GptOssMoE]:
    """HF's block with random weights (biases too), and ours loaded from its tensors."""
    config = CONFIG()
    torch.manual_seed(0)
    hf = GptOssMLP(config).eval()
    for p in hf.parameters():
        p.data = torch.randn_like(p) * 0.5
    ours = GptOssMoE(config)
    gate_up = hf.experts.gate_up_proj  # [E, H, 2I], gate and up interleaved
    with torch.no_grad():
        ours.gate.weight.copy_(hf.router.weight)
        ours.gate.bias.copy_(hf.router.bias)
        ours.w13.copy_(torch.cat([gate_up[..., ::2], gate_up[..., 1::2]], -1).transpose(1, 2))
        bias = hf.experts.gate_up_proj_bias
        ours.w13_bias.copy_(torch.cat([bias[:, ::2], bias[:, 1::2]], -1))
        ours.w2.copy_(hf.experts.down_proj.transpose(1, 2))
        ours.w2_bias.copy_(hf.experts.down_proj_bias)
    return hf, ours


@torch.inference_mode()
def test_block_matches_hf_clamped_with_an_idle_expert() -> None:
    hf, ours = _blocks()
    hidden = ours.gate.weight.shape[1]
    # positive inputs: expert 0's router row all positive wins every token, the last
    # one's all negative never wins
    for router in (ours.gate, hf.router):
        router.weight[0], router.weight[-1] = 0.5, -0.5
    x = torch.rand(23, hidden) + 0.1
    _, ids = route(ours.gate(x), ours.top_k, ours.scoring, ours.renormalize)
    loads = torch.bincount(ids.flatten(), minlength=ours.num_experts)
    assert loads[0] == 23 and loads[-1] == 0
    gate_up = torch.einsum("th,eih->tei", x, ours.w13) + ours.w13_bias
    assert bool((gate_up.abs() > ours.limit).any())  # the clamps bite
    expected, _ = hf(x[None])
    torch.testing.assert_close(ours(x), expected[0], rtol=1e-5, atol=1e-5)


def _with_biases(folder, hf: torch.nn.Module) -> None:
    """Every bias of `hf` (HF inits them at 0) and sink moved off its init, saved again."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "bias" in name or "sinks" in name:
                param.add_(torch.randn(param.shape) * 0.3)
    hf.save_pretrained(folder)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> TinyModel:
    folder = tmp_path_factory.mktemp("gpt_oss")
    hf = make_model_folder(folder, CONFIG(), norm_noise=0.3)
    _with_biases(folder, hf)
    return TinyModel(hf, load_model(ModelConfig(model=str(folder), num_kv_blocks=1)))


def test_registered_with_sinks_and_alternating_windows(tiny: TinyModel) -> None:
    model = tiny.loaded.model
    assert isinstance(model, GptOssForCausalLM)
    options = [layer.self_attn.options for layer in model.layers]
    assert [o.sliding_window for o in options] == [8, None, 8]
    for layer, o in zip(model.layers, options, strict=True):
        assert torch.equal(o.sinks, layer.self_attn.sinks) and o.sinks.dtype == torch.float32


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@torch.inference_mode()
def test_logits_match_hf_forward(tiny: TinyModel, backend: str) -> None:
    """A whole prompt and a chunk after a cached prefix, both past the window."""
    assert_chunked_logits_match_hf(tiny, tiny.runner(block_size=4, attention_backend=backend))


def test_two_ranks_match_hf(tiny: TinyModel) -> None:
    """-tp 2: each rank holds its heads' sinks and half of every expert's width (the down
    bias on rank 0 only); greedy tokens, batched and chunked, as Hugging Face's."""
    config = ModelConfig(model=tiny.loaded.model_path, block_size=4, num_kv_blocks=64,
                         tensor_parallel_size=2)
    full = tiny.loaded.model.layers[0]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # shared by the two ranks: one thread each
    deaths: list[str] = []
    try:
        _, tp = start_tensor_parallel(config, deaths.append)
        try:
            shard = tp.model.layers[0]
            assert torch.equal(shard.self_attn.options.sinks, full.self_attn.sinks[:2])
            assert shard.mlp.intermediate_size == full.mlp.intermediate_size // 2
            assert shard.mlp.w2_bias is not None
            candidates = prompts([5, 19, 30, 7, 21, 28], seed=5)
            found = clear_margin_generations(tiny.hf, candidates, 8, MIN_MARGIN)
            assert len(found) >= 3, "too few prompts with a clear greedy margin"
            seqs = [Seq(f"tp{i}", list(p), 8) for i, p in enumerate(found)]
            assert RunnerLoop(tp, chunk_size=7).run(seqs) == list(found.values())
            tp.workers.close()  # EOF on its socket: the worker exits by itself
            assert [p.returncode for p in tp.workers.processes] == [0]
        finally:
            tp.model.tp.close()
    finally:
        torch.set_num_threads(threads)
    assert not deaths


@pytest.mark.parametrize(
    "drop,error",
    [
        ("model.layers.1.mlp.experts.gate_up_proj_bias", "lacks weights for layers.1.mlp.w13_b"),
        ("model.layers.0.mlp.router.bias", "lacks weights for layers.0.mlp.gate.bias"),
        ("model.layers.2.self_attn.sinks", "lacks weights for layers.2.self_attn.sinks"),
    ],
)
def test_a_checkpoint_without_a_weight_is_one_clear_error(tiny, tmp_path, drop, error) -> None:
    folder = shutil.copytree(tiny.loaded.model_path, tmp_path / "model")
    weights = load_file(folder / "model.safetensors")
    del weights[drop]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=error):
        load_model(ModelConfig(model=str(folder), num_kv_blocks=1))


def test_a_quantized_checkpoint_is_refused() -> None:
    config = CONFIG()
    config.quantization_config = {"quant_method": "mxfp4"}
    with pytest.raises(ValueError, match="MXFP4"), torch.device("meta"):
        GptOssForCausalLM(config)
