"""Build what the engine core runs: the model runner (or the simulated one), the
scheduler that matches the KV cache the runner allocated, and the grammar state of
structured outputs (on the model's tokenizer)."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

from engine.calibration import calibrate
from engine.messages import CoreInfo
from kvcache.config import CacheConfig
from model_runner.config import LoRAConfig, ModelConfig
from model_runner.distributed.tp_workers import start_tensor_parallel
from model_runner.loader import LoadedModel, ModelSpec, load_model, load_model_spec
from model_runner.models.sliding_windows import model_window
from model_runner.runner import ModelRunner
from model_runner.simulated_runner import SimulatedRunner
from model_runner.tokenizer_files import TokenizerFiles
from scheduler.config import SchedulerConfig
from scheduler.scheduler import Scheduler
from structured.compiler import GrammarCompiler, build_ll_tokenizer, fast_tokenizer_json
from structured.matchers import StructuredOutputs

logger = logging.getLogger(__name__)


def build_core_parts(
    model_config: ModelConfig,
    scheduler_config: SchedulerConfig,
    *,
    enable_prefix_caching: bool = True,
    served_model_name: str | None = None,
    simulate_step_ms: float | None = None,
    grammar_step_timeout_s: float | None = None,
) -> tuple[Scheduler, ModelRunner | SimulatedRunner, CoreInfo, StructuredOutputs]:
    """Load the model (with `simulate_step_ms`, only its config and tokenizer, for a
    SimulatedRunner), size the KV cache and build the scheduler that matches it. With
    model_config.tensor_parallel_size > 1 this process is rank 0 and the other ranks'
    worker processes start here (model_runner/distributed/tp_workers.py); a worker that
    dies later ends this process.

    The context length is the model's (or model_config.max_model_len), capped to what
    the KV cache holds. A draft model (scheduler_config.speculative, method draft_model)
    loads beside the target, on the same device and dtype. Loading errors
    (FileNotFoundError, ValueError: the draft model's included) are raised here.
    `grammar_step_timeout_s` is the steps' grammar-mask deadline (StructuredOutputs).
    """
    speculative = scheduler_config.speculative
    draft_path = None if speculative is None else speculative.model
    runner, model = _load_runner(model_config, simulate_step_ms, draft_path)
    model_len = model.max_model_len
    cache_config = CacheConfig(
        num_blocks=runner.num_kv_blocks,
        block_size=runner.block_size,
        enable_prefix_caching=enable_prefix_caching,
        # NOTE: only a model windowed in every layer frees a request's blocks early
        sliding_window=model_window(model.hf_config),
    )
    lora = model_config.lora
    scheduler_config = replace(scheduler_config, max_model_len=model_len,
                               max_loras=None if lora is None else lora.max_loras,
                               max_cpu_loras=None if lora is None else lora.cpu_loras)
    scheduler = Scheduler(scheduler_config, cache_config)
    _calibrate(runner, scheduler)
    if lora is not None:
        _load_loras(lora, runner, scheduler)
    # NOTE: the scheduler caps a request's length to what the KV pool holds, so that a
    # lone request can always run to its end; the HTTP checks use that same limit.
    max_model_len = scheduler.max_request_len
    if max_model_len < model_len:
        logger.warning(
            "max_model_len %d capped to %d, what the KV cache holds (%d blocks of %d)",
            model_len, max_model_len, runner.num_kv_blocks, runner.block_size,
        )
    info = CoreInfo(
        model_name=served_model_name or model.served_model_name,
        max_model_len=max_model_len,
        vocab_size=int(model.hf_config.vocab_size),
        policy=scheduler_config.policy,
        eos_token_ids=sorted(model.eos_token_ids),
        cache_config=cache_config,
        loras=None if lora is None else dict(lora.modules),
    )
    structured = _structured_outputs(model.tokenizer, info, grammar_step_timeout_s)
    info.structured_outputs = True
    return scheduler, runner, info, structured


def _load_runner(
    model_config: ModelConfig, simulate_step_ms: float | None, draft_path: str | None
) -> tuple[ModelRunner | SimulatedRunner, LoadedModel | ModelSpec]:
    """The runner and what it was loaded from (with `simulate_step_ms`, only the model's
    config and tokenizer: a simulated runner proposes no drafts)."""
    if simulate_step_ms is not None:
        spec = load_model_spec(model_config)
        return SimulatedRunner(spec, model_config, simulate_step_ms), spec
    if draft_path is not None and model_config.tensor_parallel_size > 1:
        raise ValueError("a draft model (speculative method draft_model) does not run with "
                         "--tensor-parallel-size > 1: use method ngram")
    if model_config.tensor_parallel_size > 1:
        loaded, runner = start_tensor_parallel(model_config)
        return runner, loaded
    loaded = load_model(model_config, with_tokenizer=False)
    draft = None
    if draft_path is not None:
        draft = load_model(replace(model_config, model=draft_path,
                                   max_model_len=loaded.max_model_len), with_tokenizer=False)
        logger.info("draft model %s loaded", draft.model_path)
    return ModelRunner(loaded, model_config, draft=draft), loaded


def _calibrate(runner: ModelRunner | SimulatedRunner, scheduler: Scheduler) -> None:
    """Seed the step-cost model from a few timed steps of `runner` (engine/calibration.py),
    when the config asks for it."""
    config = scheduler.config
    if not config.calibrate_step_cost:
        return
    start = time.perf_counter()
    calibration = calibrate(runner, config.step_cost_seed, config.max_num_seqs,
                            config.max_num_batched_tokens)
    seconds = time.perf_counter() - start
    scheduler.slo.calibrated(calibration, seconds)
    logger.info("step cost calibrated in %.2f s: %s", seconds, calibration.cost)


def _load_loras(
    config: LoRAConfig, runner: ModelRunner | SimulatedRunner, scheduler: Scheduler
) -> None:
    """Check every --lora-modules folder against the model (a bad one fails the start,
    naming it: AdapterError); the first --max-cpu-loras are read and stay loaded, the
    others are read when their requests come. The simulated runner has no weights to
    check: its adapters are only names."""
    holder = getattr(runner, "loras", None)
    for index, (name, path) in enumerate(config.modules):
        keep = index < config.cpu_loras
        if holder is not None:
            holder.paths[name] = path
            if keep:
                holder.add(holder.read(name, path))
            else:  # read when its requests come
                holder.check(name, path)
        if keep:
            scheduler.lora_loaded(name)
    logger.info("LoRA adapters: %s", ", ".join(name for name, _ in config.modules) or "none")


def _structured_outputs(
    tokenizer: Any, info: CoreInfo, step_timeout_s: float | None
) -> StructuredOutputs:
    """Grammar state on the model's tokenizer (or its files). Its llguidance tokenizer
    builds on the compile thread at the first constrained request, which waits for it
    (~1-3 s and ~150-250 MB for a 262k-token vocabulary, off the start and out of a server
    never asked for a grammar; NOTE: the build holds the GIL, the steps wait with it).
    Where llguidance cannot read the tokenizer (it needs a fast one), constrained requests
    fail, naming why (the API process, which reads the same tokenizer, refuses them
    first)."""

    def build() -> Any:
        try:
            tokenizer_json = (tokenizer.llguidance_json() if isinstance(tokenizer, TokenizerFiles)
                              else fast_tokenizer_json(tokenizer))
            return build_ll_tokenizer(tokenizer_json, info.vocab_size, info.eos_token_ids)
        except ValueError as exc:
            logger.warning("structured outputs are off: %s", exc)
            raise ValueError(f"structured outputs are not available: {exc}") from exc

    return StructuredOutputs(GrammarCompiler(build), step_timeout_s)
