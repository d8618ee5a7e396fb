"""Sizes in flags: bytes from "2GiB", "512MiB", "1.5GB" (the KV budget, the request limits)."""

from __future__ import annotations

import argparse
import re

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)(b?)\s*$", re.IGNORECASE)
_SIZE_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_size(text: str) -> int:
    """Bytes from "2GiB", "512MiB", "1.5GB", "2G" or "1073741824".

    KiB/MiB/GiB/TiB and the bare K/M/G/T are powers of 1024; KB/MB/GB/TB powers of 1000.
    """
    match = _SIZE_RE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 2GiB or 512MiB)")
    number, unit, binary, b = match.groups()
    base = 1000 if unit and b and not binary else 1024
    size = int(float(number) * base ** _SIZE_POWERS[unit.lower()])
    if size < 1:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return size


def kv_cache_memory(text: str) -> int | None:
    """--kv-cache-memory: a size, or "auto" (None: sized from the memory available)."""
    return None if text == "auto" else parse_size(text)
