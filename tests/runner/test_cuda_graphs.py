"""The decode graph runner (model_runner/cuda_graphs.py) against the plain eager path.

On the CPU the graph runner runs eagerly on its static buffers, which tests the bucketing,
the padding rows and the staging of inputs; tests marked `gpu` replay real CUDA graphs.
Models and the engine loop come from test_model_runner.py.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

from model_runner.attention.backend import AttentionBackend
from model_runner.attention.torch_backend import write_kv_cache
from model_runner.config import ModelConfig
from model_runner.cuda_graphs import DecodeGraphRunner, graph_batch_sizes
from model_runner.loader import load_model, resolve_dtype
from model_runner.runner import ModelRunner
from scheduler.output import ScheduledRequest
from tests.support.model_helpers import (
    CONFIGS,
    FAMILY_CONFIGS,
    GREEDY,
    RunnerLoop,
    Seq,
    TinyModel,
    greedy_seqs,
    make_model_folder,
)
from tests.support.triton_interpreter import interpreted, use_interpreter

MAX_NUM_SEQS = 32
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
use_interpreter()  # before triton is first imported


class CountingGraphRunner(DecodeGraphRunner):
    """Records the bucket of every step it runs."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.buckets: list[int] = []

    def forward(self, requests, block_tables, kv_caches, placeholders=None):
        self.buckets.append(self.bucket(len(requests)))
        return super().forward(requests, block_tables, kv_caches, placeholders)


def attach_graphs(
    runner: ModelRunner,
    max_num_seqs: int = MAX_NUM_SEQS,
    attn: AttentionBackend | None = None,
) -> CountingGraphRunner:
    """Give `runner` an eager-mode graph runner (what a CUDA runner has, without graphs)."""
    graphs = CountingGraphRunner(
        runner.model,
        attn or runner.attn,
        max_num_seqs=max_num_seqs,
        max_model_len=runner.max_model_len,
        block_size=runner.block_size,
        use_cuda_graphs=False,
    )
    runner.decode_graphs = graphs
    return graphs


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> TinyModel:
    folder = tmp_path_factory.mktemp("llama")
    hf_model = make_model_folder(folder, CONFIGS["llama3"]())
    # NOTE: float32 on any device (bfloat16 is the CUDA default): these tests compare
    # tokens and logits exactly.
    config = ModelConfig(model=str(folder), dtype="float32", num_kv_blocks=1)
    return TinyModel(hf_model, load_model(config))


def record_logits_of(model: torch.nn.Module, monkeypatch) -> list[torch.Tensor]:
    """Every compute_logits output of `model` (shared by the runners), in call order."""
    recorded: list[torch.Tensor] = []
    compute_logits = model.compute_logits

    def recording(hidden: torch.Tensor) -> torch.Tensor:
        logits = compute_logits(hidden)
        recorded.append(logits.clone())  # the sampler modifies its logits in place
        return logits

    monkeypatch.setattr(model, "compute_logits", recording)
    return recorded


@pytest.fixture
def record_logits(llama: TinyModel, monkeypatch) -> list[torch.Tensor]:
    return record_logits_of(llama.loaded.model, monkeypatch)


# --- buckets ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "max_num_seqs,expected",
    [
        (1, [1]),
        (3, [1, 2, 3]),
        (8, [1, 2, 4, 8]),
        (20, [1, 2, 4, 8, 16, 20]),
        (32, [1, 2, 4, 8, 16, 32]),
        (256, [1, 2, 4, 8, *range(16, 257, 16)]),
    ],
)
def test_batch_sizes(max_num_seqs, expected):
    assert graph_batch_sizes(max_num_seqs) == expected


def test_bucket_is_the_smallest_that_fits(llama: TinyModel):
    graphs = attach_graphs(llama.runner())
    assert [graphs.bucket(b) for b in (1, 2, 3, 5, 8, 9, 17, 32)] == [1, 2, 4, 8, 8, 16, 32, 32]
    with pytest.raises(ValueError, match="no decode bucket"):
        graphs.bucket(33)
    with pytest.raises(ValueError):
        graph_batch_sizes(0)


