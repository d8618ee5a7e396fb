"""The `pagedserve` command: `pagedserve serve [flags]` and `pagedserve bench --url U ...`.

This module parses the server's flags; it turns them into the frozen configs of each
layer (ServerConfig, ModelConfig, SchedulerConfig; the CacheConfig follows from the KV
cache the runner allocates) and runs uvicorn. `bench` is the load generator's CLI
(loadgen/cli.py). Flag names follow vLLM's.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import FrameType
from typing import Any

from loadgen import cli as bench_cli
from loadgen.cli import API_KEY_ENV
from model_runner.config import ATTENTION_BACKENDS, KV_CACHE_DTYPES, WEIGHT_DTYPES, ModelConfig
from scheduler.config import SchedulerConfig, SpeculativeConfig
from server.batch.config import add_batch_arguments as _add_batch_arguments
from server.batch.config import batch_config
from server.config import ServerConfig
from server.limits import LIMIT_FLAGS, RequestLimits, flag_of
from server.lora import add_lora_arguments as _add_lora_arguments
from server.lora import lora_config
from server.reasoning import REASONING_PARSERS
from server.sizes import kv_cache_memory, parse_size
from server.slo import add_slo_arguments as _add_slo_arguments
from server.tenants import TenantRegistry, TenantsFileError
from server.tool_parsers import TOOL_PARSERS

logger = logging.getLogger("pagedserve")

METRICS_API_KEY_ENV = "PAGEDSERVE_METRICS_API_KEY"
_CPU_MAX_NUM_SEQS, _CPU_MAX_NUM_BATCHED_TOKENS = 128, 512
_CUDA_MAX_NUM_SEQS, _CUDA_MAX_NUM_BATCHED_TOKENS = 256, 8192


@dataclass(frozen=True)
class ServeConfigs:
    server: ServerConfig
    model: ModelConfig
    scheduler: SchedulerConfig
    enable_prefix_caching: bool
    simulate_step_ms: float | None = None
    stream_interval: int = 1
    data_parallel_size: int = 1


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `pagedserve serve`."""
    _add_lora_arguments(parser)
    _add_slo_arguments(parser)
    model = parser.add_argument_group("model")
    model.add_argument("--model", default=None,
                       help="Hugging Face folder or .gguf file (default: SmolLM2-135M-Instruct)")
    model.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="names clients may send as `model`, the first one reported "
                       "(default: from the model path)")
    model.add_argument("--chat-template", default=None, metavar="FILE",
                       help="a Jinja chat template file instead of the tokenizer's")
    model.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                       help="how tool calls are read from the output (needed for "
                       'tool_choice "auto")')
    model.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                       help="split <think> text into reasoning_content")
    model.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    model.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"),
                       default="auto", help="auto: float32 on the CPU, bfloat16 on CUDA")
    model.add_argument("--weight-dtype", choices=WEIGHT_DTYPES, default="auto",
                       help="float16: a float32 CPU model keeps its projection weights in "
                       "float16 (half the bytes per step, float32 sums; greedy output may "
                       "differ from float32 on a few tokens); bfloat16: its larger batches in "
                       "bfloat16 on oneDNN (AMX tiles where the CPU has them); int8: int8 "
                       "weights and activations (Hadamard-rotated, a grid per token; faster "
                       "than float16 from batch ~16 and in prefill, output drifts from float32 "
                       "as a quantized model's does)")
    model.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                       help="float16/bfloat16: a float32 CPU model keeps its KV cache in 2 "
                       "bytes (twice the blocks in --kv-cache-memory, half the attention "
                       "bytes; greedy output may differ from float32 on a few tokens)")
    model.add_argument("--max-model-len", type=int, default=None,
                       help="context length (default: the model's, capped by the KV cache)")
    model.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
                       help="auto: triton on CUDA, the C++ kernels (cpu) on the CPU when they "
                       "build, else the torch reference")
    model.add_argument("--enforce-eager", action="store_true",
                       help="CUDA: no CUDA graphs for decode")
    model.add_argument("--seed", type=int, default=0, help="seed of unseeded sampling")
    model.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                       help="shard the model over N ranks of this host: N GPUs on CUDA, N "
                       "processes sharing the cores on the CPU (default 1)")
    model.add_argument("--simulate-step-ms", type=float, default=None, metavar="MS",
                       help="benchmarking aid: no model weights; every step sleeps MS ms (as "
                       "a GPU step would, without CPU) and samples random tokens that are "
                       "never EOS, with the model's tokenizer")

    cache = parser.add_argument_group("KV cache")
    cache.add_argument("--block-size", type=int, default=16)
    cache.add_argument("--num-kv-blocks", type=int, default=None,
                       help="KV cache blocks (default: from the memory budget)")
    cache.add_argument("--kv-cache-memory", type=kv_cache_memory, default=None,
                       help="CPU KV cache budget, e.g. 2GiB, 512MiB or bytes (default auto: "
                       "half the memory available once the model is loaded; the pages are "
                       "taken as blocks are first written)")
    cache.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    cache.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=True, help="reuse cached KV blocks of shared prefixes")

    sched = parser.add_argument_group("scheduler")
    sched.add_argument("--scheduling-policy", "--policy", dest="scheduling_policy",
                       choices=("fcfs", "priority", "slo"), default="fcfs",
                       help="slo: priority first, then the requests' latency targets")
    sched.add_argument("--max-num-seqs", type=int, default=None,
                       help=f"running requests at most (default {_CPU_MAX_NUM_SEQS} on the "
                       f"CPU, {_CUDA_MAX_NUM_SEQS} on CUDA)")
    sched.add_argument("--max-num-batched-tokens", type=int, default=None,
                       help=f"tokens per step (default {_CPU_MAX_NUM_BATCHED_TOKENS} on the "
                       f"CPU, {_CUDA_MAX_NUM_BATCHED_TOKENS} on CUDA)")
    sched.add_argument("--priority-aging-s", type=float, default=None,
                       help="a waiting request gains one priority level per S seconds")
    sched.add_argument("--priority-aging-floor", type=int, default=0, metavar="P",
                       help="aging never takes a request past priority P, nor past its "
                       "tenant's max_priority (default: 0, the default priority: waiting "
                       "lifts background work to ordinary traffic, never above urgent)")
    sched.add_argument("--long-prefill-token-threshold", type=int, default=None,
                       help="a step that carries decodes computes at most max(N, 2 per "
                       "request of the batch) prefill tokens in all (a token at context c "
                       "counts as 1 + c/2048; a prompt within 1.5x of what is left goes "
                       "whole), so prompts do not stall every stream (default: a "
                       "sixteenth of --max-num-batched-tokens on the CPU, an eighth on "
                       "CUDA; 0: no cap)")
    sched.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                       default=None,
                       help="overlapped steps: schedule and lay out step n+1 while step n "
                       "runs on the device (default: on with CUDA, off on the CPU, where "
                       "the host is the device; not with --tensor-parallel-size > 1)")
    sched.add_argument("--speculative-config", default=None, metavar="JSON",
                       help="speculative decoding, vLLM's keys; method ngram (prompt "
                       "lookup): '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                       "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}' (and "
                       "prompt_lookup_window), or method draft_model: '{\"method\": "
                       "\"draft_model\", \"model\": PATH, \"num_speculative_tokens\": 4}' "
                       "(a checkpoint on the target's tokenizer; not with -tp > 1); and "
                       "max_num_verify_tokens; default: off; drafts go to the most urgent "
                       "requests first")
    sched.add_argument("--speculative-model", default=None, metavar="PATH",
                       help="the draft model: same as --speculative-config's "
                       "'{\"method\": \"draft_model\", \"model\": PATH}'")
    sched.add_argument("--watermark", type=float, default=0.0,
                       help="fraction of KV blocks admission leaves free for running "
                       "requests to grow into (default 0)")

    parallel = parser.add_argument_group("parallelism")
    parallel.add_argument("--data-parallel-size", "-dp", type=int, default=1, metavar="N",
                          help="N engine cores (each a whole copy of the model with its own "
                          "KV cache and its share of the CPU threads) behind one API "
                          "process; each request goes where it would start soonest")

    http = parser.add_argument_group("HTTP")
    http.add_argument("--host", default="127.0.0.1")
    http.add_argument("--port", type=int, default=8000)
    http.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                      help="require `Authorization: Bearer KEY` (not on /health, /metrics); "
                      f"default: ${API_KEY_ENV}, which keeps the key out of `ps`")
    http.add_argument("--metrics-api-key", metavar="KEY",
                      default=os.environ.get(METRICS_API_KEY_ENV) or None,
                      help="require `Authorization: Bearer KEY` on /metrics (default: open, "
                      f"as Prometheus expects; or ${METRICS_API_KEY_ENV})")
    http.add_argument("--tenants", default=None, metavar="FILE",
                      help="tenants (YAML, or TOML by suffix): API keys, priority bounds, "
                      "in-flight caps, token rates, fair-share weights, deadlines; "
                      "reloaded on SIGHUP (instead of --api-key)")
    http.add_argument("--max-waiting", type=int, default=None,
                      help="answer 503 while this many requests wait (default: no limit)")
    http.add_argument("--shutdown-grace-s", type=float, default=30.0,
                      help="on SIGTERM, how long in-flight requests may finish")
    http.add_argument("--step-timeout-s", type=float, default=300.0,
                      help="a step running longer marks the engine hung: /health and new "
                      "requests answer 503 until it returns")
    http.add_argument("--body-timeout-s", type=float, default=30.0,
                      help="a request body not received within this is a 408")
    http.add_argument("--limit-concurrency", type=int, default=None, metavar="N",
                      help="uvicorn answers 503 beyond N concurrent connections and tasks")
    http.add_argument("--stream-interval", type=int, default=1, metavar="N",
                      help="send a stream's tokens every N tokens (the first and the last "
                      "are never held back)")
    http.add_argument("--log-level", default="info",
                      choices=("critical", "error", "warning", "info", "debug"))
    _add_limit_arguments(parser)
    _add_batch_arguments(parser)


