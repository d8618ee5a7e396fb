"""A Qwen3 GGUF made with llama.cpp's own tools, for the parity test's third family: no
small real Qwen GGUF is on PyPI, so a random one, Qwen3's shape scaled down.

    python -m bench.tiny_qwen_gguf --llama-cpp DIR [--llama-quantize BIN] [--dest DIR]

A random Qwen3 (4 layers, hidden 256, 4 query heads of 128 as in every Qwen3, 2 KV heads,
SmolLM2's tokenizer) saved by transformers, converted by `DIR/convert_hf_to_gguf.py`
(llama.cpp's tree, e.g. the llama-cpp-python sdist's vendor/llama.cpp) to F32 and Q8_0,
then by `llama-quantize` to Q4_K_M when given. Writes qwen3-tiny-{f32,q8_0,q4_k_m}.gguf
under --dest (default ~/.cache/pagedserve/models, where tests/e2e/test_gguf_parity.py
looks). The converter wants the `sentencepiece` module importable (only imported).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from transformers import Qwen3Config

from model_runner.gguf_file import models_dir
from tests.support.model_helpers import TINY, make_model_folder

# NOTE: head_dim 128 as in every Qwen3: transformers' reading of a GGUF's qwen3 config
# drops attention.key_length, so another head size is misread by HF and by our loader
QWEN3_SHAPE = dict(TINY, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)


def make_files(llama_cpp: Path, dest: Path, llama_quantize: Path | None) -> list[Path]:
    """The tiny Qwen3's GGUFs under `dest`: F32 and Q8_0, Q4_K_M with `llama_quantize`."""
    dest.mkdir(parents=True, exist_ok=True)
    made = []
    with tempfile.TemporaryDirectory(prefix="qwen3-tiny-") as folder:
        config = Qwen3Config(**QWEN3_SHAPE, head_dim=128, tie_word_embeddings=False)
        make_model_folder(Path(folder), config, norm_noise=0.1)
        for outtype in ("f32", "q8_0"):
            out = dest / f"qwen3-tiny-{outtype}.gguf"
            subprocess.run([sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), folder,
                            "--outtype", outtype, "--outfile", str(out)], check=True)
            made.append(out)
    if llama_quantize is not None:
        out = dest / "qwen3-tiny-q4_k_m.gguf"
        subprocess.run([str(llama_quantize), str(made[0]), str(out), "Q4_K_M"], check=True)
        made.append(out)
    return made


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-cpp", type=Path, required=True,
                        help="llama.cpp's source tree (convert_hf_to_gguf.py)")
    parser.add_argument("--llama-quantize", type=Path, default=None,
                        help="llama.cpp's llama-quantize binary: also a Q4_K_M file")
    parser.add_argument("--dest", type=Path, default=None)
    args = parser.parse_args(argv)
    for path in make_files(args.llama_cpp, (args.dest or models_dir()).expanduser(),
                           args.llama_quantize):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