@pytest.mark.parametrize("family", list(FAMILY_CONFIGS))
def test_every_family_decodes_on_the_static_buffers(tmp_path, family: str):
    """Each family's decode steps through the graph runner (padded 3 -> 4): Hugging Face's
    greedy tokens."""
    hf = make_model_folder(tmp_path, FAMILY_CONFIGS[family]())
    config = ModelConfig(model=str(tmp_path), dtype="float32", num_kv_blocks=1)
    tiny = TinyModel(hf, load_model(config))
    runner = tiny.runner(block_size=4)
    graphs = attach_graphs(runner)
    seqs = greedy_seqs([5, 12, 3], max_tokens=6, seed=7)
    assert RunnerLoop(runner).run(seqs) == [tiny.generate(s.prompt, 6) for s in seqs]
    assert graphs.buckets == [4] * 5  # every decode step, none of the prefill


# --- same tokens and logits as the eager path -----------------------------------------------


@pytest.mark.parametrize("num_seqs", [3, 5, 17])
def test_tokens_and_logits_match_eager(llama: TinyModel, record_logits, num_seqs):
    """Batch sizes between buckets: the step is padded (3 -> 4, 5 -> 8, 17 -> 32)."""
    lengths = [3 + (7 * i) % 29 for i in range(num_seqs)]
    eager_seqs = greedy_seqs(lengths, max_tokens=5, seed=num_seqs)
    graph_seqs = greedy_seqs(lengths, max_tokens=5, seed=num_seqs)
    eager = RunnerLoop(llama.runner(block_size=4))
    graphed_runner = llama.runner(block_size=4)
    graphs = attach_graphs(graphed_runner)
    graphed = RunnerLoop(graphed_runner)
    for _ in range(5):
        eager.step(eager_seqs)
        (eager_logits,) = record_logits[-1:]
        graphed.step(graph_seqs)
        (graph_logits,) = record_logits[-1:]
        torch.testing.assert_close(graph_logits, eager_logits, rtol=1e-5, atol=1e-5)
        assert [s.output for s in graph_seqs] == [s.output for s in eager_seqs]
    # the prefill step ran eagerly, the four decode steps through the graph runner
    assert graphs.buckets == [graphs.bucket(num_seqs)] * 4
    assert [s.output for s in graph_seqs[:2]] == [
        llama.generate(s.prompt, 5) for s in graph_seqs[:2]
    ]


def test_mixed_and_oversized_steps_run_eagerly(llama: TinyModel):
    runner = llama.runner(block_size=4)
    graphs = attach_graphs(runner, max_num_seqs=4)
    engine = RunnerLoop(runner)
    seqs = greedy_seqs([5, 9, 4, 7, 12], max_tokens=4, seed=3)
    late = greedy_seqs([6], max_tokens=3, seed=4)[0]
    late.request_id = "late"
    engine.step(seqs[:3])  # prefill: eager
    engine.step(seqs[:3])  # decode of 3: bucket 4
    engine.step([*seqs[:3], late])  # mixed: eager
    engine.run([*seqs[:3], late])  # decodes of 4, then of `late` alone
    assert graphs.buckets == [4, 4, 1]
    engine.run(seqs[3:])  # prefill, then decodes of 2
    assert graphs.buckets == [4, 4, 1, 2, 2, 2]
    big = greedy_seqs([3] * 5, max_tokens=3, seed=5)
    RunnerLoop(runner).run(big)  # 5 decodes > max_num_seqs 4: eager
    assert graphs.buckets == [4, 4, 1, 2, 2, 2]
    for s in [*seqs, late, *big]:
        assert s.output == llama.generate(s.prompt, s.max_tokens)


def test_sampling_subset_of_rows(llama: TinyModel):
    """A one-token chunk that does not reach the end of the prompt does not sample."""
    runner = llama.runner(block_size=4)
    graphs = attach_graphs(runner)
    a, b = greedy_seqs([6, 3], max_tokens=3, seed=6)
    engine = RunnerLoop(runner, chunk_size=1)
    engine.run([a, b])
    assert graphs.buckets == [2] * 5 + [1] * 3  # all decode-shaped; b samples alone at 3
    assert [a.output, b.output] == [llama.generate(s.prompt, 3) for s in (a, b)]


# --- padding rows ---------------------------------------------------------------------------

SENTINEL = 123.0


