"""The mixture-of-experts block (model_runner/models/moe.py) against Hugging Face's own
blocks, its weights' loading, and the margins the MoE families' parity tests stand on.

The families' greedy parity with HF `generate` (one at a time, batched, chunked, from the
prefix cache, after a preemption) runs in test_model_runner.py over their tiny configs.
"""

from __future__ import annotations

import importlib
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_runner.config import ModelConfig
from model_runner.loader import load_model
from model_runner.models.llama import MLP
from model_runner.models.moe import MoE, experts_torch, route
from model_runner.models.moe_models import MoeForCausalLM
from tests.support.model_helpers import CONFIGS, make_model_folder, prompts

# family -> HF's MoE block. NOTE: imported when a test runs, not at collection: these
# modules import triton, which must first see the TRITON_INTERPRET=1 that the Triton tests
# set when they are collected (a triton imported without it breaks their interpreter).
MOE_FAMILIES = {
    "qwen3_moe": "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
    "qwen2_moe": "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "mixtral": "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
}


def _hf_block(family: str) -> tuple[torch.nn.Module, MoE]:
    """HF's block with random weights, and ours holding the same."""
    config = CONFIGS[family]()
    module, _, name = MOE_FAMILIES[family].rpartition(".")
    torch.manual_seed(0)
    hf = getattr(importlib.import_module(module), name)(config).eval()
    for p in hf.parameters():
        p.data = torch.randn_like(p) * 0.2
    ours = MoE(config)
    with torch.no_grad():
        ours.gate.weight.copy_(hf.gate.weight)
        ours.w13.copy_(hf.experts.gate_up_proj)
        ours.w2.copy_(hf.experts.down_proj)
        if ours.shared_expert is not None:
            shared = hf.shared_expert
            gate_up = torch.cat([shared.gate_proj.weight, shared.up_proj.weight])
            ours.shared_expert.gate_up_proj.weight.copy_(gate_up)
            ours.shared_expert.down_proj.weight.copy_(shared.down_proj.weight)
            ours.shared_expert_gate.weight.copy_(hf.shared_expert_gate.weight)
    return hf, ours


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
@torch.inference_mode()
def test_block_matches_hf_with_uneven_loads_and_an_idle_expert(family: str):
    hf, ours = _hf_block(family)
    hidden = ours.gate.weight.shape[1]
    # positive inputs: expert 0's router row all positive wins every token, the last
    # expert's all negative never wins, the rest split the second seats unevenly
    ours.gate.weight[0] = hf.gate.weight[0] = 0.5
    ours.gate.weight[-1] = hf.gate.weight[-1] = -0.5
    x = torch.rand(37, hidden) + 0.1
    _, ids = route(ours.gate(x), ours.top_k, ours.scoring, ours.renormalize)
    loads = torch.bincount(ids.flatten(), minlength=ours.num_experts)
    assert loads[0] == 37 and loads[-1] == 0 and len(set(loads[1:-1].tolist())) > 1
    expected = hf(x[None])[0]
    torch.testing.assert_close(ours(x), expected, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_grouped_experts_equal_a_per_token_loop():
    torch.manual_seed(1)
    num_experts, hidden, width, top_k = 6, 16, 8, 3
    x = torch.randn(29, hidden, dtype=torch.float64)
    w13 = torch.randn(num_experts, 2 * width, hidden, dtype=torch.float64)
    w2 = torch.randn(num_experts, hidden, width, dtype=torch.float64)
    # experts 2 and 4 idle; expert 0 in every token's seats
    choices = torch.tensor([0, 1, 3, 5])
    ids = torch.stack([torch.cat([choices[:1], choices[1:][torch.randperm(3)[:2]]]) for _ in x])
    weights = torch.rand(29, top_k, dtype=torch.float64)
    expected = torch.zeros_like(x)
    for t in range(len(x)):
        for k in range(top_k):
            gate, up = (w13[ids[t, k]] @ x[t]).chunk(2)
            expected[t] += weights[t, k] * (w2[ids[t, k]] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(experts_torch(x, weights, ids, w13, w2), expected)


def test_sigmoid_scoring_and_renormalisation():
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0]])
    weights, ids = route(logits, 2, "sigmoid", renormalize=False)
    assert ids.tolist() == [[0, 2]]
    torch.testing.assert_close(weights, torch.sigmoid(torch.tensor([[2.0, 0.5]])))
    weights, _ = route(logits, 2, "softmax", renormalize=True)
    assert weights.sum().item() == pytest.approx(1.0)


def test_sparse_layers_follow_the_config():
    config = CONFIGS["qwen3_moe"]()
    config.num_hidden_layers, config.decoder_sparse_step, config.mlp_only_layers = 4, 2, [3]
    with torch.device("meta"):
        model = MoeForCausalLM(config)
    assert [type(layer.mlp) for layer in model.layers] == [MLP, MoE, MLP, MLP]


@pytest.fixture(scope="module")
def qwen2_moe_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen2_moe")
    make_model_folder(folder, CONFIGS["qwen2_moe"]())
    return folder


@pytest.mark.parametrize(
    "drop,error",
    [
        ("model.layers.0.mlp.experts.5.up_proj.weight", "lacks weights for layers.0.mlp.w13"),
        ("model.layers.1.mlp.shared_expert_gate.weight", "lacks weights for layers.1.mlp.shared"),
    ],
)
def test_a_checkpoint_without_an_expert_is_one_clear_error(
    qwen2_moe_checkpoint, tmp_path, drop, error
):
    folder = shutil.copytree(qwen2_moe_checkpoint, tmp_path / "model")
    weights = load_file(folder / "model.safetensors")
    del weights[drop]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=error):
        load_model(ModelConfig(model=str(folder), num_kv_blocks=1))


# the prompts of test_model_runner.py's parity tests: (lengths, seed, max_tokens)
PARITY_PROMPTS = [([11], 0, 12), ([3, 17, 8, 30], 1, 10), ([19, 26], 3, 6), ([10, 15], 8, 12)]


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
@torch.inference_mode()
def test_parity_prompts_decide_clearly_on_hf(family: str, tmp_path):
    """HF's greedy choices on the parity tests' prompts are not near ties, neither the
    next token nor a router's k-th expert against the next best. NOTE: the runner's
    hidden states differ from HF's by ~1e-6 in float32, so these margins hold with room."""
    hf = make_model_folder(tmp_path, CONFIGS[family]())
    gaps: list[float] = []

    def record_gap(module, inputs, outputs) -> None:
        probs = outputs[0].float().softmax(-1).sort(-1, descending=True).values
        gaps.append((probs[:, module.top_k - 1] - probs[:, module.top_k]).min().item())

    for layer in hf.model.layers:
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.register_forward_hook(record_gap)
    margins = []
    for lengths, seed, max_tokens in PARITY_PROMPTS:
        for prompt in prompts(lengths, seed):
            out = hf.generate(
                torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                pad_token_id=0, output_scores=True, return_dict_in_generate=True,
            )
            margins += [(lambda top: (top[0] - top[1]).item())(s[0].topk(2).values)
                        for s in out.scores]
    assert min(margins) > 1e-3 and min(gaps) > 1e-6
