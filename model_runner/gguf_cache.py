"""Where a GGUF's config and tokenizer folder is kept (model_runner/gguf_file.py writes it
once; the API process only reads it): no torch, no transformers."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

# what a GGUF's metadata folder's contents are as of: a folder written before says less
METADATA_VERSION = 2


def cache_root() -> Path:
    """Where a GGUF's config and tokenizer are kept: $PAGEDSERVE_CACHE or ~/.cache/pagedserve."""
    return Path(os.environ.get("PAGEDSERVE_CACHE") or Path.home() / ".cache" / "pagedserve")


def metadata_folder_path(gguf: Path) -> Path:
    """Where `gguf`'s config, tokenizer and tensor names are kept: the file's stem and a
    hash of its path, size and mtime (a changed file is read again)."""
    stat = gguf.stat()
    key = hashlib.sha256(
        f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{METADATA_VERSION}".encode())
    return cache_root() / f"{gguf.stem}-meta-{key.hexdigest()[:12]}"
