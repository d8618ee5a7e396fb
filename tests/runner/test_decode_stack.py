"""The decode step's layers in one C++ call (model_runner/models/decode_stack.py,
csrc/cpu_decode_stack.cpp): the same hidden states, to the bit, as the Python layers on
the "cpu" backend, for every small-batch weight form (float32 rows, exact GGUF blocks,
float16, rotated int8, blocks times int8), with and without biases; taken only for decode
steps of few enough rows, and only by a layer whose parts declare the stack's form (a
subclass that keeps the arithmetic keeps the stack; every other layer says why not). The
C++ stack's projection kinds are the kernel table's paths."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

import model_runner.models.registry  # noqa: F401  (every family's classes, for the subclass check)
from model_runner.config import ModelConfig
from model_runner.kernels.cpu_kernel_table import DEFAULT_TABLE, GEMM_ONLY, PATHS
from model_runner.kernels.cpu_kernels import cpu_kernels_available
from model_runner.kernels.cpu_linear import can_pack
from model_runner.loader import load_model
from model_runner.models.decode_stack import TENSORS_PER_KIND, DecodeStack, build_decode_stack
from model_runner.models.layers import MLP, Attention, Linear, RMSNorm
from model_runner.models.llama import DecoderLayer
from model_runner.runner import ModelRunner
from tests.support.model_helpers import (
    CONFIGS,
    FAMILY_CONFIGS,
    WINDOWED_CONFIGS,
    RunnerLoop,
    greedy_seqs,
    make_model_folder,
)

ALL_CONFIGS = {**CONFIGS, **WINDOWED_CONFIGS}

pytestmark = pytest.mark.skipif(
    not cpu_kernels_available() or not can_pack(torch.device("cpu"), torch.float32, "int8"),
    reason="needs the C++ CPU kernels and a torch with oneDNN and fbgemm",
)


def on_q4_1_grid(folder: Path, config_name: str) -> None:
    """A tiny model in `folder` whose projections hold a GGUF's Q4_1 values (as the
    default model's do), so that they load as exact blocks."""
    hf_model = make_model_folder(folder, ALL_CONFIGS[config_name](), norm_noise=0.3)
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if name.endswith("proj.weight"):
                values = param.numpy().astype(np.float32)
                grid = dequantize(quantize(values, GGMLQuantizationType.Q4_1),
                                  GGMLQuantizationType.Q4_1)
                param.copy_(torch.from_numpy(grid.copy()))
    hf_model.save_pretrained(folder)


class CountingStack:
    """The model's stack, counting the steps it ran."""

    def __init__(self, stack) -> None:
        self.stack, self.calls = stack, 0

    def takes(self, meta, num_tokens: int) -> bool:
        return self.stack.takes(meta, num_tokens)

    def __call__(self, *args) -> torch.Tensor:
        self.calls += 1
        return self.stack(*args)


def hidden_states(
    loaded, stack, lengths: list[int], max_tokens: int, vocab: int | None = None
) -> list[torch.Tensor]:
    """Every step's final hidden rows of a greedy run of prompts of `lengths` (ids below
    `vocab`, default the default model's), with the model's decode stack set to `stack`
    (None: the Python layers)."""
    model = loaded.model
    seen: list[torch.Tensor] = []
    compute_logits = model.compute_logits

    def recording(hidden: torch.Tensor) -> torch.Tensor:
        seen.append(hidden.clone())
        return compute_logits(hidden)

    model.decode_stack, model.compute_logits = stack, recording
    try:
        runner = ModelRunner(loaded, ModelConfig(block_size=4, num_kv_blocks=128))
        seqs = greedy_seqs(lengths, max_tokens)
        for seq in seqs if vocab is not None else ():
            seq.prompt = [token % vocab for token in seq.prompt]
        RunnerLoop(runner).run(seqs)
    finally:
        del model.compute_logits
    return seen


