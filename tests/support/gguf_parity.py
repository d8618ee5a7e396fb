"""A GGUF file through the loader and the runner against Hugging Face's own reading of the
same file (`from_pretrained(folder, gguf_file=...)`, transformers' dequantization): greedy
tokens, up to the first step where HF's top two logits nearly tie, and teacher-forced
top-1 agreement on tests.support.quality's English text. Both sides in float32.

    python -m tests.support.gguf_parity FILE.gguf [FILE.gguf ...]   # the table, one row a file
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch

from model_runner.config import ModelConfig
from model_runner.loader import LoadedModel, load_model
from model_runner.runner import ModelRunner
from tests.support.model_helpers import MIN_MARGIN, RunnerLoop, Seq, load_hf_model
from tests.support.quality import reference_token_ids, teacher_forced_logits

QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why each is prime.",
)
NUM_NEW_TOKENS = 24
TEACHER_FORCED_TOKENS = 512


@dataclass(frozen=True)
class GreedyParity:
    """One prompt: the runner's greedy tokens, HF's choice after each of their prefixes,
    and how many steps count: those before HF's first top-1/top-2 margin under MIN_MARGIN
    (a near tie that float32's summation order may flip; after it the texts may part)."""

    ours: list[int]
    hf: list[int]
    num_clear: int

    @property
    def equal(self) -> bool:
        return self.ours[: self.num_clear] == self.hf[: self.num_clear]


@dataclass(frozen=True)
class FileParity:
    name: str
    greedy: list[GreedyParity]
    top1_agreement: float  # teacher-forced, over `num_positions`
    num_positions: int

    def row(self) -> str:
        equal = sum(g.equal for g in self.greedy)
        clear = sum(g.num_clear for g in self.greedy)
        return (f"| {self.name} | {equal} of {len(self.greedy)} ({clear} of "
                f"{len(self.greedy) * NUM_NEW_TOKENS} tokens clear) | "
                f"{self.top1_agreement:.2%} of {self.num_positions} |")


def load_pair(path: Path) -> tuple[LoadedModel, torch.nn.Module]:
    """The loader's and Hugging Face's readings of the GGUF `path`, float32, on the CPU."""
    loaded = load_model(ModelConfig(model=str(path), dtype="float32", device="cpu",
                                    num_kv_blocks=1))
    return loaded, load_hf_model(str(path))


def chat_prompts(loaded: LoadedModel) -> list[list[int]]:
    """QUESTIONS as the model's chat template renders them (plain text without one)."""
    tokenizer = loaded.tokenizer
    if not tokenizer.chat_template:
        return [list(tokenizer(q).input_ids) for q in QUESTIONS]
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                               add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"])
            for q in QUESTIONS]


@torch.inference_mode()
def check_greedy(hf: torch.nn.Module, prompt: list[int], ours: list[int]) -> GreedyParity:
    """HF's greedy choice at each of `ours`'s steps, from one forward over the prompt and
    `ours`: while ours equal HF's choices they are what HF's `generate` gives, so the first
    step they differ is where the texts part (one forward, not one a token)."""
    logits = hf(torch.tensor([prompt + ours])).logits[0, len(prompt) - 1 : -1].float()
    top2 = logits.topk(2, dim=-1)
    near_ties = ((top2.values[:, 0] - top2.values[:, 1]) < MIN_MARGIN).nonzero()
    num_clear = int(near_ties[0]) if len(near_ties) else len(ours)
    return GreedyParity(ours, top2.indices[:, 0].tolist(), num_clear)


def greedy_parity(loaded: LoadedModel, hf: torch.nn.Module) -> list[GreedyParity]:
    """The chat prompts' greedy tokens through the runner, all in one batch, against HF's."""
    prompts = chat_prompts(loaded)
    config = ModelConfig(model=loaded.model_path, dtype="float32", device="cpu",
                         num_kv_blocks=64)
    seqs = [Seq(f"r{i}", p, NUM_NEW_TOKENS) for i, p in enumerate(prompts)]
    ours = RunnerLoop(ModelRunner(loaded, config)).run(seqs)
    return [check_greedy(hf, p, o) for p, o in zip(prompts, ours, strict=True)]


@torch.inference_mode()
def teacher_forced_agreement(loaded: LoadedModel, hf: torch.nn.Module) -> tuple[float, int]:
    """Top-1 agreement of the runner's model with HF on the English text's first
    TEACHER_FORCED_TOKENS tokens, and that count."""
    token_ids = reference_token_ids(loaded)[:, :TEACHER_FORCED_TOKENS]
    ours = teacher_forced_logits(loaded, token_ids).argmax(-1)
    theirs = hf(token_ids).logits[0].argmax(-1)
    return (ours == theirs).float().mean().item(), token_ids.shape[1]


def file_parity(path: Path) -> FileParity:
    loaded, hf = load_pair(path)
    agreement, positions = teacher_forced_agreement(loaded, hf)
    return FileParity(path.name, greedy_parity(loaded, hf), agreement, positions)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", type=Path, nargs="+")
    args = parser.parse_args()
    print("| file | greedy prompts equal | teacher-forced top-1 |\n|---|---|---|")
    for path in args.files:
        print(file_parity(path).row(), flush=True)


if __name__ == "__main__":
    main()
