"""How far a lossy weight dtype moves the model: teacher-forced, on fixed English text.

Greedy agreement on random-token prompts says how soon two runs part ways, and after the
first differing token every later one differs too; it cannot tell a slightly noisier
model from a broken one. Here both models read the same text, and at every position we
compare their next-token choice (top-1 agreement) and their loss on the true next token
(mean negative log-likelihood; perplexity is its exp). The text is the docstrings of a
few standard-library modules: fixed for a Python version, prose and code, no download.
"""

from __future__ import annotations

import argparse
import collections
import email
import json
import logging
import math
import typing
import unittest
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from model_runner.attention import torch_backend
from model_runner.block_tables import BlockTables
from model_runner.kv_cache import allocate_kv_cache
from model_runner.loader import LoadedModel
from model_runner.models.llama import LlamaForCausalLM
from model_runner.runner import prepare_inputs
from scheduler.output import ScheduledRequest
from scheduler.sampling_params import SamplingParams

TEXT_MODULES = (argparse, json, typing, email, unittest, logging, collections)
MAX_TOKENS = 1024
BLOCK_SIZE = 16  # of prefill's throwaway KV cache


def reference_token_ids(loaded: LoadedModel) -> torch.Tensor:
    """The reference text's tokens, [1, <= MAX_TOKENS]."""
    text = "\n\n".join(module.__doc__ or "" for module in TEXT_MODULES)
    return torch.tensor([loaded.tokenizer(text).input_ids[:MAX_TOKENS]])


@torch.inference_mode()
def teacher_forced_logits(loaded: LoadedModel, token_ids: torch.Tensor) -> torch.Tensor:
    """float32 logits [tokens, vocab] of every position of token_ids [1, tokens]."""
    return loaded.model.compute_logits(prefill(loaded.model, token_ids))


@dataclass
class Quality:
    top1_agreement: float  # share of positions whose argmax is the reference's
    nll: float  # mean negative log-likelihood of the true next tokens
    reference_nll: float

    def __str__(self) -> str:
        return (
            f"top-1 agreement {self.top1_agreement:.1%}, perplexity {math.exp(self.nll):.3f} "
            f"vs {math.exp(self.reference_nll):.3f} ({self.nll / self.reference_nll - 1:+.1%} NLL)"
        )


def compare(logits: torch.Tensor, reference: torch.Tensor, token_ids: torch.Tensor) -> Quality:
    """`logits` against the `reference` logits, both of token_ids' positions."""
    targets = token_ids[0, 1:]
    return Quality(
        top1_agreement=(logits.argmax(-1) == reference.argmax(-1)).float().mean().item(),
        nll=F.cross_entropy(logits[:-1], targets).item(),
        reference_nll=F.cross_entropy(reference[:-1], targets).item(),
    )


def prefill(model: LlamaForCausalLM, token_ids: torch.Tensor) -> torch.Tensor:
    """One forward over the sequences of token_ids [seqs, len] (each from position 0,
    laid out by the runner's prepare_inputs, through the torch reference attention): the
    final hidden states [seqs * len, H]."""
    device = model.embed_tokens.weight.device
    num_seqs, seq_len = token_ids.shape
    blocks_per_seq = -(-seq_len // BLOCK_SIZE)
    requests = [
        ScheduledRequest(
            request_id=str(i), token_ids=ids, num_computed_tokens=0,
            block_table=list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)),
            sample=False, sampling_params=SamplingParams(), prompt_token_ids=ids,
            output_token_ids=[],
        )
        for i, ids in enumerate(token_ids.tolist())
    ]
    inputs = prepare_inputs(requests, BlockTables(BLOCK_SIZE), device)
    kv_cache = allocate_kv_cache(
        model.num_layers, num_seqs * blocks_per_seq, BLOCK_SIZE,
        model.num_kv_heads, model.head_dim, model.embed_tokens.weight.dtype, device,
    )
    return model(
        inputs.input_ids, inputs.positions, inputs.meta, kv_cache.layers, torch_backend.BACKEND
    )
