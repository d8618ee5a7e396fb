"""The step-cost model's seed, measured when the engine core starts (`calibrate`).

A few steps of the runner, made by hand on KV blocks that no request holds yet (the junk
KV they write is overwritten by a request's own before it is ever read): decode steps of
one row and of a batch at a short context and of a few rows at a long one, a prefill
chunk from a prompt's start and at a long context, and the batch with a short chunk
beside it at each (what a chunk costs whatever its size).
Each runs once untimed (first calls: allocations, kernel builds, graph replays set up),
then `REPEATS` times timed; the model fitted to those times (scheduler/step_cost.py)
becomes the scheduler's seed, so the slo policy plans the first requests with this
device's costs instead of a guess, and the steps it runs refine it from there (the timed
steps stay in its fit: they span the work its window may not). The
simulated runner needs no measuring: a step costs its step time, whatever its work.
"""

from __future__ import annotations

import logging
import time

from model_runner.runner import ModelRunner
from model_runner.simulated_runner import SimulatedRunner
from scheduler.output import ScheduledRequest, SchedulerOutput
from scheduler.sampling_params import SamplingParams
from scheduler.slo import StepWork
from scheduler.step_cost import StepCost, StepCostModel

logger = logging.getLogger(__name__)

REPEATS = 2
DECODE_ROWS = (1, 32)  # two batch sizes: the fixed part apart from the per-row part
DECODE_CONTEXT = 64
LONG_DECODES = 8  # rows at LONG_CONTEXT (or as long as the blocks allow): the per-key part
PREFILL_TOKENS = 128
LONG_CONTEXT = 1024  # a chunk's start: the per-key part apart from the per-token part
SHORT_CHUNK = 32  # beside the batch: a chunk's own cost apart from its tokens'


def calibrate(runner: ModelRunner | SimulatedRunner, seed: StepCost, max_num_seqs: int,
              max_num_batched_tokens: int) -> StepCostModel:
    """The step-cost model of a few timed steps of `runner` (its `cost` fitted to them,
    held toward `seed` where they say nothing; its `steps` them), within its seats, step
    budget, context and KV blocks."""
    if isinstance(runner, SimulatedRunner):
        return StepCostModel(StepCost(runner.step_s + runner.host_s, 0.0, 0.0, 0.0))
    model = StepCostModel(seed)
    plans = _plans(runner, max_num_seqs, max_num_batched_tokens)
    for work, plan in plans:
        runner.execute(plan)
        for _ in range(REPEATS):
            start = time.perf_counter()
            runner.execute(plan)
            work.observed(model, time.perf_counter() - start)
    ids = sorted({r.request_id for _, plan in plans for r in plan.scheduled})
    runner.execute(SchedulerOutput(finished_ids=ids))  # the runner forgets them
    return model


def _plans(runner: ModelRunner, max_num_seqs: int, max_num_batched_tokens: int
           ) -> list[tuple[StepWork, SchedulerOutput]]:
    """The calibration steps, each with its work as the cost model counts it."""
    block_size, num_blocks = runner.block_size, runner.num_kv_blocks
    blocks_per_row = DECODE_CONTEXT // block_size + 1
    most_rows = max(1, min(max_num_seqs, num_blocks // blocks_per_row))
    tokens = max(1, min(PREFILL_TOKENS, max_num_batched_tokens, runner.max_model_len // 2))
    long_start = min(LONG_CONTEXT, runner.max_model_len - tokens,
                     num_blocks * block_size - tokens)
    long_rows = max(1, min(LONG_DECODES, max_num_seqs))
    long_context = min(LONG_CONTEXT, runner.max_model_len - 1,
                       num_blocks // long_rows * block_size - 1)
    decodes = {(min(r, most_rows), DECODE_CONTEXT) for r in DECODE_ROWS}
    if long_context > 2 * DECODE_CONTEXT:
        decodes.add((long_rows, long_context))
    plans = []
    for rows, context in sorted(decodes):
        work = StepWork(num_decode_rows=rows, decode_keys=rows * (context + 1))
        plans.append((work, SchedulerOutput(_decodes(rows, context, block_size))))
    batch = min(max(DECODE_ROWS), most_rows)
    chunk_blocks = num_blocks - batch * blocks_per_row
    for start in sorted({0, max(long_start, 0)}):
        work = StepWork()
        work.add_prefill(start, tokens)
        plans.append((work, SchedulerOutput(
            [_chunk(f"calibration-prefill-{start}", start, tokens, block_size, 0)])))
        if chunk_blocks * block_size < start + SHORT_CHUNK:
            continue
        work = StepWork(num_decode_rows=batch, decode_keys=batch * (DECODE_CONTEXT + 1))
        work.add_prefill(start, SHORT_CHUNK)
        plans.append((work, SchedulerOutput([
            *_decodes(batch, DECODE_CONTEXT, block_size),
            _chunk(f"calibration-chunk-{start}", start, SHORT_CHUNK, block_size,
                   batch * blocks_per_row)])))
    return plans


def _decodes(rows: int, context: int, block_size: int) -> list[ScheduledRequest]:
    """`rows` made-up decodes at `context`, each on its own consecutive blocks from 0."""
    per_row = context // block_size + 1
    return [_chunk(f"calibration-decode-{context}-{i}", context, 1, block_size, i * per_row)
            for i in range(rows)]


def _chunk(request_id: str, start: int, num_tokens: int, block_size: int,
           first_block: int) -> ScheduledRequest:
    """Positions [start, start + num_tokens) of a made-up request on consecutive blocks
    from `first_block`, sampling after them."""
    num_blocks = -(-(start + num_tokens) // block_size)
    return ScheduledRequest(
        request_id, [1] * num_tokens, start, list(range(first_block, first_block + num_blocks)),
        True, SamplingParams(), [1] * start, [])
