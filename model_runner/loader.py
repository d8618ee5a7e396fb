"""Find and load a model: a local Hugging Face folder, a .gguf file, or the default.

Which files `--model` names is model_source.py's; the tokenizer is text_tokenizer.py's
(transformers' one here: the tests' reference; the API process serves its own). A GGUF is
read as it is (gguf_file.py): its config and tokenizer from its metadata (kept as a small
folder after the first start), its weights from the memory-mapped file straight into the
model. Nothing is fetched from a model hub.
"""

# ruff: noqa: E402 (HF_HUB_OFFLINE must be set before transformers is imported)
from __future__ import annotations

import os

# NOTE: before transformers is imported, so that huggingface_hub never goes online.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, PretrainedConfig, PreTrainedTokenizerBase

from model_runner.config import ModelConfig
from model_runner.distributed.tensor_parallel import TensorParallel
from model_runner.gguf_file import gguf_weights, metadata_folder, read_hf_names
from model_runner.kernels.cpu_kernels import cpu_kernels_available
from model_runner.kernels.cpu_linear import can_pack, check_weight_dtype
from model_runner.model_source import resolve_model
from model_runner.models.llama import LlamaForCausalLM
from model_runner.models.registry import model_class
from model_runner.models.weights import WeightSource
from model_runner.served_config import served_eos_token_ids
from model_runner.text_tokenizer import hf_tokenizer
from model_runner.tokenizer_files import TokenizerFiles

logger = logging.getLogger(__name__)


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
    tokenizer = hf_tokenizer(folder) if with_tokenizer else TokenizerFiles(folder)
    return ModelSpec(
        hf_config=hf_config,
        tokenizer=tokenizer,
        eos_token_ids=served_eos_token_ids(folder, hf_config.to_dict(), tokenizer.eos_token_id),
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
