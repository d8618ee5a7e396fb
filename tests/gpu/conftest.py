"""The GPU tests: compiled kernels, CUDA graphs and NCCL on a CUDA device, skipped without
one; with GPU_CHECK_DRY_RUN=1 (`python -m bench.gpu_check --dry-run`) the same tests run on
the CPU at tiny shapes, Triton under its interpreter."""

from __future__ import annotations

import pytest
import torch

from tests.support.gpu_models import DRY_RUN


@pytest.fixture(autouse=True)
def dry_run() -> bool:
    """Whether this is the CPU dry run; a test here is skipped without CUDA but in one."""
    if not (torch.cuda.is_available() or DRY_RUN):
        pytest.skip("needs a CUDA GPU")
    return DRY_RUN
