"""Verification of draft tokens in the sampler: greedy accepts exactly the argmax prefix,
rejection sampling leaves every output token's distribution as it was, logprobs are those
of the tokens returned, a grammar masks every position with its own state."""

from __future__ import annotations

import numpy as np
import torch

from model_runner.sampler import Sampler
from scheduler.output import GrammarBitmask, ScheduledRequest
from scheduler.sampling_params import SamplingParams

DEVICE = torch.device("cpu")


def drafted(request_id: str, drafts: list[int], params: SamplingParams) -> ScheduledRequest:
    return ScheduledRequest(request_id, [1, *drafts], 10, [0], True, params, [1] * 10, [],
                            num_draft_tokens=len(drafts))


def test_greedy_accepts_the_drafts_that_are_the_argmax_then_gives_the_argmax() -> None:
    greedy = SamplingParams(temperature=0.0)
    # rows: argmax 3, 1, 4 | 2, 0
    logits = torch.tensor([[0, 1, 2, 5, 0], [0, 6, 2, 1, 0], [0, 1, 2, 3, 9],
                           [0, 1, 7, 1, 0], [8, 1, 2, 1, 0]], dtype=torch.float32)
    requests = [drafted("a", [3, 2], greedy), drafted("b", [2], greedy)]
    tokens, logprobs = Sampler(DEVICE, frozenset()).verify(
        logits, requests, [None, None]).result()
    assert tokens == {"a": [3, 1], "b": [2, 0]}  # a: 3 accepted, 2 rejected for 1
    assert logprobs == {}


def test_logprobs_are_those_of_the_tokens_returned() -> None:
    params = SamplingParams(temperature=0.0, logprobs=1)
    logits = torch.tensor([[0, 3, 1], [2, 0, 1], [0, 0, 5]], dtype=torch.float32)
    want = torch.log_softmax(logits, dim=-1)
    tokens, logprobs = Sampler(DEVICE, frozenset()).verify(
        logits.clone(), [drafted("a", [1, 1], params)], [None]).result()
    assert tokens == {"a": [1, 0]}
    (first, second) = logprobs["a"]
    assert abs(first.logprob - float(want[0, 1])) < 1e-6 and first.top[0][0] == 1
    assert abs(second.logprob - float(want[1, 0])) < 1e-6 and second.top[0][0] == 0


def test_rejection_sampling_keeps_the_distribution_of_every_token() -> None:
    """20,000 requests, each verifying draft 2 then 1 over a 6-token vocabulary, top_k 4:
    the first token follows p0 (draft 2 accepted with p0(2)), the second, after an accepted
    draft, follows p1, and the bonus after two accepted drafts p2. Seeded, so the counts are
    fixed; the bound is 6 standard deviations of a frequency."""
    n = 20_000
    params = SamplingParams(temperature=0.7, top_k=4)
    rows = torch.tensor([[1.0, 0.2, 0.9, -1.0, 0.5, 0.3],
                         [0.1, 0.8, 0.0, 0.4, -2.0, 0.6],
                         [0.3, -0.5, 1.2, 0.0, 0.2, -0.1]])
    expected = []
    for row in rows / params.temperature:
        cut = row.topk(4).values[-1]
        expected.append(torch.softmax(row.masked_fill(row < cut, float("-inf")), dim=-1))
    sampler = Sampler(DEVICE, frozenset(), seed=1)
    requests = [drafted(f"r{i}", [2, 1], params) for i in range(n)]
    tokens, _ = sampler.verify(rows.repeat(n, 1), requests, [None] * n).result()
    outputs = list(tokens.values())

    def frequencies(samples: list[int]) -> torch.Tensor:
        return torch.bincount(torch.tensor(samples), minlength=6).double() / len(samples)

    def check(samples: list[int], p: torch.Tensor) -> None:
        bound = 6 * (0.25 / len(samples)) ** 0.5
        assert (frequencies(samples) - p.double()).abs().max() < bound, (frequencies(samples), p)

    check([out[0] for out in outputs], expected[0])
    after_first = [out[1] for out in outputs if out[0] == 2]
    assert len(after_first) > n // 4
    check(after_first, expected[1])
    bonus = [out[2] for out in outputs if out[:2] == [2, 1]]
    assert len(bonus) > n // 20
    check(bonus, expected[2])


