"""The model runner on tiny random Llama-family models against Hugging Face, in float32.

Each model is saved to a temporary folder (safetensors and the default model's tokenizer), loaded
through the loader, and driven by the minimal engine loop of tests/support/model_helpers.py
(`RunnerLoop`): no scheduler, blocks handed out by a counter.
"""

from __future__ import annotations

import concurrent.futures
import errno
import os
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config

from model_runner import gguf_file, kv_cache, model_source
from model_runner.block_tables import BlockTables
from model_runner.config import ModelConfig
from model_runner.kv_cache import allocate_kv_cache, bytes_per_block, kv_cache_dtype
from model_runner.loader import load_model
from model_runner.models.rope import RopeAngles, rope_inv_freq
from model_runner.runner import ModelRunner, prepare_inputs
from scheduler.output import ScheduledRequest, SchedulerOutput
from scheduler.sampling_params import SamplingParams
from tests.support.model_helpers import (
    CONFIGS,
    GREEDY,
    VOCAB,
    RunnerLoop,
    Seq,
    TinyModel,
    default_tokenizer,
    greedy_seqs,
    make_model_folder,
    phi3_config,
    prompts,
)
from tests.support.server_process import read_rss_kib


@pytest.fixture(scope="module", params=list(CONFIGS))
def tiny(request, tmp_path_factory) -> TinyModel:
    folder = tmp_path_factory.mktemp(request.param)
    hf_model = make_model_folder(folder, CONFIGS[request.param]())
    return TinyModel(hf_model, load_model(ModelConfig(model=str(folder), num_kv_blocks=1)))


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> TinyModel:
    folder = tmp_path_factory.mktemp("llama")
    hf_model = make_model_folder(folder, CONFIGS["smollm2"]())
    return TinyModel(hf_model, load_model(ModelConfig(model=str(folder), num_kv_blocks=1)))


@torch.inference_mode()
def test_logits_match_hf_forward(tiny: TinyModel):
    """Two prompts in one step, the second after a first chunk already in the cache."""
    runner = tiny.runner(block_size=4)
    p0, p1 = prompts([13, 21])
    first = [ScheduledRequest("b", p1[:8], 0, list(range(10, 16)), False, GREEDY, p1, [])]
    inputs = prepare_inputs(first, BlockTables(4), runner.device)
    tiny.loaded.model(
        inputs.input_ids, inputs.positions, inputs.meta, runner.kv_cache.layers, runner.attn
    )
    step = [
        ScheduledRequest("a", p0, 0, list(range(4)), True, GREEDY, p0, []),
        ScheduledRequest("b", p1[8:], 8, list(range(10, 16)), True, GREEDY, p1, []),
    ]
    inputs = prepare_inputs(step, BlockTables(4), runner.device)
    hidden = tiny.loaded.model(
        inputs.input_ids, inputs.positions, inputs.meta, runner.kv_cache.layers, runner.attn
    )
    logits = tiny.loaded.model.compute_logits(hidden)  # [13 + 13, vocab]
    expected = torch.cat(
        [tiny.hf(torch.tensor([p0])).logits[0], tiny.hf(torch.tensor([p1])).logits[0, 8:]]
    )
    scale = expected.abs().max().item()
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4 * scale)


# --- greedy parity through the runner ----------------------------------------------------


def test_single_request_matches_generate(tiny: TinyModel):
    seqs = greedy_seqs([11], max_tokens=12)
    assert RunnerLoop(tiny.runner()).run(seqs) == [tiny.generate(seqs[0].prompt, 12)]


def test_batched_requests_of_different_lengths(tiny: TinyModel):
    seqs = greedy_seqs([3, 17, 8, 30], max_tokens=10, seed=1)
    outputs = RunnerLoop(tiny.runner(block_size=8)).run(seqs)
    assert outputs == [tiny.generate(s.prompt, 10) for s in seqs]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_attention_backends_match_generate(tiny: TinyModel, backend: str):
    # "auto" picks "cpu" (the C++ kernels) on the CPU; the reference must agree too
    seqs = greedy_seqs([3, 17, 8, 30], max_tokens=10, seed=1)
    runner = tiny.runner(block_size=8, attention_backend=backend)
    assert runner.attn.name == backend
    # "cpu" runs the norms, RoPE and SwiGLU as C++ kernels too; "torch" is all reference
    ops = runner.model.layer_ops(runner.attn, torch.float32)
    assert (ops is not None) == (backend == "cpu")
    assert RunnerLoop(runner).run(seqs) == [tiny.generate(s.prompt, 10) for s in seqs]


