"""CUDA graphs for decode steps: static input buffers, batch-size buckets, capture, replay.

A decode-only step of b sequences (one new token each) is padded to the smallest bucket
>= b (1, 2, 4, 8, then multiples of 16, and max_num_seqs itself) and runs on static
buffers sized for max_num_seqs sequences of max_model_len tokens. Padding rows have
slot -1 (both write_kv_cache implementations skip negative slots, so they never touch
the KV cache) and a context of one token in block 0 (always a real block), so their
attention is finite; their outputs are ignored.

On CUDA one graph per bucket is captured at startup, after the KV cache exists (the graph
holds its addresses), in one shared memory pool, largest bucket first. Step inputs are
written into pinned host buffers and copied with non_blocking=True, then the bucket's
graph replays. Without CUDA graphs (the CPU, or tests) the same forward runs eagerly on
the same static buffers, so the padding logic is tested everywhere.

With LoRA adapters in slot buffers (model_runner/lora_stacks.py, as on CUDA) a second
graph per bucket runs the adapters' Triton kernels: a decode step with adapter rows stages
each row's slot into a static int32 buffer (-1 for base and padding rows) and replays it;
the slot buffers never move, so an adapter loaded after the capture runs in it too. A
step without adapter rows replays the plain graph and pays nothing.

NOTE: the Triton decode kernel picks its split count from meta.max_context_len, a host
int that a graph freezes. The static metadata sets it to max_model_len, so each bucket
has one fixed split count; every split computes its own key range from context_lens on
the device (empty splits contribute nothing), so any context length stays correct.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Sequence

import numpy as np
import torch

from model_runner.attention.backend import AttentionBackend
from model_runner.attention_metadata import AttentionMetadata
from model_runner.block_tables import BlockTables
from model_runner.config import ModelConfig
from model_runner.kv_cache import KVCaches
from model_runner.lora_layers import LoRAModel
from model_runner.models.llama import LlamaForCausalLM
from scheduler.output import ScheduledRequest

logger = logging.getLogger(__name__)

NUM_WARMUP_RUNS = 2  # per bucket before capture: Triton compiles, cuBLAS sets up


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The buckets: 1, 2, 4, 8, then steps of 16, up to and including max_num_seqs."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = {b for b in (1, 2, 4, 8) if b <= max_num_seqs}
    sizes.update(range(16, max_num_seqs + 1, 16))
    sizes.add(max_num_seqs)
    return sorted(sizes)


_NUMPY_DTYPES = {torch.int32: np.int32, torch.int64: np.int64, torch.float32: np.float32}


def host_to_device(array: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A step input built on the host, on `device` in `dtype`.

    CUDA: staged through pinned memory and copied with non_blocking=True (the pinned
    block is not reused before its copy has run: torch's host allocator records an event
    on the stream). CPU: no copy when the dtype already matches.
    """
    # NOTE: the dtype conversion in numpy: torch's CPU int64 -> int32 `.to` took ~8 ms
    # for a [256, 260] block table, numpy's astype 15 us.
    host = torch.from_numpy(np.asarray(array, dtype=_NUMPY_DTYPES[dtype]))
    if device.type != "cuda":
        return host
    pinned = torch.empty(host.shape, dtype=dtype, pin_memory=True)
    pinned.copy_(host)
    return pinned.to(device, non_blocking=True)


def create_decode_graph_runner(
    model: LlamaForCausalLM,
    attn: AttentionBackend,
    config: ModelConfig,
    max_model_len: int,
    device: torch.device,
    loras: LoRAModel | None = None,
) -> DecodeGraphRunner | None:
    """The graph runner a ModelRunner uses by default: on CUDA with the Triton backend
    unless enforce_eager, else None (decodes then run eagerly like any other step);
    `loras`: the model's adapters, whose decode steps it then runs too."""
    if device.type != "cuda" or config.enforce_eager:
        return None
    if attn.name != "triton":
        # NOTE: the torch reference reads context lengths back to the host (a sync that a
        # graph cannot hold), so it always runs eagerly.
        logger.warning("CUDA graphs need the triton attention backend; decoding eagerly")
        return None
    return DecodeGraphRunner(
        model,
        attn,
        max_num_seqs=config.max_num_seqs,
        max_model_len=max_model_len,
        block_size=config.block_size,
        use_cuda_graphs=True,
        loras=loras,
    )