def test_a_draft_outside_the_top_k_is_never_accepted() -> None:
    params = SamplingParams(temperature=1.0, top_k=1)
    logits = torch.tensor([[0.0, 5.0, 0.0], [0.0, 0.0, 5.0]]).repeat(200, 1)
    requests = [drafted(f"r{i}", [2], params) for i in range(200)]
    tokens, _ = Sampler(DEVICE, frozenset()).verify(logits, requests, [None] * 200).result()
    assert all(out == [1] for out in tokens.values())


def bitmask_of(*allowed: list[int], vocab: int = 6) -> np.ndarray:
    """One int32 bitmask row per list of allowed tokens."""
    bits = np.zeros((len(allowed), 32 * -(-vocab // 32)), dtype=np.uint8)
    for row, tokens in enumerate(allowed):
        bits[row, tokens] = 1
    return np.packbits(bits, axis=1, bitorder="little").view(np.int32)


def test_greedy_verification_masks_each_position_with_its_own_grammar_state() -> None:
    greedy = SamplingParams(temperature=0.0)
    # argmax unmasked: 3, 4, 5; masks: row 0 allows {1, 3}, row 1 (after draft 3) {2, 5},
    # row 2 {0, 5}
    logits = torch.tensor([[0, 1, 0, 5, 0, 0], [0, 0, 1, 0, 6, 0], [2, 0, 0, 0, 0, 9]],
                          dtype=torch.float32)
    masks = GrammarBitmask({"a": 0}, bitmask_of([1, 3], [2, 5], [0, 5]), {}, {"a": 2})
    tokens, _ = Sampler(DEVICE, frozenset()).verify(
        logits, [drafted("a", [3, 4], greedy)], [None], masks).result()
    assert tokens == {"a": [3, 2]}  # 4, the unmasked argmax, is forbidden at row 1


def test_a_draft_past_the_grammars_masks_is_not_accepted() -> None:
    greedy = SamplingParams(temperature=0.0)
    logits = torch.tensor([[0, 0, 0, 5, 0, 0], [0, 0, 0, 0, 6, 0], [0, 0, 0, 0, 0, 9]],
                          dtype=torch.float32)
    late = GrammarBitmask({"a": 0}, bitmask_of([3, 4], [4], [5]), {}, {"a": 1})
    tokens, _ = Sampler(DEVICE, frozenset()).verify(
        logits, [drafted("a", [3, 4], greedy)], [None], late).result()
    assert tokens == {"a": [3, 4]}  # the mask after draft 4 was late: 4 comes as the token


def test_rejection_sampling_never_accepts_a_masked_draft_and_corrects_within_the_mask() -> None:
    n = 400
    params = SamplingParams(temperature=1.0)
    rows = torch.tensor([[0.0, 0.5, 3.0, 0.2, 1.0, 0.0], [0.0, 2.0, 0.0, 1.0, 0.0, 1.5]])
    # row 0 allows {1, 3, 4} (not the draft 2, the likeliest), row 1 {1, 5}
    masks = bitmask_of([1, 3, 4], [1, 5])
    requests = [drafted(f"r{i}", [2], params) for i in range(n)]
    bitmask = GrammarBitmask({f"r{i}": 0 for i in range(n)}, masks, {},
                             {f"r{i}": 1 for i in range(n)})
    tokens, _ = Sampler(DEVICE, frozenset(), seed=2).verify(
        rows.repeat(n, 1), requests, [None] * n, bitmask).result()
    firsts = [out[0] for out in tokens.values()]
    assert all(len(out) == 1 for out in tokens.values())  # 2 never accepted
    assert set(firsts) == {1, 3, 4}  # corrections drawn within the mask, each seen