@pytest.mark.parametrize("block_size,chunk_size", [(4, 5), (16, 7), (1, 3)])
def test_chunked_prefill_matches_generate(llama: TinyModel, block_size, chunk_size):
    seqs = greedy_seqs([23, 9, 31], max_tokens=8, seed=2)
    outputs = RunnerLoop(llama.runner(block_size=block_size), chunk_size=chunk_size).run(seqs)
    assert outputs == [llama.generate(s.prompt, 8) for s in seqs]


def test_chunked_prefill_all_architectures(tiny: TinyModel):
    seqs = greedy_seqs([19, 26], max_tokens=6, seed=3)
    outputs = RunnerLoop(tiny.runner(block_size=4), chunk_size=6).run(seqs)
    assert outputs == [tiny.generate(s.prompt, 6) for s in seqs]


def test_staggered_arrivals_mix_decodes_and_prefills(llama: TinyModel):
    """A request arriving while others decode: the step mixes decodes and a prefill, in
    the scheduler's order (prefill first here); the runner reorders them."""
    engine = RunnerLoop(llama.runner(block_size=4))
    late = greedy_seqs([14], max_tokens=6, seed=4)[0]
    late.request_id = "late"
    seqs = greedy_seqs([5, 12], max_tokens=10, seed=5)
    for _ in range(3):
        engine.step(seqs)
    engine.run([late, *seqs])
    assert [s.output for s in [late, *seqs]] == [
        llama.generate(s.prompt, s.max_tokens) for s in [late, *seqs]
    ]


def test_prefix_blocks_reused_from_the_cache(tiny: TinyModel):
    block_size = 4
    engine = RunnerLoop(tiny.runner(block_size=block_size))
    (shared,) = prompts([3 * block_size], seed=6)
    first = Seq("first", shared + [7, 8], max_tokens=4)
    engine.run([first])
    # later requests start with the first one's full blocks holding the shared prefix
    tails = prompts([5, 1], seed=7)
    later = [Seq(f"later{i}", shared + tail, max_tokens=6) for i, tail in enumerate(tails)]
    for s in later:
        s.block_table = first.block_table[:3]
        s.num_computed = 3 * block_size
    engine.run(later)
    assert [s.output for s in later] == [tiny.generate(s.prompt, 6) for s in later]
    assert first.output == tiny.generate(first.prompt, 4)


def test_recompute_after_preemption(tiny: TinyModel):
    engine = RunnerLoop(tiny.runner(block_size=4), chunk_size=6)
    victim, other = greedy_seqs([10, 15], max_tokens=12, seed=8)
    for _ in range(6):
        engine.step([victim, other])
    assert 0 < len(victim.output) < 12
    # preempted: blocks gone, everything so far becomes the prompt and is computed again
    generated = len(victim.output)
    victim.prompt, victim.output = victim.tokens, []
    victim.max_tokens -= generated
    victim.block_table, victim.num_computed = [], 0
    engine.run([victim, other])
    original_prompt = victim.prompt[: len(victim.prompt) - generated]
    assert victim.prompt[len(original_prompt) :] + victim.output == tiny.generate(
        original_prompt, 12
    )
    assert other.output == tiny.generate(other.prompt, 12)


# --- sampling through the runner ---------------------------------------------------------


def test_seeded_sampling_ignores_batch_mates(llama: TinyModel):
    params = SamplingParams(temperature=1.0, seed=1234)

    def sample(with_mates: bool) -> list[int]:
        seqs = [Seq("seeded", prompts([9], seed=9)[0], 12, params)]
        if with_mates:
            seqs += [
                Seq("mate1", prompts([20], seed=10)[0], 12, SamplingParams(temperature=1.0)),
                Seq("mate2", prompts([4], seed=11)[0], 12, SamplingParams(seed=99, top_p=0.8)),
            ]
        RunnerLoop(llama.runner(block_size=4, seed=5 if with_mates else 0), chunk_size=7).run(seqs)
        return seqs[0].output

    alone = sample(with_mates=False)
    assert sample(with_mates=True) == alone
    assert len(set(alone)) > 1  # actually sampled


