"""The sharded layers against the whole ones, on 2 gloo ranks: this process is rank 0, a
subprocess running `check_layers` too is rank 1.

A tiny Llama with a tied, odd-sized vocabulary, one KV head for two ranks and o/down
biases: the vocab-parallel embedding and LM head, the column/row-parallel MLP and
attention and the whole forward agree with the unsharded model in float32, and in the
float16 and int8 CPU weight formats (int8: as close to float32 as the unsharded int8).
The same for OLMo 2 (its q/k norm over the whole, sharded, projection) and Phi-3 (its
fused checkpoint weights read by rows).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import AutoConfig, LlamaConfig, Olmo2Config

from model_runner.attention.selection import select_attention_backend
from model_runner.block_tables import BlockTables
from model_runner.distributed.tensor_parallel import (
    HOST,
    TIMEOUT,
    TensorParallel,
    init_tensor_parallel,
    open_store,
)
from model_runner.kernels.int8_linear import Int8Linear
from model_runner.kv_cache import allocate_kv_cache
from model_runner.loader import _iter_safetensors
from model_runner.models.llama import LlamaForCausalLM
from model_runner.models.registry import model_class
from model_runner.runner import prepare_inputs
from scheduler.output import ScheduledRequest
from scheduler.sampling_params import SamplingParams
from tests.support.model_helpers import TINY, VOCAB, make_model_folder, phi3_config

REPO = Path(__file__).resolve().parents[2]
NUM_TOKENS = 7


def build(folder: Path, tp: TensorParallel | None, weight_dtype: str | None) -> LlamaForCausalLM:
    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = model_class(config)(config, tp)
    model = model.to_empty(device="cpu")
    model.load_weights(_iter_safetensors(folder))
    model.init_rope(64)
    if weight_dtype is not None:
        model.pack_weights(weight_dtype)
    return model.eval()


def error(x: torch.Tensor, reference: torch.Tensor) -> float:
    return ((x - reference).abs().max() / reference.abs().max()).item()


@torch.inference_mode()
def check_layers(tp: TensorParallel, folder: Path) -> None:
    """On every rank (the collectives meet); rank 0 compares."""
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(folder)
    ids = torch.randint(0, config.vocab_size, (NUM_TOKENS,))
    ids[:2] = torch.tensor([0, config.vocab_size - 1])  # both ends of the vocabulary
    x = torch.randn(NUM_TOKENS, config.hidden_size)
    reference = build(folder, None, None)
    outputs = {}
    for weight_dtype in ("auto", "float16", "int8"):
        full, shard = build(folder, None, weight_dtype), build(folder, tp, weight_dtype)
        if weight_dtype == "int8":  # every rank rotates its own input columns, in blocks
            for module in shard.modules():
                packed = getattr(module, "packed", None)
                if isinstance(packed, Int8Linear):
                    assert module.in_features % packed.block == 0
        pairs = {
            "embed": (shard.embed(ids), full.embed(ids)),
            "mlp": (shard.layers[0].mlp(x), full.layers[0].mlp(x)),
            "attention": (attention(shard, x), attention(full, x)),
            "forward": (forward(shard, ids), forward(full, ids)),
            "logits": (shard.compute_logits(x), full.compute_logits(x)),
        }
        outputs[weight_dtype] = pairs
    if tp.rank != 0:
        return
    for weight_dtype, pairs in outputs.items():
        for name, (sharded, whole) in pairs.items():
            assert sharded.shape == whole.shape, (weight_dtype, name)
            if weight_dtype == "int8" and name != "embed":  # re-quantized per shard
                exact = {"mlp": reference.layers[0].mlp(x), "attention": attention(reference, x),
                         "forward": forward(reference, ids),
                         "logits": reference.compute_logits(x)}[name]
                assert error(sharded, exact) <= 2 * error(whole, exact) + 1e-3, name
            else:
                torch.testing.assert_close(sharded, whole, rtol=1e-4, atol=1e-5 * whole.abs().max())


def attention(model: LlamaForCausalLM, x: torch.Tensor) -> torch.Tensor:
    """Layer 0's attention over a fresh cache: one prefill of the rows of x."""
    meta, cache, attn, positions = _prefill(model)
    assert model.rope is not None
    cos, sin = model.rope(positions)
    return model.layers[0].self_attn(x, cos, sin, meta, cache.layers[0], attn)


def forward(model: LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    meta, cache, attn, positions = _prefill(model)
    return model(ids, positions, meta, cache.layers, attn)


def _prefill(model: LlamaForCausalLM):
    request = ScheduledRequest("r", [0] * NUM_TOKENS, 0, [0, 1], True, SamplingParams(), [], [])
    inputs = prepare_inputs([request], BlockTables(4), torch.device("cpu"))
    cache = allocate_kv_cache(model.num_layers, 2, 4, model.num_kv_heads, model.head_dim,
                              torch.float32, torch.device("cpu"))
    attn = select_attention_backend("torch", torch.device("cpu"), model.head_dim)
    return inputs.meta, cache, attn, inputs.positions


def rank_main(port: int, folder: str) -> None:
    """Rank 1's process."""
    torch.set_num_threads(1)
    store = dist.TCPStore(HOST, port, 2, is_master=False, timeout=TIMEOUT)
    tp = init_tensor_parallel(1, 2, store, torch.device("cpu"))
    check_layers(tp, Path(folder))
    tp.close()


CONFIGS = {
    "llama": lambda: LlamaConfig(**{**TINY, "vocab_size": VOCAB + 1, "num_key_value_heads": 1},
                                 tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
    # q/k norm over the whole projection: its sums of squares all-reduced (the one KV
    # head replicated on both ranks counted once)
    "olmo2": lambda: Olmo2Config(**{**TINY, "num_key_value_heads": 1}),
    # fused checkpoint weights: each rank reads its rows of qkv_proj and gate_up_proj
    "phi3": lambda: phi3_config(64, 64),
}


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_sharded_layers_match_the_whole_ones(tmp_path: Path, arch: str):
    make_model_folder(tmp_path, CONFIGS[arch]())
    store = open_store(2)
    entry = (f"from {__name__} import rank_main; "
             f"rank_main({store.port}, {str(tmp_path)!r})")
    rank_1 = subprocess.Popen([sys.executable, "-c", entry], cwd=REPO)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tp = init_tensor_parallel(0, 2, store, torch.device("cpu"))
        try:
            check_layers(tp, tmp_path)
        finally:
            tp.close()
        assert rank_1.wait(60) == 0
    finally:
        torch.set_num_threads(threads)
        if rank_1.poll() is None:
            rank_1.kill()
            rank_1.wait()
