"""The step-cost model (scheduler/step_cost.py): its fit on synthetic step times, each a
known model's prediction plus noise, what the seed and a calibration's steps hold, and its
window."""

from __future__ import annotations

import random

import pytest

from scheduler.slo import StepWork
from scheduler.step_cost import StepCost, StepCostModel, prompt_keys


def test_cost_model_learns_what_decodes_cost_as_their_contexts_grow() -> None:
    # 16 decodes from context 100 to 900 (reading the KV cache: 55 to 90 ms a step on
    # the default model): the fit follows them, where a per-row part alone would predict
    # their mean and let the late steps run over
    truth = StepCost(fixed_s=0.006, per_decode_s=0.003, per_prefill_s=0.0008,
                     per_prefill_key_s=4e-7, per_decode_key_s=3e-6)
    model = StepCostModel(StepCost(0.02, 0.001, 0.0005, 0.0), window=256)
    rng = random.Random(1)
    for i in range(800):
        keys = 16 * (100 + i)
        tokens = rng.choice([0, rng.randint(1, 32)])
        chunk_keys = prompt_keys(rng.randint(0, 2000), tokens)
        model.observe(16, tokens, chunk_keys, truth.predict(16, tokens, chunk_keys, keys)
                      + rng.uniform(-0.001, 0.001), keys)
    late = 16 * 900
    assert model.cost.predict(16, decode_keys=late) == pytest.approx(
        truth.predict(16, decode_keys=late), rel=0.05)
    assert model.cost.per_decode_key_s == pytest.approx(truth.per_decode_key_s, rel=0.1)


def test_cost_model_recovers_synthetic_coefficients() -> None:
    # chunks of prompts at contexts 0 to 4,000: a token at context 1,000 costs 2x one at 0
    truth = StepCost(fixed_s=0.008, per_decode_s=0.0015, per_prefill_s=0.0002,
                     per_prefill_key_s=0.0002 / 1000)
    model = StepCostModel(StepCost(0.05, 0.01, 0.001, 0.0), window=128)
    rng = random.Random(0)
    for _ in range(200):
        rows, start = rng.randint(1, 64), rng.randint(0, 4000)
        tokens = rng.choice([0, 0, rng.randint(16, 512)])
        keys = prompt_keys(start, tokens)
        noise = rng.uniform(-0.0002, 0.0002)
        model.observe(rows, tokens, keys, truth.predict(rows, tokens, keys) + noise)
    fit = model.cost
    assert fit.fixed_s == pytest.approx(truth.fixed_s, rel=0.1)
    assert fit.per_decode_s == pytest.approx(truth.per_decode_s, rel=0.05)
    assert fit.per_prefill_s == pytest.approx(truth.per_prefill_s, rel=0.05)
    assert fit.per_prefill_key_s == pytest.approx(truth.per_prefill_key_s, rel=0.05)
    assert model.num_observed == 200
    # a late chunk of a long prompt: predicted as it runs, not as a chunk at context 0
    late = prompt_keys(3000, 64)
    assert fit.predict(16, 64, late) == pytest.approx(truth.predict(16, 64, late), rel=0.02)
    assert fit.predict(16, 64, late) > 1.3 * fit.predict(16, 64, 0)


def test_cost_model_learns_what_a_chunk_costs_whatever_its_size() -> None:
    # a chunk beside the decodes costs 6 ms of its own and 6 ms per 1,024 positions before
    # it (its attention call, its context read once): the fit separates that from its
    # tokens and keys, so a one-token chunk at context 1,024 is predicted as it runs, where
    # a model without the terms puts the cost on every token and misses small chunks
    truth = StepCost(0.008, 0.0017, 0.0008, 4.5e-7, 3e-6, per_chunk_s=0.006,
                     per_chunk_context_s=0.006 / 1024)
    model = StepCostModel(StepCost(0.02, 0.001, 0.0005, 0.0), window=256)
    rng = random.Random(2)
    for _ in range(400):
        rows = rng.randint(8, 24)
        work = StepWork(num_decode_rows=rows, decode_keys=rows * rng.randint(50, 500))
        for _ in range(rng.choice([0, 1, 1, 2])):
            work.add_prefill(rng.randint(0, 2000), rng.randint(1, 64))
        model.observe(rows, work.prefill_tokens, work.prefill_keys,
                      work.seconds(truth) + rng.uniform(-0.0005, 0.0005), work.decode_keys,
                      work.prefill_chunks, work.chunk_context)
    fit = model.cost
    assert fit.per_chunk_s == pytest.approx(truth.per_chunk_s, rel=0.1)
    assert fit.per_chunk_context_s == pytest.approx(truth.per_chunk_context_s, rel=0.1)
    small = StepWork(num_decode_rows=16, decode_keys=16 * 200)
    small.add_prefill(1024, 1)
    assert small.seconds(fit) == pytest.approx(small.seconds(truth), rel=0.02)
    assert small.seconds(truth) - StepWork(16, decode_keys=16 * 200).seconds(truth) > 0.012