def test_generators_dropped_for_finished_requests(llama: TinyModel):
    runner = llama.runner()
    seq = Seq("s", prompts([5])[0], 2, SamplingParams(seed=3))
    RunnerLoop(runner).run([seq])
    assert "s" in runner._generators
    runner.execute(SchedulerOutput(finished_ids=["s"]))
    assert "s" not in runner._generators


def test_logprobs_returned(llama: TinyModel):
    runner = llama.runner()
    (prompt,) = prompts([6])
    req = ScheduledRequest(
        "lp", prompt, 0, [0, 1], True, SamplingParams(temperature=0.0, logprobs=3), prompt, []
    )
    out = runner.execute(SchedulerOutput(scheduled=[req]))
    logprobs = out.logprobs["lp"]
    with torch.inference_mode():
        expected = torch.log_softmax(llama.hf(torch.tensor([prompt])).logits[0, -1], -1)
    assert out.sampled_token_ids["lp"] == int(expected.argmax())
    assert logprobs.logprob == pytest.approx(float(expected.max()), abs=1e-4)
    assert [t for t, _ in logprobs.top] == expected.topk(3).indices.tolist()


# --- KV cache sizing and the loader --------------------------------------------------------


def test_kv_cache_sized_from_memory_budget(llama: TinyModel):
    config = ModelConfig(model=llama.loaded.model_path, block_size=8, kv_cache_memory=1 << 20)
    runner = ModelRunner(llama.loaded, config)
    block_bytes = bytes_per_block(2, 8, 2, 16, torch.float32)
    assert runner.num_kv_blocks == (1 << 20) // block_bytes
    k_cache, v_cache = runner.kv_cache.layers[0]
    assert k_cache.shape == v_cache.shape == (runner.num_kv_blocks, 8, 2, 16)
    assert len(runner.kv_cache.layers) == 2


def test_an_unset_cpu_kv_budget_is_half_the_available_memory_shared_out(llama: TinyModel,
                                                                        monkeypatch):
    """No --kv-cache-memory: half of what the host has available once the weights are in,
    split among the engine cores (memory_share) and the tensor-parallel ranks; a set budget
    is kept as is."""
    monkeypatch.setattr(kv_cache, "available_memory", lambda: 12 << 20)
    assert kv_cache.cpu_kv_budget(None, 1.0, 1) == 6 << 20
    assert kv_cache.cpu_kv_budget(None, 0.5, 2) == 3 << 19
    assert kv_cache.cpu_kv_budget(1 << 20, 0.5, 2) == 1 << 20
    runner = ModelRunner(llama.loaded, ModelConfig(model=llama.loaded.model_path, block_size=8,
                                                   memory_share=0.5))
    assert runner.num_kv_blocks == (3 << 20) // bytes_per_block(2, 8, 2, 16, torch.float32)
    assert 0 < kv_cache.available_memory() <= os.sysconf("SC_PAGE_SIZE") * os.sysconf(
        "SC_PHYS_PAGES")


def test_the_cpu_kv_cache_takes_memory_as_its_blocks_are_written():
    """Zeroed blocks, but resident only once written: a 512 MiB cache grows the process by
    the blocks written, not by 512 MiB (the pages of an anonymous mapping)."""
    before = read_rss_kib(os.getpid())
    cache = allocate_kv_cache(4, 1024, 16, 8, 128, torch.float32, torch.device("cpu"))
    k_cache, v_cache = cache.layers[3]
    assert k_cache.shape == (1024, 16, 8, 128) and k_cache.is_contiguous()
    v_cache[7].fill_(1.0)
    assert float(v_cache[6:9].sum()) == 16 * 8 * 128 and float(k_cache[1023].abs().sum()) == 0
    assert read_rss_kib(os.getpid()) - before < 64 * 1024  # KiB: a block is 64 KiB