def _add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per request budget of server/limits.py, with its default."""
    limits = parser.add_argument_group(
        "request limits", "what one request may ask for; beyond each, a 400 (413 for the "
        "body) naming the limit and its flag"
    )
    defaults = RequestLimits()
    for name, text in LIMIT_FLAGS.items():
        default = getattr(defaults, name)
        if isinstance(default, bool):
            limits.add_argument(flag_of(name), action="store_true", help=text)
        elif name == "max_body_bytes":
            limits.add_argument(flag_of(name), type=parse_size, default=default,
                                help=f"{text} (default 8MiB)")
        else:
            limits.add_argument(flag_of(name), type=type(default), default=default,
                                help=f"{text} (default {default})")


def build_configs(args: argparse.Namespace, cuda: bool) -> ServeConfigs:
    """The layers' configs from parsed `serve` flags; ValueError on invalid values."""
    max_num_seqs = args.max_num_seqs or (_CUDA_MAX_NUM_SEQS if cuda else _CPU_MAX_NUM_SEQS)
    max_num_batched_tokens = args.max_num_batched_tokens or (
        _CUDA_MAX_NUM_BATCHED_TOKENS if cuda else _CPU_MAX_NUM_BATCHED_TOKENS
    )
    model = _model_config(args, max_num_seqs, max_num_batched_tokens)
    scheduler = _scheduler_config(args, cuda, max_num_seqs, max_num_batched_tokens)
    server = replace(_server_config(args), batch=batch_config(args, max_num_seqs))
    if args.simulate_step_ms is not None and args.simulate_step_ms < 0:
        raise ValueError("--simulate-step-ms must be >= 0")
    if args.simulate_step_ms is not None and args.tensor_parallel_size > 1:
        raise ValueError("--simulate-step-ms runs no model to shard: drop --tensor-parallel-size")
    if args.data_parallel_size < 1:
        raise ValueError("--data-parallel-size must be >= 1")
    if args.stream_interval < 1:
        raise ValueError("--stream-interval must be >= 1")
    return ServeConfigs(server, model, scheduler, args.enable_prefix_caching,
                        args.simulate_step_ms, args.stream_interval, args.data_parallel_size)


