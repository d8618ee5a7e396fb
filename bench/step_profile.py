"""Where one decode step of a model goes, component by component.

`python -m bench.step_profile [--model PATH] [--weight-dtype auto|float16|int8] [--kv-cache-dtype
auto|float16] [--requests 1] [--steps 48] [--threads N] [--paired-matvec |
--paired-decode-stack | --bandwidth]`

The model is the default one, or --model's (a GGUF file or a checkpoint folder).
One greedy request (32 prompt tokens, `ignore_eos`), or --requests of them decoding
together (a step of that many rows), through the engine core's own step
(`EngineCore.step`: scheduler, runner, update) in this process, then what carries its
token to the client: the step message encoded, sent over a pyzmq `ipc://` pair and
decoded, and the token detokenized. Each component is timed by wrapping the function
that does it, per step; the table gives the median over the steps (after a warm-up) and
its share of the total. The step's torch ops come from torch.profiler over as many more
steps: one row per op, and the Python around them (the step's median less the ops' own;
the profiler's own overhead inflates the ops a little). What the API process does beyond
detokenizing (metrics, the SSE chunk, HTTP) is not in the table: the server's TPOT
(bench.compare, W0) less this total.

`--paired-matvec` measures the C++ matvecs of small batches (the kernel table's paths,
model_runner/kernels/cpu_kernel_table.py) against the GEMM they replace (oneDNN, or fbgemm
for float16 and int8 weights) in the same process instead: steps alternate between the
model's table and one of no rows (`use_kernel_table`), and the table gives each one's
median step and the median ratio of neighbouring steps, which a machine shared with others
disturbs least.

`--paired-decode-stack` measures the same way a decode step in the C++ decode stack
(model_runner/models/decode_stack.py) against the Python layers it replaces.

`--bandwidth` measures, with no model, what one row reads per second: a plain read (torch's
sum over 128 MB of float32) against each dtype's matvec and GEMM at one row, on weights of
the default model's MLP shape, 128 MB of them in turn, so that none stays in the caches.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import zmq
from torch.profiler import ProfilerActivity, profile

import model_runner.runner as runner_module
from engine.core import EngineCore
from engine.detokenizer import IncrementalDetokenizer
from engine.messages import AddRequests, NewRequest, output_decoder, output_encoder
from kvcache.config import CacheConfig
from model_runner.config import ModelConfig
from model_runner.loader import load_model
from model_runner.runner import LaunchedStep, ModelRunner
from model_runner.sampler import Sampler
from scheduler.config import SchedulerConfig
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler

PROMPT_LEN = 32
WARMUP_STEPS = 4


class Timers:
    """Per-step durations of wrapped functions, by label."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = defaultdict(list)

    def wrap(self, owner: Any, name: str, label: str) -> None:
        """Replace `owner.name` (an instance's or a class's function) by a timed call."""
        inner = getattr(owner, name)
        times = self.times[label]

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                times.append(time.perf_counter() - start)

        setattr(owner, name, timed)

    def timed(self, label: str, fn: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        result = fn()
        self.times[label].append(time.perf_counter() - start)
        return result

    def clear(self) -> None:
        for times in self.times.values():
            times.clear()


def build_core(args: argparse.Namespace) -> tuple[EngineCore, ModelRunner, Any]:
    config = ModelConfig(
        model=args.model, dtype="float32", weight_dtype=args.weight_dtype,
        kv_cache_dtype=args.kv_cache_dtype, device="cpu", num_kv_blocks=64 * args.requests,
    )
    loaded = load_model(config)
    runner = ModelRunner(loaded, config)
    cache = CacheConfig(num_blocks=runner.num_kv_blocks, block_size=runner.block_size)
    scheduler = Scheduler(SchedulerConfig(max_model_len=loaded.max_model_len), cache)
    return EngineCore(scheduler, runner, loaded.eos_token_ids), runner, loaded.tokenizer


def instrument(core: EngineCore, runner: ModelRunner, timers: Timers) -> None:
    """Time the components of a step where they are called (bench only: patched for good)."""
    timers.wrap(core.scheduler, "schedule", "scheduler: schedule()")
    timers.wrap(runner_module, "prepare_inputs", "runner: layout (prepare_inputs)")
    timers.wrap(runner.model, "forward", "runner: forward (layers, final norm)")
    timers.wrap(runner.model, "compute_logits", "runner: LM head")
    timers.wrap(Sampler, "__call__", "runner: sampler")
    timers.wrap(LaunchedStep, "result", "runner: sampled ids to the host")
    timers.wrap(core.scheduler, "update", "scheduler: update()")


def carry(message: Any, timers: Timers, push: zmq.Socket, pull: zmq.Socket,
          detokenizer: IncrementalDetokenizer) -> None:
    """The step message to the API side and its token to text, each part timed."""
    data = timers.timed("message: encode (msgspec)", lambda: output_encoder.encode(message))
    timers.timed("message: zmq ipc send + receive", lambda: (push.send(data), pull.recv()))
    decoded = timers.timed("message: decode (msgspec)", lambda: output_decoder.decode(data))
    new_ids = [t for delta in decoded.deltas for t in delta.new_token_ids]
    timers.timed("API: detokenize", lambda: detokenizer.step(new_ids))


def op_table(prof: Any, num_steps: int, step_ms: float) -> list[tuple[str, float, float]]:
    """(op, ms per step, calls per step) of the step's torch ops (forward, LM head,
    sampler), and the Python around them (the step's median time less the ops')."""
    rows = []
    for event in prof.key_averages():
        if event.key.startswith("ProfilerStep") or event.self_cpu_time_total <= 0:
            continue
        rows.append((event.key, event.self_cpu_time_total / 1000 / num_steps,
                     event.count / num_steps))
    rows.sort(key=lambda row: -row[1])
    ops_ms = sum(ms for _, ms, _ in rows)
    return [*rows, ("(Python and dispatch around the ops)", max(0.0, step_ms - ops_ms), 0)]


def paired_matvec(core: EngineCore, runner: ModelRunner, num_pairs: int) -> None:
    """Steps alternately with and without the small-batch matvecs; prints the medians."""
    # NOTE: imported here, so that the profile runs on a tree without the kernel table too
    from model_runner.kernels.cpu_kernel_table import DEFAULT_TABLE, GEMM_ONLY

    def use_matvec(on: bool) -> None:
        runner.model.use_kernel_table(DEFAULT_TABLE if on else GEMM_ONLY)

    paired(core, num_pairs, use_matvec, ("matvec", "GEMM"))


def paired_decode_stack(core: EngineCore, runner: ModelRunner, num_pairs: int) -> None:
    """Steps alternately in the C++ decode stack and in the Python layers; the medians."""
    stack = runner.model.decode_stack
    if stack is None:
        raise SystemExit("this model and weight dtype have no decode stack")

    def use_stack(on: bool) -> None:
        runner.model.decode_stack = stack if on else None

    paired(core, num_pairs, use_stack, ("decode stack", "Python layers"))


def paired(core: EngineCore, num_pairs: int, switch: Callable[[bool], None],
           names: tuple[str, str]) -> None:
    """Steps alternately with `switch(True)` and `switch(False)`: each one's median step
    and the median ratio of neighbouring steps, which a shared machine disturbs least."""
    on, off = [], []
    for _ in range(num_pairs):
        for times, state in ((on, True), (off, False)):
            switch(state)
            start = time.perf_counter()
            core.step()
            times.append(time.perf_counter() - start)
    switch(True)
    ratio = statistics.median(b / a for a, b in zip(on, off, strict=True))
    print(f"| step | {names[0]} ms | {names[1]} ms | {names[1]} / {names[0]} (median of pairs) |"
          "\n|---|---|---|---|")
    print(f"| batch-{len(core.scheduler.running)} decode | {statistics.median(on) * 1000:.2f} | "
          f"{statistics.median(off) * 1000:.2f} | {ratio:.2f} |")


BANDWIDTH_BYTES = 128 << 20  # of weights per dtype, four times the L3 cache here
MLP_SHAPE = (3072, 576)  # the default model's fused gate and up projection, [out, in]


def bandwidth(repeats: int = 7) -> None:
    """GB/s of a plain read and of one row's projections (see the module's docstring)."""
    from model_runner.kernels import cpu_linear
    from model_runner.kernels.cpu_kernel_table import DEFAULT_TABLE, GEMM_ONLY

    def gb_per_s(fn: Callable[[], Any], num_bytes: int) -> float:
        fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return num_bytes / statistics.median(times) / 1e9

    plain = torch.ones(BANDWIDTH_BYTES // 4)
    print(f"{torch.get_num_threads()} threads, one row, median of {repeats}\n")
    print("| read | GB/s |\n|---|---|")
    print(f"| plain read (torch.sum, float32) | {gb_per_s(plain.sum, BANDWIDTH_BYTES):.1f} |")
    del plain
    x = torch.randn(1, MLP_SHAPE[1])
    for weight_dtype, element_size in (("auto", 4), ("float16", 2), ("int8", 1)):
        count = BANDWIDTH_BYTES // (element_size * MLP_SHAPE[0] * MLP_SHAPE[1])
        weights = [cpu_linear.pack_linear(torch.randn(MLP_SHAPE) * 0.05, None, weight_dtype)
                   for _ in range(count)]
        num_bytes = count * element_size * MLP_SHAPE[0] * MLP_SHAPE[1]

        def run_all(weights: list[Any] = weights) -> None:
            for packed in weights:
                packed(x)

        for label, table in (("matvec", DEFAULT_TABLE), ("GEMM", GEMM_ONLY)):
            for packed in weights:
                packed.use_table(table)
            print(f"| {weight_dtype} {label} | {gb_per_s(run_all, num_bytes):.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None,
                        help="a GGUF file or checkpoint folder instead of the default model")
    parser.add_argument("--weight-dtype", default="auto")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--requests", type=int, default=1,
                        help="requests decoding together: the step's rows")
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--paired-matvec", action="store_true",
                        help="only the matvec against the GEMM, steps alternating")
    parser.add_argument("--paired-decode-stack", action="store_true",
                        help="only the C++ decode stack against the Python layers, alternating")
    parser.add_argument("--bandwidth", action="store_true",
                        help="only the GB/s of a plain read and of one row's projections")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.bandwidth:
        bandwidth()
        return
    core, runner, tokenizer = build_core(args)
    prompt = list(range(1000, 1000 + PROMPT_LEN))
    params = SamplingParams(temperature=0.0, max_tokens=2 * (args.steps + WARMUP_STEPS) + 4,
                            ignore_eos=True)
    core.apply(AddRequests([
        NewRequest(request_id=f"r{i}", prompt_token_ids=[t + i for t in prompt],
                   sampling_params=params) for i in range(args.requests)]))
    if args.paired_matvec or args.paired_decode_stack:
        for _ in range(WARMUP_STEPS + 1):
            core.step()
        if args.paired_matvec:
            paired_matvec(core, runner, args.steps // 2)
        else:
            paired_decode_stack(core, runner, args.steps // 2)
        return
    timers = Timers()
    instrument(core, runner, timers)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    context = zmq.Context()
    with tempfile.TemporaryDirectory() as folder:
        pull = context.socket(zmq.PULL)
        pull.bind(f"ipc://{folder}/outputs")
        push = context.socket(zmq.PUSH)
        push.connect(f"ipc://{folder}/outputs")

        def one_step() -> None:
            message = timers.timed("engine core: step() in all", core.step)
            carry(message, timers, push, pull, detokenizer)

        for _ in range(WARMUP_STEPS + 1):  # the prefill, then warm decodes
            one_step()
        timers.clear()
        for _ in range(args.steps):
            one_step()
        step_times = {label: statistics.median(t) * 1000 for label, t in timers.times.items()}
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                core.step()
        push.close(0)
        pull.close(0)
    context.term()
    print_tables(args, step_times, op_table(
        prof, args.steps, step_times["engine core: step() in all"]))


def print_tables(args: argparse.Namespace, step_times: dict[str, float],
                 ops: list[tuple[str, float, float]]) -> None:
    step_ms = step_times["engine core: step() in all"]
    carried = sum(ms for label, ms in step_times.items()
                  if label.startswith(("message", "API")))
    total = step_ms + carried
    print(f"{args.requests} requests, weight dtype {args.weight_dtype}, "
          f"KV cache {args.kv_cache_dtype}, "
          f"{torch.get_num_threads()} threads, {args.steps} steps (medians)\n")
    print("| component | ms per step | share |\n|---|---|---|")
    for label, ms in step_times.items():
        print(f"| {label} | {ms:.2f} | {ms / total:.0%} |")
    parts = sum(ms for label, ms in step_times.items() if label.startswith(("runner", "sched")))
    print(f"| engine core: the rest of step() | {max(0.0, step_ms - parts):.2f} | |")
    print(f"| **total, core and carriage** | **{total:.2f}** | |\n")
    print("| torch op (whole step) | ms per step | calls per step |\n|---|---|---|")
    for name, ms, calls in ops[:12] + ops[-1:]:
        print(f"| {name} | {ms:.2f} | {calls:g} |")


if __name__ == "__main__":
    main()