def test_loaded_model_fields(llama: TinyModel):
    loaded = llama.loaded
    assert loaded.eos_token_ids == frozenset({2})
    assert loaded.max_model_len == 256
    assert loaded.dtype == torch.float32 and loaded.device.type == "cpu"
    assert loaded.served_model_name == Path(loaded.model_path).name
    # the default model's tokenizer, its chat template included
    default = default_tokenizer()
    assert loaded.tokenizer("Hello, wörld!").input_ids == default("Hello, wörld!").input_ids
    assert loaded.tokenizer.chat_template == default.chat_template is not None
    capped = load_model(ModelConfig(model=loaded.model_path, max_model_len=100))
    assert capped.max_model_len == 100


def test_loader_errors(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="never downloads"):
        load_model(ModelConfig(model="HuggingFaceTB/SmolLM2-135M-Instruct"))
    with pytest.raises(ValueError, match="no config.json"):
        load_model(ModelConfig(model=str(tmp_path)))
    not_a_model = tmp_path / "weights.bin"
    not_a_model.write_bytes(b"\0")
    with pytest.raises(ValueError, match="not a .gguf"):
        load_model(ModelConfig(model=str(not_a_model)))
    gpt2 = tmp_path / "gpt2"
    AutoModelForCausalLM.from_config(
        GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB)
    ).save_pretrained(gpt2)
    listed = r"architecture 'GPT2LMHeadModel' \(supported: (\w+, )*LlamaForCausalLM"
    with pytest.raises(ValueError, match=listed):
        load_model(ModelConfig(model=str(gpt2)))


def test_a_full_disk_while_a_gguf_metadata_is_kept_is_one_clear_error(tmp_path, monkeypatch):
    """A ValueError (what `serve` reports as one line, exit 1) that says what to do, and no
    folder left that a later start could take for a finished one."""
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")

    def full_disk(_: Path, out: Path) -> None:
        (out / "config.json").write_text("{}")  # written before the disk filled up
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(gguf_file, "_write_metadata", full_disk)
    with pytest.raises(ValueError, match="No space left on device.*PAGEDSERVE_CACHE"):
        gguf_file.metadata_folder(gguf)
    assert list((tmp_path / "cache").iterdir()) == []
    monkeypatch.setattr(gguf_file, "_write_metadata",
                        lambda _, out: (out / "config.json").write_text("{}"))
    folder = gguf_file.metadata_folder(gguf)  # the next start writes it again
    assert (folder / "config.json").read_text() == "{}"