def test_cost_model_keeps_the_seed_where_the_steps_say_nothing() -> None:
    seed = StepCost(0.01, 0.001, 0.0003, 1e-7)
    model = StepCostModel(seed)
    for rows in range(1, 40):  # decode-only steps: nothing about prefill
        model.observe(rows, 0, 0, 0.02 + 0.002 * rows)
    assert model.cost.per_prefill_s == pytest.approx(seed.per_prefill_s)
    assert model.cost.per_prefill_key_s == pytest.approx(seed.per_prefill_key_s)
    assert model.cost.per_decode_s == pytest.approx(0.002, rel=0.1)


def test_cost_model_forgets_steps_beyond_its_window() -> None:
    model = StepCostModel(StepCost(0.01, 0.001, 0.0), window=50)
    for _ in range(50):
        model.observe(10, 0, 0, 0.5)  # a slow phase
    for _ in range(50):
        model.observe(10, 0, 0, 0.02)
    assert model.cost.predict(10, 0) == pytest.approx(0.02, rel=0.05)


def test_a_calibrations_steps_hold_what_the_window_cannot_tell_apart() -> None:
    # A long prompt computed one token a step beside 16 decodes: both contexts grow one
    # key a step, so the window's prefill keys and decode keys are collinear, and a short
    # chunk's keys are read at a decode's cost, not at the prefill matmul's. The window
    # alone splits the sum between the two coefficients; the calibration's steps (a
    # 128-token chunk at context 1,024 among them) keep the prefill key at its cost.
    truth = StepCost(0.007, 0.0015, 0.0008, 5e-7, 2.6e-6)
    calibration = StepCostModel(truth)
    for rows, context in ((1, 64), (32, 64), (8, 1024)):
        calibration.observe(rows, 0, 0, truth.predict(rows, 0, 0, rows * context),
                            rows * context)
    for start in (0, 1024):
        keys = prompt_keys(start, 128)
        calibration.observe(0, 128, keys, truth.predict(0, 128, keys))
    plain, anchored = StepCostModel(calibration.cost), StepCostModel(calibration.cost)
    anchored.reseed(calibration.cost, calibration.steps)
    for model in (plain, anchored):
        for i in range(256):
            context, decode_keys = 200 + i, 16 * (300 + i)
            seconds = truth.predict(16, 1, 0, decode_keys + context) + 0.004 * (i % 3)
            model.observe(16, 1, context, seconds, decode_keys)
    chunk = (16, 64, prompt_keys(1500, 64), 16 * 600)  # planned at a later step
    assert anchored.cost.predict(*chunk) == pytest.approx(truth.predict(*chunk), rel=0.1)
    assert plain.cost.predict(*chunk) > 1.3 * truth.predict(*chunk)  # what anchors prevent


def test_cost_model_refits_without_a_coefficient_that_would_be_negative() -> None:
    # one batch size (the fixed part and the per-row part trade off) and prefill work
    # that costs more than linear: unconstrained, the fixed part goes negative
    model = StepCostModel(StepCost(0.02, 0.001, 0.0005))
    for i in range(60):
        prefill = 0 if i % 3 else 400 + 10 * i
        model.observe(16, prefill, 0, 0.1 + 1e-6 * prefill ** 2)  # keys not counted
    fit = model.cost
    assert min(fit.fixed_s, fit.per_decode_s, fit.per_prefill_s, fit.per_prefill_key_s) >= 0
    assert fit.predict(16, 0) == pytest.approx(0.1, rel=0.2)  # its own decode steps


def test_cost_model_forgets_long_prompts_without_a_residue() -> None:
    # long prompts' key counts (~1e6 a step, ~1e12 squared) leave the window; the
    # decode-only window that follows says nothing of prefill: the seed's, exactly
    seed = StepCost(0.01, 0.001, 0.0003, 1e-7)
    model = StepCostModel(seed, window=64)
    for i in range(64):
        keys = prompt_keys(2000 + 37 * i, 512)
        model.observe(8, 512, keys, 0.2 + 3e-7 * keys)
    for rows in range(1, 129):
        model.observe(rows % 16 + 1, 0, 0, 0.02 + 0.002 * (rows % 16 + 1))
    assert model.cost.per_prefill_key_s == pytest.approx(seed.per_prefill_key_s, rel=1e-6)
    assert model.cost.per_prefill_s == pytest.approx(seed.per_prefill_s, rel=1e-6)
    assert model.cost.per_decode_s == pytest.approx(0.002, rel=0.01)