@pytest.mark.parametrize(
    ("config_name", "weight_dtype", "grid", "kind"),
    [
        ("smollm2", "auto", False, "matvec"),  # float32 rows
        ("qwen2", "auto", False, "matvec"),  # with q/k/v biases
        ("qwen3", "auto", False, "matvec"),  # per-head q/k norms
        ("qwen3", "float16", False, "matvec"),
        ("qwen3", "int8", False, "int8_matvec"),
        # sandwich norms on 1 + w, gelu gate, scaled queries, soft caps, local layers' windows
        ("gemma2", "auto", False, "matvec"),
        ("gemma2", "int8", False, "int8_matvec"),
        # and per-head q/k norms, local layers on their own RoPE table
        ("gemma3", "auto", False, "matvec"),
        ("gemma3", "float16", False, "matvec"),
        ("gemma3", "int8", False, "int8_matvec"),
        ("gemma3", "auto", True, "q4_1_matvec"),
        ("smollm3", "auto", False, "matvec"),  # a layer without RoPE (NoPE)
        ("granite", "auto", False, "matvec"),  # each block's output scaled
        ("granite", "int8", False, "int8_matvec"),
        ("smollm2", "auto", True, "q4_1_matvec"),  # exact Q4_1 blocks (the LM head stays rows)
        ("smollm2", "float16", False, "matvec"),
        # Q4_1 blocks times activations split in int8 planes
        ("smollm2", "float16", True, "q4_1_planes_matvec"),
        ("qwen2", "int8", False, "int8_matvec"),
        ("smollm2", "int8", True, "q4_1_int8_matvec"),  # Q4_1 blocks times int8 activations
    ],
)
def test_the_stack_gives_the_python_layers_hidden_states_bit_for_bit(
    tmp_path: Path, config_name: str, weight_dtype: str, grid: bool, kind: str
) -> None:
    if grid:
        on_q4_1_grid(tmp_path, config_name)
    else:  # Gemma's norms moved off their init (w = 0)
        make_model_folder(tmp_path, ALL_CONFIGS[config_name](), norm_noise=0.3)
    loaded = load_model(ModelConfig(model=str(tmp_path), num_kv_blocks=1,
                                    weight_dtype=weight_dtype))
    model = loaded.model
    stack = model.decode_stack
    assert stack is not None
    assert {p.packed.decode_form().path.name for p in model.layers[0].self_attn.modules()
            if hasattr(p, "packed") and p.packed is not None} == {kind}
    counting = CountingStack(stack)
    # three prompts decode as a batch of three after their prefills
    with_stack = hidden_states(loaded, counting, [5, 9, 3], max_tokens=6)
    without = hidden_states(loaded, None, [5, 9, 3], max_tokens=6)
    assert counting.calls == 5  # the 5 decode steps; the prefill step ran in Python
    assert len(with_stack) == len(without) == 6
    for a, b in zip(with_stack, without, strict=True):
        assert torch.equal(a, b)


def test_the_stack_is_not_taken_past_its_rows_nor_with_prefills(tmp_path: Path) -> None:
    make_model_folder(tmp_path, CONFIGS["smollm2"]())
    loaded = load_model(ModelConfig(model=str(tmp_path), num_kv_blocks=1,
                                    weight_dtype="float16"))
    model = loaded.model
    stack = model.decode_stack
    assert stack.max_rows == 8  # the matvec's
    counting = CountingStack(stack)
    # nine decodes are past the matvec's eight rows: every step runs the Python layers
    assert len(hidden_states(loaded, counting, [4] * 9, max_tokens=3)) == 3
    assert counting.calls == 0
    # a staggered start: the first request's decodes share steps with the second's prefill
    counting = CountingStack(stack)
    seqs = greedy_seqs([6, 30], max_tokens=4)
    model.decode_stack = counting
    runner = ModelRunner(loaded, ModelConfig(block_size=4, num_kv_blocks=128))
    engine = RunnerLoop(runner, chunk_size=8)
    engine.step(seqs)  # both prefill (the second in part)
    engine.step(seqs)  # the first decodes beside the second's prefill chunk
    assert counting.calls == 0
    engine.run(seqs)
    assert counting.calls >= 1  # once the second's prompt is in, both decode in the stack


@pytest.mark.skipif(not cpu_kernels_available() or not torch.ops.pagedserve.amx_int8_granted(),
                    reason="the host grants no AMX int8 tiles")
@pytest.mark.parametrize(("config_name", "grid"), [("smollm2", True), ("qwen2", False)])
def test_int8_batches_past_the_small_rows_run_in_the_stack_on_amx_tiles(
    tmp_path: Path, config_name: str, grid: bool
) -> None:
    # Q4_1 blocks times int8 activations, and rotated int8 rows with biases: each a batch
    # form on AMX's int8 tiles, which the stack runs past its small-batch rows, as Python does
    if grid:
        on_q4_1_grid(tmp_path, config_name)
    else:
        make_model_folder(tmp_path, ALL_CONFIGS[config_name](), norm_noise=0.3)
    loaded = load_model(ModelConfig(model=str(tmp_path), num_kv_blocks=1, weight_dtype="int8"))
    stack = loaded.model.decode_stack
    forms = [p.packed.decode_form() for p in loaded.model.layers[0].modules()
             if isinstance(p, Linear)]
    assert forms and all(form.batch.path.name == "int8_amx_gemm" for form in forms)
    assert stack.max_rows == PATHS["int8_amx_gemm"].max_rows
    counting = CountingStack(stack)
    lengths = [3 + i for i in range(12)]  # twelve decodes: past every small-batch path
    with_stack = hidden_states(loaded, counting, lengths, max_tokens=4)
    without = hidden_states(loaded, None, lengths, max_tokens=4)
    assert counting.calls == 3
    for a, b in zip(with_stack, without, strict=True):
        assert torch.equal(a, b)


