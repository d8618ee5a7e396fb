"""Llama-family causal LMs (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3) in plain torch, and
the base the other decoder families here build on (their files override its few hooks).

Built from a Hugging Face config out of the shared layers (layers.py); reads and writes a
paged KV cache through an AttentionBackend. `load_weights` maps the Hugging Face
checkpoint names onto the fused q/k/v and gate/up projections.

Tensor parallel (a `TensorParallel` given): each rank holds its slice of the attention
heads and of the MLP's width (see layers.py) and of the vocabulary (embedding and LM
head); the embedding is summed over the ranks (one all-reduce), the logits gathered on
rank 0. `load_weights` reads only this rank's slices.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from model_runner.attention.backend import AttentionBackend, LayerOps
from model_runner.attention_metadata import AttentionMetadata
from model_runner.distributed.tensor_parallel import TensorParallel
from model_runner.kernels.block_quant import GGUFBlocks
from model_runner.kernels.cpu_kernel_table import DEFAULT_TABLE, KernelTable
from model_runner.kernels.cpu_linear import FileBlocksLinear, PackedLinear, pack_linear
from model_runner.kv_cache import KVCaches
from model_runner.lora_layers import LoRAStep
from model_runner.models.decode_stack import (
    DEFAULT_ROPE,
    DecodeStack,
    StackAttention,
    StackLayer,
    StackMLP,
    StackNorm,
    build_decode_stack,
    form_of,
)
from model_runner.models.layers import MLP, Attention, Linear, RMSNorm, dropped, is_first
from model_runner.models.rope import RopeAngles, rotary_dim
from model_runner.models.sliding_windows import layer_windows
from model_runner.models.weights import FileBlocks, WeightSource, read

logger = logging.getLogger(__name__)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: attention (`self_attn`, the model's), then the feed-forward
    block (`mlp`, the model's: an MLP or a mixture of experts)."""

    def __init__(self, config: PretrainedConfig, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionBackend,
        ops: LayerOps | None = None,
    ) -> torch.Tensor:
        """`ops`: the backend's fused kernels for the norms, RoPE and SwiGLU, or None for
        the torch code."""
        h = self.input_layernorm(x, ops)
        x = x + self.self_attn(h, cos, sin, meta, kv_cache, attn, ops)
        return x + self.mlp(self.post_attention_layernorm(x, ops), ops)

    def decode_stack_form(self) -> StackLayer | str:
        """This layer as the C++ decode stack repeats it (decode_stack.py), or why not: the
        forms its norms, attention and feed-forward block declare."""
        input_norm = form_of(self.input_layernorm, "input_layernorm", StackNorm)
        if isinstance(input_norm, str):
            return input_norm
        attention = form_of(self.self_attn, "self_attn", StackAttention)
        if isinstance(attention, str):
            return attention
        post_norm = form_of(self.post_attention_layernorm, "post_attention_layernorm", StackNorm)
        if isinstance(post_norm, str):
            return post_norm
        mlp = form_of(self.mlp, "mlp", StackMLP)
        if isinstance(mlp, str):
            return mlp
        return StackLayer(input_norm, post_norm, attention, mlp)


