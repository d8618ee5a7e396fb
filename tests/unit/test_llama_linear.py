"""The CPU prepacked projection: same numbers as nn.Linear at every padded row count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model_runner.llama import Linear, _padded_rows, can_prepack

pytestmark = pytest.mark.skipif(
    not can_prepack(torch.device("cpu"), torch.float32), reason="torch built without oneDNN"
)


@pytest.mark.parametrize("rows", [1, 3, 5, 9, 63, 64, 65, 100, 257])
@pytest.mark.parametrize("bias", [False, True])
def test_prepacked_linear_matches_plain(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    linear = Linear(48, 80, bias=bias)
    x = torch.randn(rows, 48)
    expected = F.linear(x, linear.weight, linear.bias)
    linear.prepack()
    with torch.inference_mode():
        got = linear(x)
    assert got.shape == (rows, 80)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_row_buckets_are_few_and_cover_every_count() -> None:
    buckets = {_padded_rows(r) for r in range(1, 2049)}
    assert all(_padded_rows(r) >= r for r in range(1, 2049))
    assert len(buckets) < 80
    assert [_padded_rows(r) for r in (1, 2, 3, 8, 9, 65)] == [1, 2, 4, 8, 16, 96]
