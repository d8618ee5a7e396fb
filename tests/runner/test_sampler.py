"""The sampler on hand-made logits: greedy, seeds, top-k/p, min-p, penalties, logprobs,
min_tokens, and the per-request rows it keeps between steps."""

from __future__ import annotations

import itertools

import pytest
import torch

from model_runner.sampler import Sampler
from scheduler.output import ScheduledRequest
from scheduler.sampling_params import SamplingParams
from tests.support.model_helpers import GREEDY

REQUEST_NUMBERS = itertools.count()


def request(params: SamplingParams, prompt=(), output=(), request_id=None) -> ScheduledRequest:
    """A request that samples; a new id unless given (ids are unique within a batch)."""
    request_id = request_id or f"x{next(REQUEST_NUMBERS)}"
    return ScheduledRequest(request_id, [0], 0, [0], True, params, list(prompt), list(output))


def sampler(seed: int = 0) -> Sampler:
    return Sampler(torch.device("cpu"), frozenset({2}), seed)


def test_sampler_seed_independent_of_batch():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    seeded = SamplingParams(temperature=0.8, seed=7)

    def draws(batch: bool) -> list[int]:
        gen = torch.Generator().manual_seed(7)
        out = []
        for _ in range(20):
            if batch:
                rows = [request(SamplingParams()), request(seeded), request(SamplingParams(seed=1))]
                gens = [None, gen, torch.Generator().manual_seed(1)]
                out.append(sampler()(logits.clone(), rows, gens).token_ids[1])
            else:
                out.append(sampler()(logits[1:2].clone(), [request(seeded)], [gen]).token_ids[0])
        return out

    assert draws(batch=True) == draws(batch=False)


def test_draws_follow_the_distribution_and_never_a_token_of_probability_zero():
    probs = torch.tensor([0.0, 0.1, 0.0, 0.6, 0.3, 0.0])  # zeros at both ends and between
    rows = 4000
    requests = [request(SamplingParams()) for _ in range(rows)]
    out = sampler(seed=5)(probs.log().repeat(rows, 1), requests, [None] * rows)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=6)
    assert counts[[0, 2, 5]].tolist() == [0, 0, 0]
    expected = probs * rows
    # within 4 standard deviations of each count (binomial)
    assert ((counts - expected).abs() <= 4 * (expected * (1 - probs)).sqrt()).all(), counts


def test_top_k_one_is_greedy():
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=t, top_k=1) for t in (0.5, 1.0, 3.0, 10.0)] * 2
    out = sampler()(logits.clone(), [request(p) for p in params], [None] * 8)
    assert out.token_ids == logits.argmax(-1).tolist()


def test_greedy_rows_in_a_sampled_batch():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(2))
    params = [GREEDY, SamplingParams(temperature=2.0), GREEDY, SamplingParams(top_p=0.5)]
    out = sampler()(logits.clone(), [request(p) for p in params], [None] * 4)
    assert out.token_ids[0] == int(logits[0].argmax()) and out.token_ids[2] == int(
        logits[2].argmax()
    )


def test_top_p_and_min_p_cut_the_tail():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    for params, allowed in [
        (SamplingParams(top_p=0.6), {0, 1}),
        (SamplingParams(top_p=0.4), {0}),
        (SamplingParams(min_p=0.5), {0, 1}),
        (SamplingParams(min_p=0.2), {0, 1, 2}),
        (SamplingParams(top_k=3), {0, 1, 2}),
    ]:
        s = sampler(seed=3)
        seen = {s(logits.clone(), [request(params)], [None]).token_ids[0] for _ in range(300)}
        assert seen == allowed, params


def test_repetition_penalty_hf_semantics():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5]])
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, logprobs=0)
    out = sampler()(logits.clone(), [request(params, prompt=[0, 1], output=[1, 3])], [None])
    # seen tokens 0, 1, 3: positive halved, negative doubled; 2 and 4 untouched
    processed = torch.tensor([1.0, -4.0, 1.0, -2.0, 0.5])
    assert out.token_ids == [0]  # ties at 1.0 between 0 and 2 break to the first
    assert out.logprobs[0].logprob == pytest.approx(float(torch.log_softmax(processed, -1)[0]))


