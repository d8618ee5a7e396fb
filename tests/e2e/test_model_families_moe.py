"""test_model_families.py's tests on the mixtures of experts (Qwen3-MoE, Qwen2-MoE, Mixtral)
and gpt-oss: a module of their own, so that `make test` runs them on one worker while the
dense families run on the other."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.test_model_families import (  # noqa: F401 (collected here, on these families)
    EXPERT_FAMILIES,
    Family,
    serve_family,
    test_batched_with_a_preemption,
    test_chat,
    test_one_at_a_time_and_chunked,
    test_prefix_cache_hit,
)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module", params=list(EXPERT_FAMILIES))
def family(request, tmp_path_factory) -> Iterator[Family]:
    yield from serve_family(request.param, EXPERT_FAMILIES[request.param](), tmp_path_factory)