@pytest.mark.parametrize("num_seqs", [3, 5])
def test_padding_rows_never_write_the_kv_cache(llama: TinyModel, num_seqs):
    runner = llama.runner(block_size=4, num_kv_blocks=64)
    graphs = attach_graphs(runner)
    for k_cache, v_cache in runner.kv_cache.layers:
        k_cache.fill_(SENTINEL)
        v_cache.fill_(SENTINEL)
    engine = RunnerLoop(runner)
    engine.next_block = itertools.count(1)  # block 0 belongs to nobody: the padding rows'
    seqs = greedy_seqs([5 + 3 * i for i in range(num_seqs)], max_tokens=4, seed=7)
    engine.run(seqs)
    assert graphs.buckets == [graphs.bucket(num_seqs)] * 3
    assert torch.isfinite(graphs.hidden[: graphs.bucket(num_seqs)]).all()

    written = torch.zeros(64 * 4, dtype=torch.bool)
    for s in seqs:
        for pos in range(s.num_computed):
            written[s.block_table[pos // 4] * 4 + pos % 4] = True
    for k_cache, v_cache in runner.kv_cache.layers:
        for cache in (k_cache, v_cache):
            flat = cache.view(64 * 4, -1)
            assert (flat[~written] == SENTINEL).all()  # block 0 included
            assert (flat[written] != SENTINEL).all()


def test_torch_write_kv_cache_skips_negative_slots():
    k_cache = torch.full((3, 2, 1, 4), SENTINEL)
    v_cache = torch.full((3, 2, 1, 4), SENTINEL)
    key = torch.arange(12.0).view(3, 1, 4)
    write_kv_cache(key, -key, k_cache, v_cache, torch.tensor([5, -1, 0]))
    flat_k, flat_v = k_cache.view(6, 4), v_cache.view(6, 4)
    assert torch.equal(flat_k[[5, 0]], key[[0, 2], 0])
    assert torch.equal(flat_v[[5, 0]], -key[[0, 2], 0])
    assert (flat_k[1:5] == SENTINEL).all() and (flat_v[1:5] == SENTINEL).all()


def test_short_block_table_is_an_error(llama: TinyModel):
    runner = llama.runner(block_size=4)
    graphs = attach_graphs(runner)
    ok = ScheduledRequest("ok", [5], 3, [0], True, GREEDY, [1, 2, 3], [])
    short = ScheduledRequest("short", [5], 4, [1], True, GREEDY, [1, 2, 3, 4], [])
    assert graphs.can_run([ok, short])
    with pytest.raises(ValueError, match="short: 1 blocks cannot hold 5 tokens"):
        graphs.forward([ok, short], runner.block_tables, runner.kv_cache.layers)


# --- Triton kernels under the graph runner ---------------------------------------------------


def triton_attention_module():
    """model_runner.kernels.triton_attention, under Triton's interpreter without CUDA."""
    pytest.importorskip("triton", reason="triton is not installed")
    from model_runner.kernels import triton_attention as ta
    from model_runner.kernels import triton_attention_kernels

    if not CUDA:
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(tl.cdiv, InterpretedFunction):
            pytest.skip("triton was imported before TRITON_INTERPRET was set")
    interpreted(triton_attention_kernels, "decode_kernel")  # `ta` reads them at each call
    return ta


def test_triton_kernels_with_fixed_splits_on_padded_batches(llama: TinyModel, record_logits):
    """What a captured graph runs: Triton's KV write skipping the padding rows, and the
    decode kernel with a split count fixed whatever the contexts (empty splits)."""
    ta = triton_attention_module()
    tiles = ta.TileConfig(prefill_block_m=16, prefill_block_n=16, decode_block_n=16,
                          num_splits=4)
    backend = AttentionBackend(
        "triton",
        ta.write_kv_cache,
        functools.partial(ta.paged_attention_with_config, config=tiles),
    )
    eager_seqs = greedy_seqs([4, 21, 9], max_tokens=3, seed=8)
    graph_seqs = greedy_seqs([4, 21, 9], max_tokens=3, seed=8)
    eager = RunnerLoop(llama.runner(block_size=4))
    graphed_runner = llama.runner(block_size=4)
    graphs = attach_graphs(graphed_runner, attn=backend)
    graphed = RunnerLoop(graphed_runner)
    for _ in range(3):
        eager.step(eager_seqs)
        graphed.step(graph_seqs)
        eager_logits, graph_logits = record_logits[-2:]
        torch.testing.assert_close(graph_logits, eager_logits, rtol=1e-4, atol=1e-4)
    assert graphs.buckets == [4, 4]
    assert [s.output for s in graph_seqs] == [s.output for s in eager_seqs]


# --- CUDA ------------------------------------------------------------------------------------


def test_bfloat16_is_the_cuda_default():
    assert resolve_dtype("auto", torch.device("cuda")) is torch.bfloat16
    assert resolve_dtype("auto", torch.device("cpu")) is torch.float32


class CudaTinyModel(TinyModel):
    def generate(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        ids = torch.tensor([prompt], device="cuda")
        out = self.hf.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
        return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def cuda_llama(tmp_path_factory) -> TinyModel:
    """A tiny Qwen3 whose long max_model_len makes the graphs' Triton decode use many
    splits (up to 16), most of them empty at these short contexts."""
    folder = tmp_path_factory.mktemp("cuda_llama")
    hf_config = CONFIGS["qwen3"]()
    hf_config.max_position_embeddings = 4096
    hf_model = make_model_folder(folder, hf_config).to("cuda")
    config = ModelConfig(model=str(folder), device="cuda", dtype="float32", num_kv_blocks=1)
    return CudaTinyModel(hf_model, load_model(config))


def cuda_runner(tiny: TinyModel, enforce_eager: bool) -> ModelRunner:
    config = ModelConfig(
        model=tiny.loaded.model_path,
        device="cuda",
        dtype="float32",
        block_size=4,
        num_kv_blocks=512,
        max_num_seqs=MAX_NUM_SEQS,
        attention_backend="triton",
        enforce_eager=enforce_eager,
    )
    return ModelRunner(tiny.loaded, config)


@pytest.mark.gpu
@needs_cuda
def test_graphs_captured_for_every_bucket(cuda_llama: TinyModel):
    runner = cuda_runner(cuda_llama, enforce_eager=False)
    assert runner.decode_graphs is not None and runner.decode_graphs.use_cuda_graphs
    assert sorted(runner.decode_graphs._graphs) == graph_batch_sizes(MAX_NUM_SEQS)
    assert cuda_runner(cuda_llama, enforce_eager=True).decode_graphs is None
    torch_config = ModelConfig(model=cuda_llama.loaded.model_path, device="cuda",
                               dtype="float32", num_kv_blocks=64, attention_backend="torch")
    assert ModelRunner(cuda_llama.loaded, torch_config).decode_graphs is None


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_seqs", [1, 3, 17, 32])
def test_graph_replay_matches_eager_decode(cuda_llama: TinyModel, monkeypatch, num_seqs):
    recorded = record_logits_of(cuda_llama.loaded.model, monkeypatch)
    lengths = [2 + (11 * i) % 37 for i in range(num_seqs)]
    eager_seqs = greedy_seqs(lengths, max_tokens=6, seed=num_seqs)
    graph_seqs = greedy_seqs(lengths, max_tokens=6, seed=num_seqs)
    eager = RunnerLoop(cuda_runner(cuda_llama, enforce_eager=True))
    graphed = RunnerLoop(cuda_runner(cuda_llama, enforce_eager=False))
    for _ in range(6):
        eager.step(eager_seqs)
        graphed.step(graph_seqs)
        eager_logits, graph_logits = recorded[-2:]
        scale = eager_logits.abs().max().item()
        torch.testing.assert_close(graph_logits, eager_logits, rtol=1e-4, atol=1e-4 * scale)
    assert [s.output for s in graph_seqs] == [s.output for s in eager_seqs]
    assert [s.output for s in graph_seqs[:2]] == [
        cuda_llama.generate(s.prompt, 6) for s in graph_seqs[:2]
    ]


@pytest.mark.gpu
@needs_cuda
def test_graph_replay_padding_rows_write_nothing(cuda_llama: TinyModel):
    runner = cuda_runner(cuda_llama, enforce_eager=False)
    for k_cache, v_cache in runner.kv_cache.layers:
        k_cache.fill_(SENTINEL)
        v_cache.fill_(SENTINEL)
    engine = RunnerLoop(runner)
    engine.next_block = itertools.count(1)
    seqs = [Seq(f"s{i}", [3 + i] * (5 + i), 4) for i in range(5)]  # bucket 8
    engine.run(seqs)
    num_slots = 512 * 4
    written = torch.zeros(num_slots, dtype=torch.bool, device="cuda")
    for s in seqs:
        for pos in range(s.num_computed):
            written[s.block_table[pos // 4] * 4 + pos % 4] = True
    for k_cache, v_cache in runner.kv_cache.layers:
        for cache in (k_cache, v_cache):
            flat = cache.view(num_slots, -1)
            assert (flat[~written] == SENTINEL).all()
            assert (flat[written] != SENTINEL).all()
