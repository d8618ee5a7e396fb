"""What the GPU check's parts share: the result record, the budget, the device sync and
release, and the Qwen3-0.6B-shaped random model. The random-weight models and the engine
step without HTTP are tests/support/gpu_models.py's, shared with the GPU tests."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.gpu_models import device_for, random_model_folder

TOTAL_BUDGET_S = 8 * 60
GPU_TESTS_TIMEOUT_S = 300
H200_HBM_BYTES_PER_S = 4.8e12
# the GPU tests, and the kernel and CUDA-graph tests of the runner, compiled on CUDA
TEST_PATHS = ["tests/gpu", "tests/runner/test_triton_attention.py",
              "tests/runner/test_triton_layers.py", "tests/runner/test_triton_moe.py",
              "tests/runner/test_triton_lora.py", "tests/runner/test_cuda_graphs.py"]


@dataclass
class PartResult:
    name: str
    status: str  # "pass", "fail" or "skipped: <reason>"
    seconds: float = 0.0
    detail: str = ""
    rows: list[dict] = field(default_factory=list)  # tables for the markdown report

    @property
    def failed(self) -> bool:
        return self.status == "fail"


_deadline = float("inf")  # time.monotonic() at which the whole check's budget ends

# Qwen3-0.6B's sizes (its config.json), for a model with random weights.
QWEN3_0_6B = dict(
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128,
    max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    bos_token_id=151643, eos_token_id=151645,
)
QWEN3_TINY = dict(QWEN3_0_6B, vocab_size=512, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)


def start_budget() -> float:
    """Start the whole check's budget of TOTAL_BUDGET_S; returns its deadline."""
    global _deadline
    _deadline = time.monotonic() + TOTAL_BUDGET_S
    return _deadline


def time_left() -> float:
    return _deadline - time.monotonic()


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_device_memory() -> None:
    """What the last part held on the device, given back before the next one."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


_qwen3_cache: dict[bool, tuple[Path, object]] = {}


def qwen3_model(dry_run: bool) -> tuple[Path, object]:
    """The Qwen3-0.6B-shaped random model (a tiny one in a dry run): its folder and the
    Hugging Face model (bf16 on the device), built once per process."""
    if dry_run not in _qwen3_cache:
        import atexit
        import shutil
        import tempfile

        import torch
        from transformers import Qwen3Config

        folder = Path(tempfile.mkdtemp(prefix="gpu_check_qwen3_"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        config = Qwen3Config(**(QWEN3_TINY if dry_run else QWEN3_0_6B))
        hf = random_model_folder(config, folder, torch.bfloat16, device_for(dry_run))
        _qwen3_cache[dry_run] = (folder, hf)
    return _qwen3_cache[dry_run]