class DecodeGraphRunner:
    """Runs decode-only steps of up to max_num_seqs sequences at bucketed batch sizes.

    With use_cuda_graphs, call `capture(kv_caches)` once before `forward`; without, the
    forward runs eagerly on the static buffers (CPU, tests). `profile(kv_caches)` runs the
    largest bucket eagerly, for the memory profile before the KV cache is sized. `loras`:
    the model's adapters; their decode steps run here too when they sit in slot buffers.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        attn: AttentionBackend,
        *,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        use_cuda_graphs: bool,
        loras: LoRAModel | None = None,
    ) -> None:
        weight = model.embed_tokens.weight
        device = weight.device
        if use_cuda_graphs and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device.type}")
        self.model = model
        self.attn = attn
        self.device = device
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.batch_sizes = graph_batch_sizes(max_num_seqs)
        self.use_cuda_graphs = use_cuda_graphs
        n = max_num_seqs
        max_blocks = -(-max_model_len // block_size)
        self.max_blocks_per_seq = max_blocks

        # Static device buffers. token_inputs rows: input ids, positions, slot mapping.
        self.token_inputs = torch.zeros(3, n, dtype=torch.int64, device=device)
        self.input_ids, self.positions, self.slot_mapping = self.token_inputs.unbind(0)
        self.context_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)  # fixed
        self.hidden = torch.zeros(n, model.config.hidden_size, dtype=weight.dtype, device=device)
        self.rows = torch.arange(n, dtype=torch.int64, device=device)
        self.loras = loras if loras is not None and loras.use_stacks else None
        self.row_slots = torch.full((n,), -1, dtype=torch.int32, device=device)
        self.slot_mapping.fill_(-1)
        self._metas = {b: self._meta(b) for b in self.batch_sizes}

        # Host staging: pinned on CUDA; block tables flat, so that any [rows, width]
        # prefix view of it is contiguous and goes over in one copy.
        pin = device.type == "cuda"
        self._host_tokens = torch.zeros(3, n, dtype=torch.int64, pin_memory=pin)
        self._host_context_lens = torch.ones(n, dtype=torch.int32, pin_memory=pin)
        self._host_tables = torch.zeros(n * max_blocks, dtype=torch.int32, pin_memory=pin)
        self._copied = torch.cuda.Event() if pin else None  # the staging buffers are free

        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._lora_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._captured_kv: KVCaches | None = None

    def _meta(self, batch_size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch_size],
            query_start_loc=self.query_start_loc[: batch_size + 1],
            context_lens=self.context_lens[:batch_size],
            block_tables=self.block_tables[:batch_size],
            max_query_len=1,
            max_context_len=self.max_model_len,  # fixes the Triton split count per bucket
            num_decode_seqs=batch_size,
        )

    def bucket(self, num_seqs: int) -> int:
        """The smallest batch size >= num_seqs that has a graph; ValueError past the last."""
        i = bisect.bisect_left(self.batch_sizes, num_seqs)
        if num_seqs < 1 or i == len(self.batch_sizes):
            raise ValueError(f"no decode bucket for {num_seqs} sequences (1..{self.max_num_seqs})")
        return self.batch_sizes[i]

    def can_run(self, requests: Sequence[ScheduledRequest], lora_rows: bool = False) -> bool:
        """True for a decode-only step (every request one new token) that fits; with
        adapter rows (`lora_rows`), when their slot buffers are ours."""
        return (0 < len(requests) <= self.max_num_seqs and (not lora_rows or bool(self.loras))
                and all(r.num_new_tokens == 1 for r in requests))

    def forward(
        self,
        requests: Sequence[ScheduledRequest],
        block_tables: BlockTables,
        kv_caches: KVCaches,
        placeholders: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run a decode-only step: hidden states [num_seqs, H] (a view of the static
        output, valid until the next call) and the rows that sample [num_sampling].
        `placeholders`: rows whose input id is a token still on the device, and it.

        Raises ValueError when a block table is too short for its request's context.
        """
        num_seqs = len(requests)
        batch_size = self.bucket(num_seqs)
        self._stage(requests, block_tables, batch_size)
        if placeholders is not None:
            self.input_ids[placeholders[0]] = placeholders[1]
        lora_rows = self._stage_lora_rows(num_seqs, batch_size)
        if self.use_cuda_graphs:
            if kv_caches is not self._captured_kv:
                raise ValueError("the decode graphs were captured over another KV cache")
            (self._lora_graphs if lora_rows else self._graphs)[batch_size].replay()
        else:
            self._run(batch_size, kv_caches)
        sample = np.fromiter((r.sample for r in requests), bool, num_seqs)
        if sample.all():
            rows = self.rows[:num_seqs]
        else:
            rows = host_to_device(np.flatnonzero(sample), torch.int64, self.device)
        return self.hidden[:num_seqs], rows

    def _stage(
        self, requests: Sequence[ScheduledRequest], block_tables: BlockTables, batch_size: int
    ) -> None:
        """Lay the step out in the host buffers (padding rows after the real ones) and
        copy it into the static device buffers."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copies have read the host buffers
        num_seqs, bs = len(requests), self.block_size
        ids, positions, slots = self._host_tokens.numpy()
        context_lens = self._host_context_lens.numpy()
        ids[:num_seqs] = np.fromiter((r.token_ids[0] for r in requests), np.int64, num_seqs)
        pos = positions[:num_seqs]
        pos[:] = np.fromiter((r.num_computed_tokens for r in requests), np.int64, num_seqs)
        context_lens[:num_seqs] = pos + 1
        num_blocks = pos // bs + 1  # blocks each context covers
        width = int(num_blocks.max())
        if width > self.max_blocks_per_seq:
            raise ValueError(f"a context of {int(pos.max()) + 1} tokens exceeds "
                             f"max_model_len {self.max_model_len}")
        tables = self._host_tables.numpy()[: batch_size * width].reshape(batch_size, width)
        tables[:num_seqs] = block_tables.gather(block_tables.rows(requests, context_lens), width)
        slots[:num_seqs] = tables[np.arange(num_seqs), num_blocks - 1] * bs + pos % bs
        # padding rows: token 0 at position 0, no KV write, one key in block 0
        ids[num_seqs:batch_size] = 0
        positions[num_seqs:batch_size] = 0
        slots[num_seqs:batch_size] = -1
        context_lens[num_seqs:batch_size] = 1
        tables[num_seqs:] = 0

        # NOTE: whole token and context buffers (a few KiB, one contiguous copy each);
        # table columns past `width` keep stale entries no kernel reads.
        self.token_inputs.copy_(self._host_tokens, non_blocking=True)
        self.context_lens.copy_(self._host_context_lens, non_blocking=True)
        host_tables = self._host_tables[: batch_size * width].view(batch_size, width)
        self.block_tables[:batch_size, :width].copy_(host_tables, non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def _stage_lora_rows(self, num_seqs: int, batch_size: int) -> bool:
        """Whether the step has adapter rows (LoRAModel.begin_step): then each row's slot
        copied into the static buffer, and the adapters' kernels pointed at it."""
        step = None if self.loras is None else self.loras.step
        if step is None or step.row_slots is None:
            return False
        self.row_slots[:num_seqs].copy_(step.row_slots, non_blocking=True)
        self.row_slots[num_seqs:batch_size] = -1
        step.row_slots = self.row_slots[:batch_size]
        return True

    def _run(self, batch_size: int, kv_caches: KVCaches) -> None:
        """The forward of one bucket on the static buffers, into the static output."""
        meta = self._metas[batch_size]
        meta.scratch.clear()  # static metadata, new contents: a new step
        hidden = self.model(
            self.input_ids[:batch_size],
            self.positions[:batch_size],
            meta,
            kv_caches,
            self.attn,
        )  # [batch_size, H]
        self.hidden[:batch_size].copy_(hidden)

    def _reset_to_padding(self) -> None:
        """Every row a padding row, so warm-up and profile runs write no KV."""
        self.input_ids.zero_()
        self.positions.zero_()
        self.slot_mapping.fill_(-1)
        self.context_lens.fill_(1)
        self.block_tables.zero_()

    @torch.inference_mode()
    def profile(self, kv_caches: KVCaches) -> None:
        """Run the largest bucket eagerly on padding rows (reads block 0 of kv_caches)."""
        self._reset_to_padding()
        self._run(self.batch_sizes[-1], kv_caches)

    @torch.inference_mode()
    def capture(self, kv_caches: KVCaches) -> None:
        """Capture one CUDA graph per bucket over `kv_caches`, largest first, in one pool."""
        if not self.use_cuda_graphs:
            raise ValueError("this DecodeGraphRunner runs eagerly (use_cuda_graphs=False)")
        start = time.perf_counter()
        reserved = torch.cuda.memory_reserved(self.device)
        self._reset_to_padding()
        self._graphs.clear()
        self._lora_graphs.clear()
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        for batch_size in reversed(self.batch_sizes):
            self._graphs[batch_size] = self._capture_one(batch_size, kv_caches, pool, side)
            if self.loras is not None:  # the same with the adapters' kernels, on no slot
                step = self.loras.step
                step.runs, step.row_slots = [("", 0, batch_size)], self.row_slots[:batch_size]
                try:
                    self._lora_graphs[batch_size] = self._capture_one(
                        batch_size, kv_caches, pool, side)
                finally:
                    step.runs, step.row_slots = [], None
        torch.cuda.synchronize(self.device)
        self._captured_kv = kv_caches
        logger.info(
            "captured %d decode CUDA graphs (batch sizes %s) in %.1f s, %.0f MiB",
            len(self._graphs),
            ", ".join(map(str, self.batch_sizes)),
            time.perf_counter() - start,
            (torch.cuda.memory_reserved(self.device) - reserved) / 2**20,
        )

    def _capture_one(self, batch_size: int, kv_caches: KVCaches, pool: tuple[int, int],
                     side: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
        # NOTE: warm-up on a side stream, as torch's CUDA graph docs ask.
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(NUM_WARMUP_RUNS):
                self._run(batch_size, kv_caches)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self._run(batch_size, kv_caches)
        return graph
