"""Grammar-engine helpers for the unit tests: llguidance on the ByteTokenizer's vocabulary,
and a runner that samples at random among the tokens a step's bitmask allows."""

from __future__ import annotations

import random

import llguidance
import numpy as np

from scheduler.output import ModelRunnerOutput, SchedulerOutput
from structured.compiler import GrammarCompiler
from structured.matchers import StructuredOutputs
from tests.conftest import BYTE_EOS, SyncRunner

VOCAB_SIZE = 257


class _ByteVocab:
    eos_token_id = BYTE_EOS
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
    special_token_ids = [BYTE_EOS]

    def __call__(self, data: bytes) -> list[int]:
        return list(data)


def byte_ll_tokenizer() -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocab()))


def make_structured(cache_size: int = 16) -> StructuredOutputs:
    return StructuredOutputs(GrammarCompiler(byte_ll_tokenizer(), cache_size=cache_size))


def allowed_tokens(bitmask: np.ndarray, row: int) -> list[int]:
    bits = np.unpackbits(bitmask[row].view(np.uint8), bitorder="little")[:VOCAB_SIZE]
    return [int(t) for t in bits.nonzero()[0]]


class MaskedRandomRunner(SyncRunner):
    """Samples a random allowed token per constrained row (a random printable byte
    otherwise); records the rows each step's bitmask had."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.masked_rows: list[int] = []

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        out = ModelRunnerOutput()
        masks = plan.grammar_bitmask.result() if plan.grammar_bitmask is not None else None
        self.masked_rows.append(len(masks.rows) if masks is not None else 0)
        for scheduled in plan.scheduled:
            if not scheduled.sample:
                continue
            if masks is not None and scheduled.request_id in masks.rows:
                choices = allowed_tokens(masks.bitmask, masks.rows[scheduled.request_id])
            else:
                choices = list(range(32, 127))
            out.sampled_token_ids[scheduled.request_id] = self.rng.choice(choices)
        return out
