"""Builds and loads the C++ CPU kernels of csrc/ as torch ops (torch.ops.pagedserve.*).

`python -m model_runner.kernels.cpu_kernels` builds them ahead of time (`make install` does), into
torch's extension cache (TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions); later
loads reuse the build while the source and flags are unchanged. The build targets the
vector units torch detected (`torch.backends.cpu.get_cpu_capability()`), so one cache can
serve machines of different kinds.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sysconfig
from pathlib import Path

import torch

# every kernel file, and cpu_bindings.cpp, which registers all their ops (cpu_ops.h declares
# what it registers)
SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.cpp"))
HEADERS = sorted((Path(__file__).parent / "csrc").glob("*.h"))
# NOTE: -fopenmp compiles at::parallel_for's OpenMP loop (without it the kernels run on one
# thread); the GOMP symbols resolve to the libgomp torch has already loaded, so the
# extension does not link a second OpenMP runtime.
_COMMON_FLAGS = ["-O3", "-fopenmp", "-fno-math-errno"]
_CAPABILITY_FLAGS = {
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
    "AVX512": ["-mavx2", "-mfma", "-mf16c"],  # the kernels use 256-bit vectors
}


@functools.cache
def load_cpu_kernels() -> None:
    """Builds (first call on a machine) and loads the kernels once per process: paged
    attention and KV writes (cpu_attention.cpp), a float32 layer's norm, RoPE and
    SwiGLU (cpu_layers.cpp), the small-batch projections (cpu_matvec.cpp,
    cpu_matvec_int8.cpp, cpu_matvec_blocks.cpp, cpu_matvec_blocks_int8.cpp), a GGUF's
    blocks as stored at any batch (cpu_matvec_file_blocks.cpp), and a decode
    step's layers in one call (cpu_decode_stack.cpp, a torch class), all registered in
    cpu_bindings.cpp. Raises when they cannot be built (no C++ compiler, or no ninja)."""
    from torch.utils.cpp_extension import load

    _put_ninja_on_path()
    capability = torch.backends.cpu.get_cpu_capability()
    load(
        name=f"pagedserve_cpu_{capability.lower()}",
        sources=[str(source) for source in SOURCES],
        extra_cflags=[*_COMMON_FLAGS, *_CAPABILITY_FLAGS.get(capability, []), _headers_flag()],
        is_python_module=False,
    )


def _headers_flag() -> str:
    """A define naming the headers' contents: torch reuses a build while its sources and
    flags are unchanged, and hashes only the sources, so an edit to a header alone would
    load the old build."""
    digest = hashlib.sha1()
    for header in HEADERS:
        digest.update(header.read_bytes())
    return f"-DPAGEDSERVE_HEADERS={digest.hexdigest()[:16]}"


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the pip-installed one sits beside this Python, which
    is not on PATH when the venv is not activated (`.venv/bin/pagedserve serve`)."""
    if shutil.which("ninja") is None:
        scripts = sysconfig.get_path("scripts")
        os.environ["PATH"] = os.pathsep.join(filter(None, [scripts, os.environ.get("PATH")]))


MAX_HEAD_DIM = 256  # as in the source; head dims are multiples of 8 up to it


def cpu_kernels_error(head_dim: int) -> str | None:
    """None once the kernels are loaded and take `head_dim`, else why they cannot serve."""
    if head_dim % 8 or head_dim > MAX_HEAD_DIM:
        return (f"the C++ CPU kernels take head_dim in multiples of 8 up to {MAX_HEAD_DIM}, "
                f"not {head_dim}")
    return _build_error()


def cpu_kernels_available() -> bool:
    """Whether the kernels are loaded (built on the first call)."""
    return _build_error() is None


@functools.cache
def _build_error() -> str | None:
    """None once the kernels are loaded, else why they could not be (kept for the
    process: a failed build is not retried)."""
    try:
        load_cpu_kernels()
    except Exception as e:  # the compiler's and ninja's failures come in several types
        return f"the C++ CPU kernels could not be built: {e}"
    return None


if __name__ == "__main__":
    load_cpu_kernels()
    print(f"C++ CPU kernels built for {torch.backends.cpu.get_cpu_capability()}")
