"""The step-cost calibration at start: the seed the slo policy plans the first requests
with, measured on the runner (a tiny random model) without leaving a trace in its KV
cache, known outright for the simulated runner; shown at /scheduler/state."""

from __future__ import annotations

from dataclasses import astuple

import pytest

from engine.calibration import calibrate
from engine.core import EngineCore
from engine.core_setup import build_core_parts
from engine.messages import AddRequests, NewRequest
from model_runner.config import ModelConfig
from model_runner.loader import load_model_spec
from model_runner.simulated_runner import SimulatedRunner
from scheduler.config import SchedulerConfig
from scheduler.sampling_params import SamplingParams
from scheduler.step_cost import DEFAULT_SEED
from tests.support.model_helpers import CONFIGS, make_model_folder

COEFFICIENTS = ("fixed_s", "per_decode_s", "per_prefill_s", "per_prefill_key_s",
                "per_decode_key_s", "per_chunk_s", "per_chunk_context_s")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("calibration")
    make_model_folder(path, CONFIGS["smollm2"]())
    return str(path)


def _core(folder: str, calibrate_step_cost: bool) -> EngineCore:
    scheduler, runner, info, _ = build_core_parts(
        ModelConfig(model=folder, num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=256),
        SchedulerConfig(policy="slo", max_num_seqs=8, max_num_batched_tokens=256,
                        calibrate_step_cost=calibrate_step_cost))
    return EngineCore(scheduler, runner, frozenset(info.eos_token_ids))


def _generate(core: EngineCore) -> list[int]:
    core.apply(AddRequests([NewRequest(request_id="r", prompt_token_ids=list(range(5, 45)),
                                       sampling_params=SamplingParams(temperature=0.0,
                                                                      max_tokens=8))]))
    tokens: list[int] = []
    while core.scheduler.has_unfinished_requests():
        tokens += [t for d in core.step_fn().deltas for t in d.new_token_ids]
    return tokens


def test_calibration_seeds_the_model_and_leaves_no_trace(folder: str) -> None:
    plain, calibrated = _core(folder, False), _core(folder, True)
    state = calibrated.scheduler.snapshot()["step_cost"]
    assert state["calibration_s"] > 0 and state["num_steps_observed"] == 0
    measured = {name: state[name] for name in COEFFICIENTS}
    assert state["seed"] == measured != DEFAULT_SEED.as_dict()  # planned with from the start
    assert min(measured.values()) >= 0 and measured["fixed_s"] + measured["per_decode_s"] > 0
    assert plain.scheduler.snapshot()["step_cost"]["calibration_s"] is None
    # the KV it wrote on free blocks is never read: the same greedy tokens as without it
    assert _generate(calibrated) == _generate(plain)
    assert calibrated.scheduler.kv_cache.num_free_blocks == calibrated.runner.num_kv_blocks


def test_the_simulated_runner_reports_its_known_cost(folder: str) -> None:
    spec = load_model_spec(ModelConfig(model=folder))
    runner = SimulatedRunner(spec, ModelConfig(num_kv_blocks=16), step_ms=7, host_ms=1)
    cost = calibrate(runner, DEFAULT_SEED, 8, 256).cost
    assert astuple(cost) == pytest.approx((0.008, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0))


def test_the_planner_sees_the_gap_between_back_to_back_steps(folder: str) -> None:
    # a decode's gap is its step and the engine's time between steps: the core reports
    # it beside the step's own time, from the second step in a row on; not across idle
    scheduler, runner, info, _ = build_core_parts(
        ModelConfig(model=folder, num_kv_blocks=64, max_num_seqs=8), SchedulerConfig(
            policy="slo", max_num_seqs=8, calibrate_step_cost=False), simulate_step_ms=0)
    core = EngineCore(scheduler, runner, frozenset(info.eos_token_ids))
    seen: list[tuple[float, float | None]] = []
    observe = scheduler.observe_step
    scheduler.observe_step = lambda work, seconds, gap_s=None: (  # type: ignore[method-assign]
        seen.append((seconds, gap_s)), observe(work, seconds, gap_s))[-1]
    for _ in range(2):
        assert _generate(core) and core.has_work is False
        core.on_idle()
    assert len(seen) == 16 and seen[0][1] is None and seen[8][1] is None
    assert all(gap is not None and gap >= seconds for seconds, gap in seen[1:8] + seen[9:])