# partial rotary (phi3), post-norms and q/k norms over the whole projection (olmo2),
# experts: each a layer the stack does not repeat, and the reason it says
NOT_STACKED = {
    "phi3": (FAMILY_CONFIGS["phi3"], "layer 0: self_attn: RoPE on 8 of 16 dims"),
    "olmo2": (FAMILY_CONFIGS["olmo2"], "Olmo2DecoderLayer declares no decode-stack form"),
    "qwen3_moe": (CONFIGS["qwen3_moe"], "layer 0: mlp: MoE declares no decode-stack form"),
}


@pytest.mark.parametrize("config_name", sorted(NOT_STACKED))
def test_layers_it_does_not_repeat_get_no_stack(tmp_path: Path, config_name: str) -> None:
    config, reason = NOT_STACKED[config_name]
    make_model_folder(tmp_path, config())
    model = load_model(ModelConfig(model=str(tmp_path), num_kv_blocks=1)).model
    assert model.decode_stack is None
    assert reason in model.decode_stack_off


def test_a_subclass_that_keeps_the_arithmetic_keeps_the_stack(tmp_path: Path) -> None:
    class TracedLayer(DecoderLayer):  # a family's layer adding nothing to the arithmetic
        pass

    make_model_folder(tmp_path, CONFIGS["smollm2"]())
    loaded = load_model(ModelConfig(model=str(tmp_path), num_kv_blocks=1))
    for layer in loaded.model.layers:
        layer.__class__ = TracedLayer
    stack = build_decode_stack(loaded.model.layers)
    assert isinstance(stack, DecodeStack)
    counting = CountingStack(stack)
    with_stack = hidden_states(loaded, counting, [5, 3], max_tokens=4)
    without = hidden_states(loaded, None, [5, 3], max_tokens=4)
    assert counting.calls == 3
    for a, b in zip(with_stack, without, strict=True):
        assert torch.equal(a, b)


def _subclasses(cls: type) -> list[type]:
    return [c for sub in cls.__subclasses__() for c in (sub, *_subclasses(sub))]


@pytest.mark.parametrize(("base", "methods"), [
    (DecoderLayer, ("forward",)), (Attention, ("forward", "qkv")), (MLP, ("forward",)),
    (RMSNorm, ("forward",)),
])
def test_every_subclass_that_changes_the_arithmetic_declares_its_own_form(
    base: type, methods: tuple[str, ...]
) -> None:
    # otherwise it would inherit its base's form, and the stack would run the base's
    # arithmetic in its place
    for cls in _subclasses(base):
        if cls.__module__.startswith("model_runner.") and set(methods) & set(vars(cls)):
            assert "decode_stack_form" in vars(cls), cls


def test_the_cpp_stacks_projection_kinds_are_the_kernel_tables_paths() -> None:
    # csrc/cpu_decode_stack.cpp checks the names and tensor counts it is built with
    # (cpu_kernel_table.PATHS, in order) against its own kinds
    assert all(hasattr(torch.ops.pagedserve, name) for name in PATHS)
    names = list(PATHS)
    torch.classes.pagedserve.DecodeStack(names, TENSORS_PER_KIND)
    for wrong_names, wrong_counts in [
        (names[1:] + names[:1], TENSORS_PER_KIND),
        (names, [*TENSORS_PER_KIND[:-1], TENSORS_PER_KIND[-1] + 1]),
        (names[:-1], TENSORS_PER_KIND[:-1]),
    ]:
        with pytest.raises(RuntimeError, match="differ from the projection kinds"):
            torch.classes.pagedserve.DecodeStack(wrong_names, wrong_counts)


def test_a_table_of_no_rows_runs_every_step_on_the_gemms(tmp_path: Path) -> None:
    make_model_folder(tmp_path, CONFIGS["smollm2"]())
    loaded = load_model(ModelConfig(model=str(tmp_path), num_kv_blocks=1))
    model = loaded.model
    packed = [m.packed for m in model.modules() if isinstance(m, Linear)]
    stack = model.decode_stack
    model.use_kernel_table(GEMM_ONLY)
    assert stack.max_rows == 0
    assert all(p.max_rows == 0 for p in [*packed, model.packed_lm_head])
    counting = CountingStack(stack)
    assert len(hidden_states(loaded, counting, [5], max_tokens=3)) == 3
    assert counting.calls == 0
    model.decode_stack = stack
    model.use_kernel_table(DEFAULT_TABLE)
    assert stack.max_rows == PATHS["matvec"].max_rows
    assert all(p.max_rows == PATHS["matvec"].max_rows for p in packed)