class LlamaForCausalLM(nn.Module):
    """A Llama-family decoder over a paged KV cache.

    Build it (cheaply under `torch.device("meta")`), move it with `to_empty`, then call
    `load_weights` and `init_rope`. `forward` returns the final-norm hidden states of
    every token; `compute_logits` applies the LM head to the rows that sample.
    With `tp`, this rank's shard of the model (see the module docstring); `num_kv_heads`
    is then this rank's.

    A family that differs overrides a hook: `make_layer` / `make_attention` (its blocks),
    `embed`, `compute_logits`, `load_weights` (its checkpoint's names) or
    `checkpoint_slices` (its weights' tensor-parallel slices).
    """

    def __init__(self, config: PretrainedConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported activation {config.hidden_act!r} (only silu)")
        self.config = config
        self.head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        self.rotary_dim = rotary_dim(config, self.head_dim)
        self.tp = tp
        self.num_layers = config.num_hidden_layers
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.vocab_size = config.vocab_size
        # this rank's [start, stop) of the vocabulary, in `vocab_rows` rows (zero padded)
        self.vocab_start, self.vocab_stop, vocab_rows = (
            (0, self.vocab_size, self.vocab_size) if tp is None else tp.vocab(self.vocab_size)
        )
        # NOTE: no random init (the weights are loaded): on the meta device an Embedding's
        # normal_ alone imports torch._dynamo, ~1.3 s of every start
        self.embed_tokens = nn.Embedding(vocab_rows, config.hidden_size,
                                         _weight=torch.empty(vocab_rows, config.hidden_size))
        self.layers = nn.ModuleList(
            self.make_layer(config, layer_id, tp) for layer_id in range(self.num_layers)
        )
        for layer, window in zip(self.layers, layer_windows(config), strict=True):
            layer.self_attn.options = replace(layer.self_attn.options, sliding_window=window)
        self.num_kv_heads = self.layers[0].self_attn.num_kv_heads
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, vocab_rows, bias=False)
        self.packed_lm_head: PackedLinear | None = None
        # the layers in one C++ call for small decode steps (decode_stack.py), once packed,
        # or why not
        self.decode_stack: DecodeStack | None = None
        self.decode_stack_off: str | None = "not packed"
        # the step's rows by LoRA adapter, once adapters are attached (lora_layers.py)
        self.lora_step: LoRAStep | None = None
        # a projection's rows left in a GGUF's blocks (row offset, blocks) by
        # `load_weights`, until `pack_weights` packs them as they are
        self.file_blocks: dict[str, list[tuple[int, GGUFBlocks]]] = {}
        # the embedding table left in a GGUF's blocks (no float32 table): the lookup
        # dequantizes the rows it gathers, a tied LM head runs on the same blocks
        self.embedding_blocks: GGUFBlocks | None = None
        self.rope: RopeAngles | None = None  # once `init_rope` sets it

    def make_layer(
        self, config: PretrainedConfig, layer_id: int, tp: TensorParallel | None
    ) -> nn.Module:
        """Decoder layer `layer_id` (its forward as DecoderLayer's)."""
        return DecoderLayer(
            config, self.make_attention(config, layer_id, tp), self.make_mlp(config, layer_id, tp)
        )

    def make_attention(
        self, config: PretrainedConfig, layer_id: int, tp: TensorParallel | None
    ) -> nn.Module:
        """Layer `layer_id`'s attention (its forward as Attention's)."""
        return Attention(config, self.head_dim, tp, rotary_dim=self.rotary_dim)

    def make_mlp(
        self, config: PretrainedConfig, layer_id: int, tp: TensorParallel | None
    ) -> nn.Module:
        """Layer `layer_id`'s feed-forward block (its forward as MLP's; a family with
        experts overrides it)."""
        return MLP(config, tp)

    def init_rope(self, max_positions: int) -> None:
        """The RoPE of a context of `max_positions`, on the model's device and dtype."""
        weight = self.embed_tokens.weight
        self.rope = RopeAngles.of(self.config, self.rotary_dim, max_positions, weight.device,
                                  weight.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        kv_caches: KVCaches,
        attn: AttentionBackend,
    ) -> torch.Tensor:
        """Hidden states after the final norm: [T, H]."""
        assert self.rope is not None, "init_rope first"
        cos, sin = self.rope(positions)  # [T, R / 2]
        x = self.embed(input_ids)  # [T, H]
        ops = self.layer_ops(attn, x.dtype)
        if self.decode_stack is not None and self.runs_decode_stack(meta, x, attn, ops):
            x = self.decode_stack(x, {DEFAULT_ROPE: (cos, sin)}, meta, kv_caches,
                                  *self.stacked_lora())
        else:
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                x = layer(x, cos, sin, meta, kv_cache, attn, ops)
        return self.norm(x, ops)

    def runs_decode_stack(
        self, meta: AttentionMetadata, x: torch.Tensor, attn: AttentionBackend,
        ops: LayerOps | None,
    ) -> bool:
        """Whether this step's layers run in the decode stack: one it takes, on the "cpu"
        backend with its layer kernels (those the Python layers then run); LoRA adapters'
        rows only where the stack reads their matrices (lora_layers.py)."""
        stack = self.decode_stack
        lora = self.lora_step
        if lora is not None and lora.runs and lora.stacked is None:
            return False
        return (stack is not None and ops is not None and attn.name == "cpu"
                and stack.takes(meta, x.shape[0]))

    def stacked_lora(self) -> tuple[list[int], list[torch.Tensor]]:
        """The step's LoRA runs and matrices as the decode stack takes them (none without
        adapter rows)."""
        lora = self.lora_step
        return ([], []) if lora is None or not lora.runs else lora.stack_inputs()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embeddings [T, H] of input_ids [T]; vocab-parallel: each rank looks up the ids
        it holds (zeros for the others), summed over the ranks."""
        if self.embedding_blocks is not None:  # never under tensor parallelism
            return self.embedding_blocks.dequantized(input_ids)
        if self.tp is None:
            return self.embed_tokens(input_ids)
        local = input_ids - self.vocab_start
        elsewhere = (local < 0) | (local >= self.vocab_stop - self.vocab_start)  # [T]
        x = self.embed_tokens(local.masked_fill(elsewhere, 0))
        return self.tp.all_reduce(x.masked_fill_(elsewhere[:, None], 0.0))

    def layer_ops(self, attn: AttentionBackend, dtype: torch.dtype) -> LayerOps | None:
        """The backend's fused layer kernels when they take this model and dtype."""
        ops = attn.layer_ops
        if ops is None or dtype not in ops.dtypes:
            return None
        widths = (self.config.hidden_size, self.layers[0].mlp.intermediate_size, self.head_dim)
        return ops if all(w % ops.widths_multiple_of == 0 for w in widths) else None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head on hidden [N, H]: float32 logits [N, vocab].

        Vocab-parallel, a collective: every rank calls it; rank 0 gets the whole logits,
        the others only their slice."""
        if self.packed_lm_head is not None:
            logits = self.packed_lm_head(hidden)
        else:
            logits = F.linear(hidden, self._lm_head_weight())
        if self.tp is not None:
            logits = self.tp.gather_last_dim(logits)[:, : self.vocab_size]
        return logits.float()

    def _lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight

    def pack_weights(self, weight_dtype: str, table: KernelTable = DEFAULT_TABLE) -> None:
        """Pack every projection and the LM head for the CPU (see cpu_linear.can_pack), their
        small batches as `table` says (cpu_kernel_table.py); the decode stack of the layers
        when they declare one (decode_stack.py)."""
        for name, module in self.named_modules():
            if isinstance(module, Linear):
                module.pack(weight_dtype, table, self.file_blocks.pop(f"{name}.weight", ()))
        if self.tie_word_embeddings and self.embedding_blocks is not None:
            self.packed_lm_head = FileBlocksLinear(self.embedding_blocks, None, weight_dtype, table)
        else:
            self.packed_lm_head = pack_linear(self._lm_head_weight(), None, weight_dtype, table,
                                              kept=self.tie_word_embeddings,
                                              parts=self.file_blocks.pop("lm_head.weight", ()))
        if not self.tie_word_embeddings:  # a tied one is the embedding table too
            self.lm_head.weight = dropped(self.lm_head.weight)
        stack = build_decode_stack(self.layers, table)
        self.decode_stack, self.decode_stack_off = (
            (None, stack) if isinstance(stack, str) else (stack, None)
        )
        if self.decode_stack_off is not None:
            logger.info("decode steps run the Python layers: %s", self.decode_stack_off)

    def use_kernel_table(self, table: KernelTable) -> None:
        """Run the packed projections' small batches, and the decode stack, as `table` says
        from the next step on (bench.step_profile compares it with the GEMMs alone)."""
        for module in self.modules():
            if isinstance(module, Linear) and module.packed is not None:
                module.packed.use_table(table)
        if self.packed_lm_head is not None:
            self.packed_lm_head.use_table(table)
        if self.decode_stack is not None:
            self.decode_stack.use_table(table)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, WeightSource]]) -> None:
        """Copy Hugging Face checkpoint weights (name, tensor or safetensors slice) into the
        fused parameters, reading only this rank's slice of each under tensor parallelism;
        a whole projection's GGUF blocks (`FileBlocks`) are kept for `pack_weights`
        instead (`file_blocks`), and so is a whole embedding table's (`embedding_blocks`).

        Raises ValueError when a parameter is left without a weight or a shape differs.
        """
        params = self.checkpoint_params()
        attn, mlp = self.layers[0].self_attn, self.layers[0].mlp
        # HF module name -> (our module name, row offset in the fused weight)
        fused = {
            "q_proj": ("qkv_proj", 0),
            "k_proj": ("qkv_proj", attn.q_size),
            "v_proj": ("qkv_proj", attn.q_size + attn.kv_size),
            "gate_proj": ("gate_up_proj", 0),
            "up_proj": ("gate_up_proj", mlp.intermediate_size),
        }
        slices = self.checkpoint_slices()
        packed = self.packed_weights()
        loaded: set[str] = set()
        fused_rows: dict[str, int] = {}
        for hf_name, source in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name or (name == "lm_head.weight" and self.tie_word_embeddings):
                continue
            parts = name.split(".")
            module = parts[-2] if len(parts) > 1 else ""
            target, offset = name, None
            if module in fused:
                ours, offset = fused[module]
                target = ".".join([*parts[:-2], ours, parts[-1]])
            where = slices.get(module)
            if where is not None and where[0] == 1 and parts[-1] == "bias":
                if not is_first(self.tp):
                    continue  # a row-parallel layer's bias lives on rank 0 only, whole
                where = None
            if target not in params:
                raise ValueError(f"unexpected weight {hf_name!r} in the checkpoint")
            param = params[target]
            kept = source if isinstance(source, FileBlocks) and where is None and (
                target in packed or (target == "embed_tokens.weight" and self.tp is None)
            ) else None
            tensor = None if kept is not None else read(hf_name, source, where)
            if (tensor is not None and module in ("embed_tokens", "lm_head")
                    and tensor.shape[0] < param.shape[0]):
                tensor = F.pad(tensor, (0, 0, 0, param.shape[0] - tensor.shape[0]))
            shape = tuple(kept.get_shape() if kept is not None else tensor.shape)
            if offset is None:
                if tuple(param.shape) != shape:
                    raise ValueError(
                        f"weight {hf_name!r} has shape {shape}, expected {tuple(param.shape)}"
                    )
                self._put(target, param, 0, tensor, kept)
                loaded.add(target)
            else:
                rows = shape[0]
                if offset + rows > param.shape[0] or shape[1:] != tuple(param.shape[1:]):
                    raise ValueError(f"weight {hf_name!r} has an unexpected shape")
                self._put(target, param, offset, tensor, kept)
                fused_rows[target] = fused_rows.get(target, 0) + rows
                if fused_rows[target] == param.shape[0]:
                    loaded.add(target)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks weights for {', '.join(missing[:5])}")

    def _put(self, target: str, param: nn.Parameter, offset: int,
             tensor: torch.Tensor | None, kept: FileBlocks | None) -> None:
        """Rows [offset, ...) of `param` from `tensor`, or left in `kept`'s blocks until
        packed."""
        if kept is not None and target == "embed_tokens.weight":
            self.embedding_blocks = kept.blocks
            self.embed_tokens.weight = dropped(param)
        elif kept is not None:
            self.file_blocks.setdefault(target, []).append((offset, kept.blocks))
        else:
            assert tensor is not None
            param[offset : offset + tensor.shape[0]].copy_(tensor)

    def packed_weights(self) -> frozenset[str]:
        """The weights `pack_weights` packs: every Linear's and an untied LM head's."""
        names = {f"{name}.weight" for name, module in self.named_modules()
                 if isinstance(module, Linear)}
        return frozenset(names | (set() if self.tie_word_embeddings else {"lm_head.weight"}))

    def checkpoint_params(self) -> dict[str, nn.Parameter]:
        """The parameters `load_weights` fills (a family loading some itself leaves them
        out)."""
        return dict(self.named_parameters())

    def checkpoint_slices(self) -> dict[str, tuple[int, int, int, int]]:
        """HF module name -> (dim, start, stop, size): this rank reads [start, stop) along
        `dim` of that module's checkpoint weight, `size` long there. Absent: read whole."""
        if self.tp is None:
            return {}
        attn, mlp, d = self.layers[0].self_attn, self.layers[0].mlp, self.head_dim
        config = self.config
        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        q = (attn.q_heads[0] * d, attn.q_heads[1] * d, config.num_attention_heads * d)
        kv = (attn.kv_heads[0] * d, attn.kv_heads[1] * d, num_kv_heads * d)
        rows = (*mlp.rows, config.intermediate_size)
        vocab = (self.vocab_start, self.vocab_stop, self.vocab_size)
        return {
            "q_proj": (0, *q), "k_proj": (0, *kv), "v_proj": (0, *kv), "o_proj": (1, *q),
            "gate_proj": (0, *rows), "up_proj": (0, *rows), "down_proj": (1, *rows),
            "embed_tokens": (0, *vocab), "lm_head": (0, *vocab),
        }


