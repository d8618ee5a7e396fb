"""A model windowed in every layer (CacheConfig.sliding_window): the scheduler's requests
release the blocks behind their window while they run, so long sequences run side by side
in a pool that could not hold them whole; no step's table points the runner at a released
block inside a window. Without a window (a model with any full-attention layer) nothing is
released."""

from __future__ import annotations

from scheduler.output import SchedulerOutput
from scheduler.scheduler import Scheduler
from tests.support.scheduler_helpers import (
    add_all,
    make_requests,
    make_runner_output,
    make_scheduler,
    step,
)

BLOCK_SIZE = 4
WINDOW = 8


def check_windows_held(scheduler: Scheduler, out: SchedulerOutput) -> None:
    """Every block a scheduled chunk's queries can see is held by its request."""
    held = {b.block_id for b in scheduler.kv_cache.pool.blocks if b.ref_cnt > 0}
    for scheduled in out.scheduled:
        first_seen = max(0, scheduled.num_computed_tokens - WINDOW + 1)
        end = scheduled.num_computed_tokens + scheduled.num_new_tokens
        seen = scheduled.block_table[first_seen // BLOCK_SIZE : -(-end // BLOCK_SIZE)]
        assert set(seen) <= held, scheduled.request_id


def run(window: int | None, num_blocks: int) -> tuple[Scheduler, int]:
    """Three 40-token prompts generating 60 tokens each; the most blocks held at once."""
    scheduler = make_scheduler(num_blocks=num_blocks, block_size=BLOCK_SIZE,
                               sliding_window=window, max_num_batched_tokens=16)
    add_all(scheduler, make_requests(3, 40, 60))
    peak = 0
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        if window is not None:
            check_windows_held(scheduler, out)
        peak = max(peak, scheduler.kv_cache.num_blocks - scheduler.kv_cache.num_free_blocks)
        scheduler.update(out, make_runner_output(out))
        scheduler.check_integrity()
    assert scheduler.kv_cache.usage == 0
    return scheduler, peak


def test_a_windowed_model_runs_long_sequences_in_a_small_pool() -> None:
    # each sequence reaches 100 tokens (25 blocks); 3 at once would need 75 blocks
    scheduler, peak = run(WINDOW, num_blocks=30)
    assert scheduler.num_preemptions_total == 0
    # a chunk of 16 new tokens plus the window before it, per sequence
    assert peak <= 3 * (-(-(16 + WINDOW) // BLOCK_SIZE) + 1)


def test_without_a_window_the_same_load_preempts() -> None:
    scheduler, peak = run(None, num_blocks=30)
    assert scheduler.num_preemptions_total > 0
    assert peak > 20


def test_prefix_hits_after_blocks_were_released() -> None:
    scheduler = make_scheduler(block_size=BLOCK_SIZE, sliding_window=WINDOW, num_blocks=64)
    first, second = make_requests(2, 33, 4, prefix=list(range(32)))
    add_all(scheduler, [first])
    while scheduler.has_unfinished_requests():
        step(scheduler)
    hits_before = scheduler.kv_cache.prefix_cache_hits_tokens
    add_all(scheduler, [second])
    out, _ = step(scheduler)
    # the released blocks stayed keyed: the shared 32-token prefix is a hit
    assert scheduler.kv_cache.prefix_cache_hits_tokens - hits_before == 32
    assert out.scheduled[0].num_computed_tokens == 32