def _model_config(
    args: argparse.Namespace, max_num_seqs: int, max_num_batched_tokens: int
) -> ModelConfig:
    return ModelConfig(
        model=args.model,
        dtype=args.dtype,
        weight_dtype=args.weight_dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        device=args.device,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        seed=args.seed,
        tensor_parallel_size=args.tensor_parallel_size,
        lora=lora_config(args),
    )


def _scheduler_config(
    args: argparse.Namespace, cuda: bool, max_num_seqs: int, max_num_batched_tokens: int
) -> SchedulerConfig:
    scheduler = SchedulerConfig(
        policy=args.scheduling_policy,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        priority_aging_s=args.priority_aging_s,
        priority_aging_floor=args.priority_aging_floor,
        watermark=args.watermark,
        # NOTE: on the CPU a prefill token costs about what a decode does (both are
        # compute-bound rows of the same matmuls), so fewer go beside the decodes
        long_prefill_token_threshold=(
            max_num_batched_tokens // (8 if cuda else 16)
            if args.long_prefill_token_threshold is None
            else args.long_prefill_token_threshold
        ),
        fair_share=args.tenants is not None,
        background_priority=args.batch_priority,
        calibrate_step_cost=(args.scheduling_policy == "slo" if args.calibrate_step_cost
                             is None else args.calibrate_step_cost),
        async_scheduling=(
            cuda and args.tensor_parallel_size == 1 and args.simulate_step_ms is None
            if args.async_scheduling is None
            else args.async_scheduling
        ),
        speculative=(
            None if args.speculative_config is None and args.speculative_model is None
            else SpeculativeConfig.from_json(args.speculative_config or "{}",
                                             args.speculative_model)
        ),
    )
    if scheduler.speculative and scheduler.speculative.model and args.tensor_parallel_size > 1:
        raise ValueError("a draft model (speculative method draft_model) does not run with "
                         "--tensor-parallel-size > 1: use method ngram")
    if scheduler.async_scheduling and args.tensor_parallel_size > 1:
        raise ValueError("--async-scheduling does not run with --tensor-parallel-size > 1")
    return scheduler


