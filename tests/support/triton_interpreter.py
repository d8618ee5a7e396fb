"""Triton's kernels in the CPU tests: without CUDA they run under Triton's interpreter
(TRITON_INTERPRET=1), which executes every program in numpy, so shapes stay small; on
CUDA (`python -m bench.gpu_check`) the same tests run compiled kernels.

The interpreter is chosen when triton is first imported in the process (its builtins) and
when each kernel module is imported (its kernels): a test module calls `use_interpreter`
or `import_triton` before it imports any, and `interpreted` for each kernel module that an
earlier test module may have imported without it.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")


def use_interpreter() -> None:
    """TRITON_INTERPRET=1 without CUDA; call it before triton is first imported."""
    if not ON_CUDA:
        os.environ["TRITON_INTERPRET"] = "1"


def import_triton() -> ModuleType:
    """triton, under its interpreter without CUDA; the calling test module is skipped
    without triton."""
    use_interpreter()
    return pytest.importorskip("triton", reason="triton is not installed (pip install triton)")


def interpreted(module: ModuleType, kernel: str) -> ModuleType:
    """`module`, a kernel module with the kernel named `kernel`, its kernels under the
    interpreter without CUDA: reloaded in place when it was imported earlier in this
    process without the interpreter (code that reads the kernels from the module at each
    call then runs the interpreted ones). On CUDA, `module` as it is."""
    if ON_CUDA:
        return module
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(getattr(module, kernel), InterpretedFunction):
        module = importlib.reload(module)
    return module