def test_presence_and_frequency_penalties_openai_semantics():
    logits = torch.zeros(1, 5)
    params = SamplingParams(
        temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25, logprobs=5
    )
    # prompt tokens are not penalised; output token 1 twice, token 3 once
    out = sampler()(logits, [request(params, prompt=[4, 4], output=[1, 1, 3])], [None])
    processed = torch.tensor([0.0, -1.0, 0.0, -0.75, 0.0])
    expected = dict(enumerate(torch.log_softmax(processed, -1).tolist()))
    assert dict(out.logprobs[0].top) == pytest.approx(expected)


def test_penalties_follow_the_history_step_by_step():
    """The counts kept between steps give the same penalised logits as a fresh sampler
    that sees the whole history at once, across steps, rows growing and rows freed."""
    vocab = 64
    params = SamplingParams(
        temperature=0.0, repetition_penalty=1.5, presence_penalty=0.3,
        frequency_penalty=0.2, logprobs=vocab,
    )
    g = torch.Generator().manual_seed(5)
    kept = sampler()
    histories = {f"r{i}": ([int(t) for t in torch.randint(0, vocab, (5,), generator=g)], [])
                 for i in range(12)}
    for step_no in range(6):
        rows = [request(params, prompt, output, request_id=rid)
                for rid, (prompt, output) in histories.items()]
        logits = torch.randn(len(rows), vocab, generator=g)
        got = kept(logits.clone(), rows, [None] * len(rows))
        want = sampler()(logits.clone(), rows, [None] * len(rows))
        for a, b in zip(got.logprobs, want.logprobs, strict=True):
            assert dict(a.top) == pytest.approx(dict(b.top))
        for rid, token in zip(histories, got.token_ids, strict=True):
            histories[rid][1].append(token)
        if step_no == 2:  # two finish; a newcomer takes a freed row
            kept.forget(["r0", "r1"])
            del histories["r0"], histories["r1"]
            histories["new"] = ([1, 2, 3], [])
    assert kept.token_counts.num_rows == 11


def test_logprobs_match_log_softmax():
    logits = torch.randn(2, 40, generator=torch.Generator().manual_seed(4))
    params = [
        SamplingParams(temperature=0.0, logprobs=4),
        SamplingParams(temperature=2.0, logprobs=2),
    ]
    out = sampler()(logits.clone(), [request(p) for p in params], [None, None])
    for row, (p, t) in enumerate(zip(params, (1.0, 2.0), strict=True)):
        expected = torch.log_softmax(logits[row] / t, -1)
        lp = out.logprobs[row]
        assert lp.logprob == pytest.approx(float(expected[out.token_ids[row]]), abs=1e-6)
        assert [i for i, _ in lp.top] == expected.topk(p.logprobs).indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(expected.topk(p.logprobs).values.tolist())


def test_min_tokens_masks_stop_tokens():
    logits = torch.tensor([[0.0, 0.0, 10.0, 9.0, 0.0]])  # eos (2) is the argmax
    early = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(3,))
    assert sampler()(logits.clone(), [request(early, output=[4])], [None]).token_ids == [0]
    late = SamplingParams(temperature=0.0, min_tokens=2, max_tokens=4)
    assert sampler()(logits.clone(), [request(late, output=[4, 4])], [None]).token_ids == [2]


# --- the rows kept between steps --------------------------------------------------------------

MIXED = [
    GREEDY,
    SamplingParams(temperature=0.7, top_k=5, seed=3),
    SamplingParams(top_p=0.8, min_p=0.05),
    SamplingParams(temperature=0.0, repetition_penalty=1.3, logprobs=3),
    SamplingParams(temperature=1.5, frequency_penalty=0.4, presence_penalty=0.2, seed=9),
    SamplingParams(temperature=0.0, min_tokens=3, max_tokens=8, stop_token_ids=(5,)),
    SamplingParams(min_p=0.2, logprobs=0),
]