def _server_config(args: argparse.Namespace) -> ServerConfig:
    names = args.served_model_name or [None]
    return ServerConfig(
        host=args.host,
        port=args.port,
        served_model_name=names[0],
        model_aliases=tuple(names[1:]),
        chat_template=_read_chat_template(args.chat_template),
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        api_key=args.api_key,
        metrics_api_key=args.metrics_api_key,
        tenants_file=args.tenants,
        max_waiting=args.max_waiting,
        shutdown_grace_s=args.shutdown_grace_s,
        step_timeout_s=args.step_timeout_s,
        body_timeout_s=args.body_timeout_s,
        limit_concurrency=args.limit_concurrency,
        log_level=args.log_level,
        default_slo_ttft_ms=args.default_slo_ttft_ms,
        default_slo_tpot_ms=args.default_slo_tpot_ms,
        runtime_lora_updating=args.enable_runtime_lora_updating,
        limits=RequestLimits(**{name: getattr(args, name) for name in LIMIT_FLAGS}),
    )


def _read_chat_template(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"cannot read --chat-template {path}: {exc}") from exc


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedserve", description="OpenAI-compatible LLM server with paged KV cache."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    add_serve_arguments(commands.add_parser("serve", help="run the HTTP server"))
    bench_cli.add_bench_arguments(
        commands.add_parser("bench", help="load-test an OpenAI-compatible server")
    )
    return parser


def _reload_tenants(tenants: TenantRegistry, path: str) -> None:
    """SIGHUP: the tenants file again; a bad file keeps the tenants as they were."""
    try:
        tenants.reload(path)
    except TenantsFileError as exc:
        logger.error("tenants not reloaded, the old ones stay: %s", exc)
        return
    logger.info("tenants reloaded from %s: %s", path, ", ".join(tenants.names))


def serve(configs: ServeConfigs) -> int:
    """Load the model, run the server until SIGTERM/SIGINT; 0 on a clean shutdown."""
    logger.info("starting: %s", configs)
    tenants_file = configs.server.tenants_file
    try:
        tenants = (TenantRegistry.from_file(tenants_file) if tenants_file is not None
                   else TenantRegistry.single(configs.server.api_key))
    except TenantsFileError as exc:
        logger.error("%s", exc)
        return 1
    host, port = configs.server.host, configs.server.port
    try:
        listener = _bind(host, port)
    except OSError as exc:
        logger.error("cannot listen on %s:%d: %s (set by --host and --port)", host, port,
                     exc.strerror or exc)
        return 1
    with listener:
        return _serve_on(listener, configs, tenants)


