"""The systems the benchmark compares (bench/systems.py): names checked, and each system's
command line (pagedserve's variants are flags `pagedserve serve` parses)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bench.systems import (
    NGRAM_SPECULATION,
    PAGEDSERVE_VARIANTS,
    llama_server_command,
    pagedserve_flags,
    parse_systems,
)
from loadgen.workloads import we
from server.cli import build_configs, build_parser


def test_the_speculating_systems_build_their_command_lines(tmp_path: Path) -> None:
    flags = pagedserve_flags("pagedserve-spec", "float32", None, ["--max-num-seqs", "8"])
    config = json.loads(flags[flags.index("--speculative-config") + 1])
    assert config == NGRAM_SPECULATION == {"method": "ngram", "num_speculative_tokens": 4,
                                           "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    assert flags[-2:] == ["--max-num-seqs", "8"] and "--speculative-config" not in \
        pagedserve_flags("pagedserve", "float32", 64, [])
    plain = llama_server_command("llama-server", "/bin/ls", tmp_path / "m.gguf", 9, 2, we())
    spec = llama_server_command("llama-server-spec", "/bin/ls", tmp_path / "m.gguf", 9, 2, we())
    assert spec[:len(plain)] == plain and "--spec-type" not in plain
    assert spec[spec.index("--spec-type") + 1] == "ngram-simple"
    assert plain[plain.index("-np") + 1] == "1"


def test_systems_parse_and_name_what_they_need(tmp_path: Path) -> None:
    binary = tmp_path / "llama-server"
    binary.write_text("")
    assert parse_systems("pagedserve,pagedserve-spec,llama-server-spec", str(binary), None) \
        == ["pagedserve", "pagedserve-spec", "llama-server-spec"]
    assert "llama-server" in parse_systems(None, str(binary), None)
    assert "llama-server" not in parse_systems(None, "", None)
    with pytest.raises(ValueError, match="llama-server-spec needs --llama-server"):
        parse_systems("pagedserve,llama-server-spec", "", None)
    with pytest.raises(ValueError, match="unknown systems: pagedserve-specx"):
        parse_systems("pagedserve-specx", "", None)
    with pytest.raises(ValueError, match="--baseline-tree"):
        parse_systems("baseline-tree", "", None)


@pytest.mark.parametrize("system", sorted(PAGEDSERVE_VARIANTS))
def test_the_benchmarks_pagedserve_systems_are_flags_serve_takes(system: str) -> None:
    """`bench.compare`'s servers (the speculating one included) start with flags that
    `pagedserve serve` parses."""
    args = build_parser().parse_args(["serve", *pagedserve_flags(system, "float32", 64)])
    config = build_configs(args, cuda=False)
    assert (config.scheduler.speculative is not None) == ("--speculative-config" in
                                                          PAGEDSERVE_VARIANTS[system])


def test_every_server_serves_the_model_compare_is_given(tmp_path: Path) -> None:
    """`bench.compare --model FILE`: pagedserve's variants and llama-server serve FILE;
    without it, llama-server the default model's GGUF and pagedserve its default."""
    from bench.compare import server_cmd

    gguf = tmp_path / "m.gguf"
    args = argparse.Namespace(model=gguf, llama_server="/bin/ls", threads=2, dtype="float32",
                              wp_kv_blocks=384, pagedserve_args="--max-num-seqs 8")
    for system in ("pagedserve", "pagedserve-int8", "baseline-tree"):
        cmd = server_cmd(system, 9, we(), args)
        assert cmd[cmd.index("--model") + 1] == str(gguf) and "--max-num-seqs" in cmd
    llama = server_cmd("llama-server", 9, we(), args)
    assert llama[llama.index("-m") + 1] == str(gguf)
    args.model = None
    assert "--model" not in server_cmd("pagedserve", 9, we(), args)
    llama = server_cmd("llama-server", 9, we(), args)
    assert llama[llama.index("-m") + 1].endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