def test_rows_kept_between_steps_sample_what_a_fresh_sampler_samples():
    """Requests join, leave and change places in the batch; the rows kept on the device
    give every step the tokens and logprobs of a sampler that starts from nothing, and
    only a request's first step writes its row."""
    vocab, g = 32, torch.Generator().manual_seed(11)
    kept = sampler()
    outputs: dict[str, list[int]] = {}
    generators = {f"r{i}": torch.Generator().manual_seed(100 + i) for i in range(len(MIXED))}
    live = [0, 1, 2, 3]
    for step_no in range(8):
        if step_no == 3:  # two finish, the others join
            kept.forget(["r0", "r2"])
            live = [1, 3, 4, 5, 6]
        order = [live[i] for i in torch.randperm(len(live), generator=g).tolist()]
        rows = [request(MIXED[i], [1, 2, 2], outputs.setdefault(f"r{i}", []), f"r{i}")
                for i in order]
        gens = [generators[r.request_id] if r.sampling_params.seed is not None else None
                for r in rows]
        copies = [None if gen is None else torch.Generator().set_state(gen.get_state())
                  for gen in gens]
        logits = torch.randn(len(rows), vocab, generator=g)
        fresh = sampler()
        fresh.generator.set_state(kept.generator.get_state())
        want = fresh(logits.clone(), rows, copies)
        got = kept(logits.clone(), rows, gens)
        assert got.token_ids == want.token_ids
        assert got.logprobs == want.logprobs
        for r, token in zip(rows, got.token_ids, strict=True):
            r.output_token_ids.append(token)
    assert kept.batch.num_rows == 5
    assert kept.batch.num_writes == len(MIXED)


def test_min_tokens_holds_back_stop_tokens_only_while_the_output_is_short():
    logits = torch.tensor([[0.0, 0.0, 10.0, 9.0, 0.0]])  # eos (2) is the argmax
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(3,))
    kept, row = sampler(), request(params, request_id="a")
    tokens = []
    for _ in range(3):
        tokens.append(kept(logits.clone(), [row], [None]).token_ids[0])
        row.output_token_ids.append(tokens[-1])
    assert tokens == [0, 0, 2]


def test_new_params_under_a_known_id_rewrite_its_row():
    logits = torch.tensor([[0.0, 1.0, 0.5]])
    kept = sampler()
    assert kept(logits.clone(), [request(GREEDY, request_id="a")], [None]).token_ids == [1]
    penalised = SamplingParams(temperature=0.0, presence_penalty=5.0)
    row = request(penalised, output=[1], request_id="a")
    assert kept(logits.clone(), [row], [None]).token_ids == [2]
    assert kept.batch.num_rows == 1 and kept.batch.num_writes == 2


def test_greedy_is_argmax_with_ties_to_the_first_on_every_path():
    from model_runner.sampler import greedy

    torch.manual_seed(0)
    logits = torch.randn(16, 262144)
    logits[:, 7] = logits[:, 70000] = logits[:, 262143] = 20.0  # three equal maxima
    logits[3] = 1.0  # a row of one value: its first id
    ids = greedy(logits)
    assert torch.equal(ids, logits.argmax(dim=-1))
    assert ids.tolist() == [7] * 3 + [0] + [7] * 12
    small = torch.randint(0, 3, (64, 1000)).float()  # many ties
    assert torch.equal(greedy(small), small.argmax(dim=-1))


@pytest.mark.parametrize("vocab", [1, 7, 8, 9, 100, 49152])
def test_greedy_on_the_cpu_is_argmax_with_ties_infinities_and_nans(vocab: int) -> None:
    # the C++ kernel (csrc/cpu_sampling.cpp): the first of equal maxima, a NaN the largest
    from model_runner.kernels.cpu_kernels import cpu_kernels_available
    from model_runner.sampler import greedy

    if not cpu_kernels_available():
        pytest.skip("needs the C++ CPU kernels")
    torch.manual_seed(vocab)
    cases = [torch.randn(5, vocab), torch.randint(0, 3, (5, vocab)).float(),
             torch.full((5, vocab), float("-inf")), torch.randn(5, 2 * vocab)[:, ::2]]
    with_nan = torch.randn(5, vocab)
    with_nan[1, vocab // 2] = with_nan[1, -1] = float("nan")
    with_inf = torch.randn(5, vocab)
    with_inf[:, -1] = float("inf")
    for logits in [*cases, with_nan, with_inf]:
        assert torch.equal(greedy(logits), logits.argmax(dim=-1))