def _bind(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads, so that a taken port fails the
    start at once. NOTE: it listens only once uvicorn serves: until then connections are
    refused rather than left waiting in the backlog while the model loads."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def _serve_on(listener: socket.socket, configs: ServeConfigs, tenants: TenantRegistry) -> int:
    """Load the model and serve on `listener` (bound) until SIGTERM/SIGINT."""
    # NOTE: imported here so that `pagedserve bench` and --help import no engine.
    from engine.client import EngineClient, create_engine, start_engine
    from engine.core_client import EngineStartError
    from engine.core_process import freeze_startup_objects
    from engine.data_parallel import DataParallelEngine, create_data_parallel_engine
    from server.app import GracefulServer, build_app
    from server.batch.store import StoreError

    engine_kwargs: dict[str, Any] = dict(
        model_config=configs.model,
        scheduler_config=configs.scheduler,
        enable_prefix_caching=configs.enable_prefix_caching,
        served_model_name=configs.server.served_model_name,
        step_timeout_s=configs.server.step_timeout_s,
        simulate_step_ms=configs.simulate_step_ms,
        stream_interval=configs.stream_interval,
        log_level=configs.server.log_level,
        grammar_step_timeout_s=configs.server.limits.grammar_step_timeout_s,
    )
    engine: EngineClient | DataParallelEngine
    try:
        if configs.data_parallel_size > 1:
            engine = create_data_parallel_engine(
                configs.data_parallel_size, start_engine, **engine_kwargs
            )
        else:
            engine = create_engine(**engine_kwargs)
    except (FileNotFoundError, ValueError, EngineStartError) as exc:
        logger.error("cannot load the model: %s", exc)
        return 1
    # On SIGTERM: stop accepting, let in-flight requests run for the grace period, then
    # abort the rest (each client gets finish_reason "abort"), then exit.
    try:
        app = build_app(engine, configs.server, tenants)
    except StoreError as exc:
        logger.error("%s", exc)
        engine.shutdown()
        return 1
    # NOTE: after the app is built: its objects are start-up's too, and the heap its
    # admission freed (a scan of a 262k-token vocabulary: ~55 MB) goes back to the system
    freeze_startup_objects()
    server = GracefulServer(app, engine, configs.server)
    logger.info("serving %s on http://%s:%d", engine.info.model_name,
                configs.server.host, listener.getsockname()[1])
    # NOTE: once uvicorn has shut down gracefully it re-raises the signal that stopped
    # it; with the default handlers SIGTERM would then kill the process (status -15)
    # after a clean drain. These handlers only log, so a drained server exits 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _log_stop_signal)
    tenants_file = configs.server.tenants_file
    if tenants_file is not None:
        signal.signal(signal.SIGHUP, lambda *_: _reload_tenants(tenants, tenants_file))
    try:
        server.run(sockets=[listener])  # the app's lifespan stops the engine core on shutdown
    finally:
        engine.shutdown()  # idempotent; also when uvicorn failed to start
    return 0


def _log_stop_signal(signum: int, frame: FrameType | None) -> None:
    logger.info("stopped by %s", signal.Signals(signum).name)


def _has_cuda(device: str) -> bool:
    """Whether the engine core will run on CUDA (the defaults for a GPU). NOTE: torch is
    asked in a child process, and on Linux only where a GPU driver is loaded, so that the
    API process never imports it (~250 MB, ~1.5 s)."""
    if device != "auto":
        return device == "cuda"
    if sys.platform.startswith("linux") and not any(
            Path(p).exists() for p in ("/proc/driver/nvidia/version", "/dev/kfd")):
        return False
    probe = subprocess.run([sys.executable, "-c", _CUDA_PROBE], capture_output=True,
                           text=True, check=False)
    return probe.stdout.strip() == "True"


_CUDA_PROBE = "import torch; print(torch.cuda.is_available())"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `pagedserve` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "bench":
        return bench_cli.run(args, parser)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        configs = build_configs(args, cuda=_has_cuda(args.device))
    except ValueError as exc:
        parser.error(str(exc))
    return serve(configs)


if __name__ == "__main__":
    sys.exit(main())
