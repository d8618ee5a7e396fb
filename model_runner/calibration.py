"""The range of every projection's input on calibration tokens, for int8 weights.

`--weight-dtype int8` smooths each projection's input channels by how wide they run
(cpu_linear.Int8Linear); those widths are measured here, once at load time, by one
float32 prefill of fixed random tokens (2 x 128, ~0.5 s for the default model) through
the torch reference attention. Random tokens serve: which channels run wide comes mostly
from the weights (the norms' scales, the residual stream's few outsize dimensions), and on
English text the int8 model calibrated on them keeps 92.6% of float32's next-token
choices (bench/quality.py; 4 x 128 tokens measured the same).
"""

from __future__ import annotations

import torch

from model_runner.attention import TORCH_BACKEND
from model_runner.attention_metadata import AttentionMetadata
from model_runner.kv_cache import allocate_kv_cache
from model_runner.llama import Linear, LlamaForCausalLM

CALIBRATION_SEQS, CALIBRATION_LEN, CALIBRATION_SEED = 2, 128, 0
LM_HEAD = "lm_head"  # the key of the LM head's input (the final norm's output)


@torch.inference_mode()
def input_amax(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """Per input channel, the largest magnitude each projection's input takes: float32
    [in] by module name (as `model.named_modules` spells it), and the LM head's under
    LM_HEAD. The model must still hold its float32 weights (before `pack_weights`)."""
    seen: dict[str, torch.Tensor] = {}

    def record(name: str, x: torch.Tensor) -> None:
        amax = x.detach().abs().reshape(-1, x.shape[-1]).amax(dim=0).float()
        seen[name] = amax if name not in seen else torch.maximum(seen[name], amax)

    hooks = [
        module.register_forward_pre_hook(lambda _, args, name=name: record(name, args[0]))
        for name, module in model.named_modules()
        if isinstance(module, Linear)
    ]
    try:
        generator = torch.Generator().manual_seed(CALIBRATION_SEED)
        shape = (CALIBRATION_SEQS, CALIBRATION_LEN)
        tokens = torch.randint(0, model.config.vocab_size, shape, generator=generator)
        hidden = prefill(model, tokens)
    finally:
        for hook in hooks:
            hook.remove()
    record(LM_HEAD, hidden)
    return seen


def prefill(model: LlamaForCausalLM, token_ids: torch.Tensor) -> torch.Tensor:
    """One forward over the sequences of token_ids [seqs, len] (each from position 0,
    through the torch reference attention): the final hidden states [seqs * len, H]."""
    device = model.embed_tokens.weight.device
    num_seqs, seq_len = token_ids.shape
    block_size = 16
    blocks_per_seq = -(-seq_len // block_size)
    # sequence i owns blocks i * blocks_per_seq ..; its slots are contiguous
    block_tables = torch.arange(num_seqs * blocks_per_seq, dtype=torch.int32)
    positions = torch.arange(seq_len).repeat(num_seqs)
    slot_mapping = torch.arange(num_seqs).repeat_interleave(seq_len) * (
        blocks_per_seq * block_size
    ) + positions
    meta = AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        query_start_loc=torch.arange(0, token_ids.numel() + 1, seq_len, dtype=torch.int32)
        .to(device),
        context_lens=torch.full((num_seqs,), seq_len, dtype=torch.int32).to(device),
        block_tables=block_tables.view(num_seqs, blocks_per_seq).to(device),
        max_query_len=seq_len,
        max_context_len=seq_len,
    )
    kv_cache = allocate_kv_cache(
        model.num_layers, num_seqs * blocks_per_seq, block_size,
        model.num_kv_heads, model.head_dim, model.embed_tokens.weight.dtype, device,
    )
    return model(
        token_ids.reshape(-1).to(device), positions.to(device), meta, kv_cache.layers,
        TORCH_BACKEND,
    )
