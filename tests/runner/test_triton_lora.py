"""The LoRA Triton kernels (model_runner/kernels/triton_lora.py) against torch: mixed
batches of adapter and base rows, ranks 8 and 16 (and fused projections' stacked 24, 80),
odd row counts, rows of one adapter apart; and lora_layers on the kernel against its torch
path.

Without CUDA they run in Triton's interpreter (tests/support/triton_interpreter.py); on
CUDA (`python -m bench.gpu_check`) the same tests run compiled kernels.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.triton_interpreter import DEVICE, ON_CUDA, import_triton, interpreted

import_triton()

from model_runner.config import LoRAConfig, ModelConfig  # noqa: E402
from model_runner.cuda_graphs import DecodeGraphRunner, graph_batch_sizes  # noqa: E402
from model_runner.kernels import triton_lora  # noqa: E402
from model_runner.loader import load_model  # noqa: E402
from model_runner.lora_layers import LoRAModel  # noqa: E402
from model_runner.runner import ModelRunner  # noqa: E402
from tests.support.lora_helpers import ADAPTER_SPECS, make_adapter  # noqa: E402
from tests.support.model_helpers import (  # noqa: E402
    CONFIGS,
    RunnerLoop,
    Seq,
    TinyModel,
    greedy_margin,
    make_model_folder,
    prompts,
)

triton_lora = interpreted(triton_lora, "_expand_kernel")

HIDDEN, WIDTH, SLOTS = 64, 80, 3 # WIDTH not a power of two: a partial column block


def _case(slots: list[int], rank: int, dtype: torch.dtype):
    """x, base out, stacked A [S, R, K] and B^T [S, R, N] (slot 1 of a smaller rank, zero
    past it, as the stacks hold it), row slots."""
    gen = torch.Generator().manual_seed(len(slots) + rank)
    x = torch.randn(len(slots), HIDDEN, generator=gen)
    out = torch.randn(len(slots), WIDTH, generator=gen)
    shrink = torch.randn(SLOTS, rank, HIDDEN, generator=gen) * HIDDEN**-0.5
    expand = torch.randn(SLOTS, rank, WIDTH, generator=gen) * rank**-0.5
    shrink[1, rank // 2 :] = 0
    expand[1, rank // 2 :] = 0
    row_slots = torch.tensor(slots, dtype=torch.int32)
    return [t.to(DEVICE, dtype) for t in (x, out, shrink, expand)] + [row_slots.to(DEVICE)]


def _reference(x, out, shrink, expand, row_slots) -> torch.Tensor:
    ref = out.cpu().clone()
    for i, slot in enumerate(row_slots.tolist()):
        if slot >= 0:
            t = x[i].cpu() @ shrink[slot].cpu().T  # rounded to the dtype, as the kernel
            ref[i] += t @ expand[slot].cpu()
    return ref


# sorted runs with base rows first (the runner's order), 37 rows over three tiles; one
# row; only base rows; one adapter's rows apart, between others' (any order is right)
LAYOUTS = {
    "runs": [-1] * 5 + [0] * 13 + [1] * 7 + [2] * 12,
    "one-row": [2],
    "base-only": [-1] * 5,
    "interleaved": [0, -1, 2, 0, 1, 1, -1, 2, 0],
}


# NOTE: bfloat16 on CUDA only: Triton's interpreter computes tl.dot on bfloat16 bit
# patterns (see test_triton_moe.py)
DTYPES = [torch.float32, torch.float16, *([torch.bfloat16] if ON_CUDA else [])]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rank", [8, 16, 24, 80])  # 24, 80: fused parts' R (80: 2 blocks)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_add_lora_matches_torch(layout: str, rank: int, dtype: torch.dtype):
    x, out, shrink, expand, row_slots = _case(LAYOUTS[layout], rank, dtype)
    ref = _reference(x, out, shrink, expand, row_slots)
    base = out.clone()
    result = triton_lora.add_lora(out, x, shrink, expand, row_slots)
    assert result is out
    base_rows = row_slots.cpu() < 0
    assert torch.equal(out.cpu()[base_rows], base.cpu()[base_rows])  # untouched
    if dtype == torch.float32:
        torch.testing.assert_close(out.cpu(), ref, atol=1e-5, rtol=1e-5)
    else:  # a rounding step or two of the largest value
        step = 2**-5 if dtype == torch.bfloat16 else 2**-8
        torch.testing.assert_close(out.cpu(), ref, atol=step * ref.abs().amax().item(),
                                   rtol=0.0)


@torch.inference_mode()
def test_lora_layers_on_the_kernel_match_peft(tmp_path):
    """A tiny Llama with its adapters in slot buffers (as on CUDA), float32: one chunked
    batch of two adapters and the base model gives PeftModel.generate's greedy tokens,
    its decode-only steps on the graph runner's static buffers (eager here); an adapter
    dropped frees its slot for the next."""
    hf = make_model_folder(tmp_path / "model", CONFIGS["smollm2"]())
    loaded = load_model(ModelConfig(model=str(tmp_path / "model"), dtype="float32",
                                    num_kv_blocks=1))
    adapters = {name: make_adapter(tmp_path / name, hf, name, seed, **ADAPTER_SPECS[name])
                for seed, name in enumerate(["all", "mlp"])}
    runner = TinyModel(hf, loaded).runner(block_size=4)
    runner.loras = loras = LoRAModel(runner.model, LoRAConfig(max_loras=2), use_stacks=True)
    for adapter in adapters.values():
        loras.add(loras.read(adapter.name, adapter.path))
    assert loras.table.slots == {"all": 0, "mlp": 1}
    runner.decode_graphs = graphs = DecodeGraphRunner(
        runner.model, runner.attn, max_num_seqs=4, max_model_len=runner.max_model_len,
        block_size=4, use_cuda_graphs=False, loras=loras)
    names = ["mlp", None, "all"]
    seqs = [Seq(f"r{i}", p, 3, lora_name=name)
            for i, (name, p) in enumerate(zip(names, prompts([7, 5, 9], seed=3), strict=True))]
    RunnerLoop(runner, chunk_size=5).run(seqs)
    for s in seqs:
        model = hf if s.lora_name is None else adapters[s.lora_name].peft
        assert s.output == greedy_margin(model, s.prompt, 3)[0], s.lora_name
    # the last step: the decodes of "all" (slot 0) and "mlp" (slot 1), in a bucket of 2
    assert graphs.row_slots[:2].tolist() == [0, 1]
    loras.remove("all")
    loras.add(loras.read("again", adapters["mlp"].path))
    assert loras.table.slots == {"mlp": 1, "again": 0}


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA GPU")
@torch.inference_mode()
def test_lora_decode_graphs_match_eager_and_peft(tmp_path):
    """On CUDA a runner with adapters captures a second graph per bucket; one batch of two
    adapters and the base model gives the same greedy tokens replaying them as eagerly,
    and PeftModel.generate's."""
    hf = make_model_folder(tmp_path / "model", CONFIGS["smollm2"]())
    adapters = [make_adapter(tmp_path / name, hf, name, seed, **ADAPTER_SPECS[name])
                for seed, name in enumerate(["all", "mlp"])]
    lora = LoRAConfig(modules=tuple((a.name, a.path) for a in adapters), max_loras=2)
    names = ["mlp", None, "all", None, "all"]
    outputs = []
    for enforce_eager in (False, True):
        config = ModelConfig(model=str(tmp_path / "model"), device="cuda", dtype="float32",
                             block_size=4, num_kv_blocks=256, max_num_seqs=8,
                             attention_backend="triton", enforce_eager=enforce_eager, lora=lora)
        runner = ModelRunner(load_model(config), config)
        assert runner.loras is not None and runner.loras.use_stacks
        for adapter in adapters:
            runner.loras.add(runner.loras.read(adapter.name, adapter.path))
        if not enforce_eager:
            assert runner.decode_graphs is not None
            assert sorted(runner.decode_graphs._lora_graphs) == graph_batch_sizes(8)
        seqs = [Seq(f"g{i}", p, 6, lora_name=name)
                for i, (name, p) in enumerate(zip(names, prompts([7, 5, 9, 4, 6], seed=5),
                                                  strict=True))]
        outputs.append(RunnerLoop(runner).run(seqs))
    assert outputs[0] == outputs[1]
    models = {None: hf, **{a.name: a.peft for a in adapters}}
    assert outputs[0] == [greedy_margin(models[s.lora_name], s.prompt, 6)[0] for s in seqs]
