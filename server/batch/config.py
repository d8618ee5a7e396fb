"""`BatchConfig`: where batches live on disk, their priority and their limits; the
`serve` flags that set it."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_BATCH_PRIORITY = 100  # below every interactive default (0) and tenant default
DEFAULT_MAX_BATCH_LINES = 50_000  # OpenAI's
DEFAULT_MAX_BATCH_FILE_BYTES = 200 * 1024 * 1024  # OpenAI's
COMPLETION_WINDOW_S = 24 * 3600.0  # "24h", the one window OpenAI takes


@dataclass(frozen=True)
class BatchConfig:
    """data_dir: the files and the store (None: no Batch API, as in the unit tests' apps);
    priority: the priority every line runs at; max_lines, max_file_bytes: an input file's
    limits; max_in_flight: the lines the feeder keeps in the engine at most (the engine's
    seats); completion_window_s: how long a batch may run before its rest expires."""

    data_dir: Path | None = None
    priority: int = DEFAULT_BATCH_PRIORITY
    max_lines: int = DEFAULT_MAX_BATCH_LINES
    max_file_bytes: int = DEFAULT_MAX_BATCH_FILE_BYTES
    max_in_flight: int = 8
    completion_window_s: float = COMPLETION_WINDOW_S

    def __post_init__(self) -> None:
        if self.max_lines < 1:
            raise ValueError("--max-batch-lines must be >= 1")
        if self.max_file_bytes < 1:
            raise ValueError("--max-batch-file-bytes must be >= 1")
        if self.max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        if self.completion_window_s <= 0:
            raise ValueError("completion_window_s must be > 0")


def default_data_dir(port: int) -> Path:
    """$XDG_DATA_HOME/pagedserve/port-PORT, else ~/.local/share/pagedserve/port-PORT: one per
    port, so that replicas on one machine (each on its own port) start side by side, and a
    server restarted on its port finds its batches."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "pagedserve" / f"port-{port}"


def add_batch_arguments(parser: argparse.ArgumentParser) -> None:
    """The Batch API's flags."""
    batch = parser.add_argument_group("batch API", "OpenAI's /v1/files and /v1/batches")
    batch.add_argument("--data-dir", type=Path, default=None,
                       help="the batch files and their SQLite store (default "
                       "$XDG_DATA_HOME/pagedserve/port-PORT, else "
                       "~/.local/share/pagedserve/port-PORT); one server per directory")
    batch.add_argument("--batch-priority", type=int, default=DEFAULT_BATCH_PRIORITY,
                       help="the priority of batch lines (lower is more urgent; default "
                       f"{DEFAULT_BATCH_PRIORITY}, below the interactive default 0)")
    batch.add_argument("--max-batch-lines", type=int, default=DEFAULT_MAX_BATCH_LINES,
                       help=f"lines in a batch's input file (default {DEFAULT_MAX_BATCH_LINES})")
    batch.add_argument("--max-batch-file-bytes", type=int,
                       default=DEFAULT_MAX_BATCH_FILE_BYTES,
                       help="bytes of an uploaded batch file (default 200MiB)")


def batch_config(args: argparse.Namespace, max_num_seqs: int) -> BatchConfig:
    """The flags' `BatchConfig`; the feeder keeps up to the engine's seats in flight."""
    return BatchConfig(
        data_dir=args.data_dir or default_data_dir(args.port), priority=args.batch_priority,
        max_lines=args.max_batch_lines, max_file_bytes=args.max_batch_file_bytes,
        max_in_flight=max_num_seqs,
    )
