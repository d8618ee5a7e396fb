"""`pagedserve` flags -> configs, and the configs' own validation."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys

import pytest

from engine.metrics import OTHER_PRIORITY, PriorityLabels
from scheduler.config import SpeculativeConfig
from server.cli import build_configs, build_parser, parse_size
from server.config import ServerConfig
from server.limits import RequestLimits


def configs(*flags: str, cuda: bool = False):
    args = build_parser().parse_args(["serve", *flags])
    return build_configs(args, cuda=cuda)


@pytest.mark.parametrize(
    ("text", "size"),
    [("2GiB", 2 * 1024**3), ("512MiB", 512 * 1024**2), ("1073741824", 1024**3),
     ("1.5GB", 1_500_000_000), ("2G", 2 * 1024**3), ("64k", 64 * 1024), ("10 MB", 10**7)],
)
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "GiB", "-1GiB", "2 parsecs", "0"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size(text)


def test_cpu_defaults() -> None:
    c = configs()
    assert c.server.host == "127.0.0.1" and c.server.port == 8000
    assert c.server.api_key is None and c.server.max_waiting is None
    assert c.scheduler.policy == "fcfs"
    assert (c.scheduler.max_num_seqs, c.scheduler.max_num_batched_tokens) == (128, 512)
    assert (c.model.max_num_seqs, c.model.max_num_batched_tokens) == (128, 512)
    assert c.model.model is None and c.model.kv_cache_memory is None  # auto
    assert configs("--kv-cache-memory", "auto").model.kv_cache_memory is None
    assert c.model.block_size == 16 and c.model.num_kv_blocks is None
    assert c.enable_prefix_caching


def test_replicas_on_one_machine_get_their_own_batch_store(monkeypatch, tmp_path) -> None:
    """The deployment doc's replicas (two `serve`s, ports 8001 and 8002, default flags) do
    not share a --data-dir, which admits one server; a restart on a port finds its own."""
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    dirs = [configs("--port", port).server.batch.data_dir for port in ("8001", "8002", "8001")]
    assert dirs[0] != dirs[1] and dirs[0] == dirs[2]
    assert all(d.parent == tmp_path / "pagedserve" for d in dirs)
    explicit = configs("--port", "8001", "--data-dir", str(tmp_path / "mine"))
    assert explicit.server.batch.data_dir == tmp_path / "mine"


def test_cuda_defaults() -> None:
    c = configs(cuda=True)
    assert (c.scheduler.max_num_seqs, c.scheduler.max_num_batched_tokens) == (256, 8192)


def test_every_flag_reaches_its_config() -> None:
    c = configs(
        "--model", "/m", "--served-model-name", "m", "--host", "0.0.0.0", "--port", "9",
        "--policy", "priority", "--device", "cpu", "--dtype", "bfloat16", "--block-size", "32",
        "--num-kv-blocks", "100", "--kv-cache-memory", "512MiB",
        "--gpu-memory-utilization", "0.5", "--max-num-seqs", "4",
        "--max-num-batched-tokens", "256", "--max-model-len", "512",
        "--no-enable-prefix-caching", "--priority-aging-s", "2.5", "--max-waiting", "10",
        "--priority-aging-floor", "-3",
        "--api-key", "k", "--enforce-eager", "--attention-backend", "torch", "--seed", "3",
        "--shutdown-grace-s", "1", "--log-level", "warning", "--weight-dtype", "float16",
        "--kv-cache-dtype", "bfloat16",
    )
    m, s, srv = c.model, c.scheduler, c.server
    assert (m.model, m.device, m.dtype, m.block_size, m.num_kv_blocks) == (
        "/m", "cpu", "bfloat16", 32, 100)
    assert (m.kv_cache_memory, m.gpu_memory_utilization, m.max_model_len) == (
        512 * 1024**2, 0.5, 512)
    assert (m.enforce_eager, m.attention_backend, m.seed, m.weight_dtype, m.kv_cache_dtype) == (
        True, "torch", 3, "float16", "bfloat16")
    assert (s.policy, s.max_num_seqs, s.max_num_batched_tokens, s.priority_aging_s) == (
        "priority", 4, 256, 2.5)
    assert s.priority_aging_floor == -3
    assert (srv.served_model_name, srv.host, srv.port, srv.api_key, srv.max_waiting) == (
        "m", "0.0.0.0", 9, "k", 10)
    assert (srv.shutdown_grace_s, srv.log_level) == (1.0, "warning")
    assert not c.enable_prefix_caching


def test_scheduler_budget_flags_reach_the_scheduler() -> None:
    s = configs("--watermark", "0.1", "--long-prefill-token-threshold", "128").scheduler
    assert (s.watermark, s.long_prefill_token_threshold) == (0.1, 128)
    d = configs().scheduler  # the CPU: a sixteenth of the budget, CUDA: an eighth
    assert (d.watermark, d.long_prefill_token_threshold) == (0.0, 512 // 16)
    assert configs(cuda=True).scheduler.long_prefill_token_threshold == 8192 // 8
    uncapped = configs("--long-prefill-token-threshold", "0").scheduler
    assert uncapped.long_prefill_token_threshold == 0


def test_tensor_parallel_size_flag() -> None:
    assert configs().model.tensor_parallel_size == 1
    assert configs("-tp", "2").model.tensor_parallel_size == 2
    assert configs("--tensor-parallel-size", "4").model.tensor_parallel_size == 4


def test_scheduling_policy_long_name() -> None:
    assert configs("--scheduling-policy", "priority").scheduler.policy == "priority"


@pytest.mark.parametrize(
    "flags",
    [["--policy", "lifo"], ["--block-size", "x"], ["--kv-cache-memory", "lots"],
     ["--device", "tpu"], ["--weight-dtype", "int4"]],
)
def test_bad_flags_exit_2(flags: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", *flags])
    assert exc.value.code == 2


@pytest.mark.parametrize("flags", [["--max-num-seqs", "-1"], ["--port", "70000"],
                                   ["--max-waiting", "0"], ["--num-kv-blocks", "0"],
                                   ["-tp", "0"], ["-tp", "2", "--simulate-step-ms", "5"]])
def test_invalid_values_raise_value_error(flags: list[str]) -> None:
    with pytest.raises(ValueError):
        configs(*flags)


def test_api_key_stays_out_of_repr() -> None:
    config = ServerConfig(api_key="top-secret", metrics_api_key="scrape-secret")
    for secret in ("top-secret", "scrape-secret"):
        assert secret not in repr(config) and secret not in str(config)


@pytest.mark.parametrize(
    "fields",
    [{"port": -1}, {"api_key": ""}, {"metrics_api_key": ""}, {"served_model_name": " "},
     {"shutdown_grace_s": -1}, {"log_level": "loud"}],
)
def test_server_config_validation(fields: dict) -> None:
    with pytest.raises(ValueError):
        ServerConfig(**fields)


@pytest.mark.parametrize("fields", [{"max_body_bytes": 10}, {"max_n": 0},
                                    {"grammar_timeout_s": 0.0}])
def test_request_limits_validation(fields: dict) -> None:
    with pytest.raises(ValueError, match="--"):
        RequestLimits(**fields)


def test_priority_labels_are_bounded() -> None:
    labels = PriorityLabels(limit=3)
    assert [labels(p) for p in (0, 5, 0, -1, 7, 5, 8)] == ["0", "5", "0", "-1", OTHER_PRIORITY,
                                                           "5", OTHER_PRIORITY]


def test_api_key_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("PAGEDSERVE_API_KEY", "from-env")
    assert configs().server.api_key == "from-env"
    assert configs("--api-key", "flag").server.api_key == "flag"


def test_aging_stops_at_the_default_priority_by_default() -> None:
    assert configs("--priority-aging-s", "5").scheduler.priority_aging_floor == 0


def test_metrics_api_key_from_the_flag_or_the_environment(monkeypatch) -> None:
    assert configs().server.metrics_api_key is None  # /metrics open by default
    assert configs("--metrics-api-key", "m").server.metrics_api_key == "m"
    monkeypatch.setenv("PAGEDSERVE_METRICS_API_KEY", "from-env")
    assert configs().server.metrics_api_key == "from-env"


def test_simulate_step_ms_reaches_the_configs() -> None:
    assert configs().simulate_step_ms is None
    assert configs("--simulate-step-ms", "2.5").simulate_step_ms == 2.5
    with pytest.raises(ValueError):
        configs("--simulate-step-ms", "-1")


def test_async_scheduling_is_on_with_cuda_and_off_on_the_cpu() -> None:
    assert configs(cuda=True).scheduler.async_scheduling
    assert not configs(cuda=False).scheduler.async_scheduling
    assert not configs("-tp", "2", cuda=True).scheduler.async_scheduling
    assert not configs("--simulate-step-ms", "5", cuda=True).scheduler.async_scheduling
    assert configs("--async-scheduling", cuda=False).scheduler.async_scheduling
    assert not configs("--no-async-scheduling", cuda=True).scheduler.async_scheduling
    with pytest.raises(ValueError, match="tensor-parallel"):
        configs("--async-scheduling", "-tp", "2")


def test_a_taken_port_fails_the_start_before_the_model_loads() -> None:
    """Exit 1 with one line naming the port, and nothing loaded first: the port is bound
    before the model loads."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "server.cli", "serve", "--simulate-step-ms", "1",
             "--port", str(port)],
            capture_output=True, text=True, timeout=120,
        )
    assert done.returncode == 1, done.stderr
    lines = done.stderr.splitlines()
    assert [line for line in lines if "starting:" not in line] == [
        next(line for line in lines if "ERROR" in line)]
    assert f"127.0.0.1:{port}" in lines[-1] and "Address already in use" in lines[-1]