class InProcessPool:
    """concurrent.futures' pool API, each call run at once in this process."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __enter__(self) -> InProcessPool:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def submit(self, fn: Callable[..., object], *args: object
               ) -> concurrent.futures.Future[object]:
        future: concurrent.futures.Future[object] = concurrent.futures.Future()
        try:
            future.set_result(fn(*args))
        except Exception as e:
            future.set_exception(e)
        return future


def test_a_corrupt_gguf_at_start_exits_1_naming_it(tmp_path, monkeypatch, caplog):
    import logging

    from server.cli import main

    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")  # the magic, then nothing: read in the metadata child
    with caplog.at_level(logging.INFO):
        assert main(["serve", "--model", str(gguf), "--port", "0", "--device", "cpu"]) == 1
    (error,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert f"cannot read GGUF file {gguf}" in error.getMessage() and error.exc_info is None


def test_a_full_disk_at_start_exits_1_with_one_line(tmp_path, monkeypatch, caplog):
    import logging

    from server.cli import main

    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")

    def full_disk(_: Path, out: Path) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(gguf_file, "_write_metadata", full_disk)
    # the metadata child's work in this process, where the patch holds
    monkeypatch.setattr(model_source, "ProcessPoolExecutor", InProcessPool)
    with caplog.at_level(logging.INFO):
        assert main(["serve", "--model", str(gguf), "--port", "0", "--device", "cpu"]) == 1
    (error,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "No space left on device" in error.getMessage() and error.exc_info is None


def test_rope_from_legacy_config_attributes():
    """Configs from before transformers 5 carry rope_theta and rope_scaling instead."""
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    legacy = SimpleNamespace(rope_theta=500000.0, rope_scaling=scaling)
    current = SimpleNamespace(rope_parameters={**scaling, "rope_theta": 500000.0})
    assert torch.equal(rope_inv_freq(legacy, 16), rope_inv_freq(current, 16))
    assert not torch.equal(rope_inv_freq(legacy, 16), rope_inv_freq(SimpleNamespace(), 16))
    with pytest.raises(ValueError, match="unsupported RoPE type 'dynamic'"):
        rope_inv_freq(
            SimpleNamespace(rope_parameters={"rope_type": "dynamic", "rope_theta": 1.0}), 8
        )


@torch.inference_mode()
def test_longrope_takes_the_long_factors_for_a_context_past_the_original(tmp_path: Path):
    """Phi-3's LongRoPE served with a context past `original_max_position_embeddings`: the
    long factors and the stretch's attention factor, Hugging Face's rotation of a prompt
    that long; within it, the short factors."""
    hf = make_model_folder(tmp_path, phi3_config(max_position_embeddings=256,
                                                 original_max_position_embeddings=16))
    for max_model_len, length in [(256, 40), (16, 12)]:
        loaded = load_model(ModelConfig(model=str(tmp_path), max_model_len=max_model_len,
                                        num_kv_blocks=1))
        runner = TinyModel(hf, loaded).runner(block_size=4)
        (prompt,) = prompts([length], seed=12)
        step = [ScheduledRequest("a", prompt, 0, list(range(10)), True, GREEDY, prompt, [])]
        inputs = prepare_inputs(step, BlockTables(4), runner.device)
        hidden = loaded.model(
            inputs.input_ids, inputs.positions, inputs.meta, runner.kv_cache.layers, runner.attn
        )
        expected = hf(torch.tensor([prompt])).logits[0]
        scale = expected.abs().max().item()
        torch.testing.assert_close(
            loaded.model.compute_logits(hidden), expected, rtol=1e-4, atol=1e-4 * scale
        )


@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16"])
def test_two_byte_kv_cache(llama: TinyModel, kv_dtype: str):
    # twice the blocks in the same memory; both backends read the narrow cache alike
    config = dict(model=llama.loaded.model_path, block_size=8, kv_cache_memory=1 << 20)
    wide = ModelRunner(llama.loaded, ModelConfig(**config))
    narrow = {
        backend: ModelRunner(llama.loaded, ModelConfig(
            **config, kv_cache_dtype=kv_dtype, attention_backend=backend))
        for backend in ("torch", "cpu")
    }
    assert narrow["cpu"].num_kv_blocks == 2 * wide.num_kv_blocks
    assert narrow["cpu"].kv_cache.layers[0][0].dtype == getattr(torch, kv_dtype)
    outputs = [RunnerLoop(runner).run(greedy_seqs([5, 21, 9], max_tokens=8, seed=3))
               for runner in narrow.values()]
    assert outputs[0] == outputs[1]
    assert [len(o) for o in outputs[0]] == [8, 8, 8]


def test_two_byte_kv_cache_is_for_float32_models_on_the_cpu():
    assert kv_cache_dtype("auto", torch.bfloat16, torch.device("cpu")) == torch.bfloat16
    assert kv_cache_dtype("float16", torch.float32, torch.device("cpu")) == torch.float16
    with pytest.raises(ValueError, match="float32 model on the CPU"):
        kv_cache_dtype("float16", torch.bfloat16, torch.device("cpu"))
    with pytest.raises(ValueError, match="float32 model on the CPU"):
        kv_cache_dtype("float16", torch.float32, torch.device("cuda"))
    with pytest.raises(ValueError, match="unknown KV cache dtype"):
        ModelConfig(kv_cache_dtype="int8")


def test_rope_of_a_steps_positions_is_a_full_tables_rows() -> None:
    """The cos and sin computed for a step's positions (no table of every position kept)
    are, bit for bit, the rows of the table of every position: the values the parity
    tests hold against Hugging Face, whatever the step's size."""
    inv_freq = rope_inv_freq(SimpleNamespace(rope_parameters={"rope_theta": 1e6}), 256)
    table = torch.outer(torch.arange(32768, dtype=torch.float32), inv_freq)
    rope = RopeAngles(inv_freq, 1.0, torch.float32)
    for positions in (torch.arange(32768), torch.tensor([7]), torch.randint(0, 32768, (19,))):
        cos, sin = rope(positions)
        assert torch.equal(cos, table.cos()[positions]) and torch.equal(sin, table.sin()[positions])
