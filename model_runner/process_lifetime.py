"""A child process that must not outlive its parent (the engine core, a TP worker)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1
# the engine core's exit status after one of its tensor-parallel workers died (read by the
# API process, which imports no worker code)
WORKER_DIED_EXIT_CODE = 3


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent dies (Linux: PR_SET_PDEATHSIG); exit at once
    if the parent is gone already (it died before the call)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:
        sys.exit(1)