def test_speculative_config_takes_vllms_json() -> None:
    assert configs().scheduler.speculative is None
    spec = configs("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, '
                   '"prompt_lookup_max": 5, "prompt_lookup_min": 1}').scheduler.speculative
    assert spec == SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=5,
                                     prompt_lookup_min=1)


def test_speculative_model_is_a_draft_model_in_the_speculative_config() -> None:
    spec = configs("--speculative-model", "/m", "--speculative-config",
                   '{"num_speculative_tokens": 2}').scheduler.speculative
    assert spec == SpeculativeConfig(method="draft_model", model="/m", num_speculative_tokens=2)
    with pytest.raises(ValueError, match="tensor-parallel-size"):
        configs("--speculative-config", '{"model": "/m"}', "-tp", "2")


@pytest.mark.parametrize(("text", "needle"), [
    ("{nope", "not JSON"),
    ("[4]", "JSON object"),
    ('{"method": "eagle"}', "eagle"),
    ('{"num_speculative_tokens": 4, "lookahead": 2}', "lookahead"),
    ('{"num_speculative_tokens": "4"}', "num_speculative_tokens must be int"),
    ('{"num_speculative_tokens": true}', "num_speculative_tokens must be int"),
    ('{"num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"prompt_lookup_min": 5, "prompt_lookup_max": 2}', "prompt_lookup_min"),
])
def test_a_bad_speculative_config_says_why(text: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        configs("--speculative-config", text)


def test_lora_flags_reach_the_model_and_server_configs() -> None:
    served = configs("--enable-lora", "--lora-modules", "sql=/a/sql", "chat=/a/chat",
                         "--max-loras", "2", "--max-lora-rank", "32", "--max-cpu-loras", "3",
                         "--enable-runtime-lora-updating")
    lora = served.model.lora
    assert lora is not None and lora.modules == (("sql", "/a/sql"), ("chat", "/a/chat"))
    assert (lora.max_loras, lora.max_lora_rank, lora.cpu_loras) == (2, 32, 3)
    assert served.server.runtime_lora_updating
    assert configs().model.lora is None
    assert configs("--enable-lora", "-tp", "2").model.lora is not None  # each rank its slice


@pytest.mark.parametrize(("flags", "needle"), [
    (["--lora-modules", "sql=/a"], "--lora-modules needs --enable-lora"),
    (["--enable-lora", "--lora-modules", "sql"], "expected NAME=PATH"),
    (["--enable-lora", "--lora-modules", "a=/x", "a=/y"], "share a name"),
    (["--enable-lora", "--max-loras", "2", "--max-cpu-loras", "1"], "max_cpu_loras"),
])
def test_bad_lora_flags_are_refused_naming_them(flags: list[str], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        configs(*flags)
