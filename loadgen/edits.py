"""Input-copying prompts: rewrite a given block of code or prose with a small edit.

The blocks are real text, kept in edit_texts.txt (Python code and English prose, each 256
to 512 tokens for SmolLM2's tokenizer). Each prompt takes one block, makes a seeded change
to it (a typo to fix, a name to rename) and asks for the block back in full, so that
nearly all of the answer copies the prompt: the case n-gram speculation is built for.
"""

from __future__ import annotations

import functools
import keyword
import random
import re
from dataclasses import dataclass
from pathlib import Path

TEXTS_FILE = Path(__file__).with_name("edit_texts.txt")
# NOTE: SmolLM2's tokenizer takes 3.5 to 4.6 characters a token on these blocks; counting
# 4.5 keeps an answer's max_tokens within the block it copies, without a tokenizer here.
CHARS_PER_TOKEN = 4.5
MIN_TOKENS, MAX_TOKENS = 256, 512

_NAME = re.compile(r"\b[a-z][a-z_]{5,}\b")
_WORD = re.compile(r"\b[a-z]{6,}\b")
_PROSE_TYPOS = (2, 4)


@dataclass(frozen=True)
class Block:
    kind: str  # "code" or "prose"
    text: str


@dataclass(frozen=True)
class EditPrompt:
    prompt: str
    answer_tokens: int  # the length of the answer (the block) in tokens, estimated


@functools.cache
def load_blocks() -> tuple[Block, ...]:
    """The blocks of edit_texts.txt: each starts with a line `### code python` or
    `### prose`."""
    parts = TEXTS_FILE.read_text().split("### ")[1:]
    blocks = []
    for part in parts:
        head, _, body = part.partition("\n")
        blocks.append(Block(head.split()[0], body.rstrip("\n")))
    return tuple(blocks)


def _swap_letters(word: str, rng: random.Random) -> str:
    """`word` with two different neighbouring inner letters swapped (a typo)."""
    i = rng.choice([i for i in range(1, len(word) - 2) if word[i] != word[i + 1]])
    return word[:i] + word[i + 1] + word[i] + word[i + 2:]


def _code_names(text: str) -> list[str]:
    return sorted(set(_NAME.findall(text)) - set(keyword.kwlist))


def _code_typo(text: str, rng: random.Random) -> tuple[str, str]:
    name = rng.choice(_code_names(text))
    spans = [m.span() for m in re.finditer(rf"\b{name}\b", text)]
    start, end = rng.choice(spans)
    typo = _swap_letters(name, rng)
    task = ("The following Python code has a typo in one of its names. Rewrite the code in "
            "full with the typo fixed and nothing else changed.")
    return task, text[:start] + typo + text[end:]


def _code_rename(text: str, rng: random.Random) -> tuple[str, str]:
    names = [n for n in _code_names(text) if len(re.findall(rf"\b{n}\b", text)) >= 3]
    name = rng.choice(names)
    new = f"{name}_{rng.choice(('data', 'items', 'state', 'value'))}"
    task = (f"Rewrite the following Python code in full with `{name}` renamed to `{new}` "
            "everywhere and nothing else changed.")
    return task, text


def _prose_typos(text: str, rng: random.Random) -> tuple[str, str]:
    spans = [m.span() for m in _WORD.finditer(text)]
    chosen = sorted(rng.sample(spans, rng.randint(*_PROSE_TYPOS)), reverse=True)
    for start, end in chosen:
        text = text[:start] + _swap_letters(text[start:end], rng) + text[end:]
    task = ("Fix the spelling mistakes in the following text. Rewrite the text in full and "
            "change nothing else.")
    return task, text


def edit_prompt(block: Block, rng: random.Random) -> EditPrompt:
    """A prompt asking for `block` back in full with one seeded edit made."""
    if block.kind == "code":
        edit = rng.choice((_code_typo, _code_rename))
        task, shown = edit(block.text, rng)
        fence, lead = "```python", "Here is the code, rewritten:"
    else:
        task, shown = _prose_typos(block.text, rng)
        fence, lead = "```text", "Here is the text, corrected:"
    prompt = f"{task}\n\n{fence}\n{shown}\n```\n\n{lead}\n\n{fence}\n"
    answer = round(len(block.text) / CHARS_PER_TOKEN)
    return EditPrompt(prompt, min(MAX_TOKENS, max(MIN_TOKENS, answer)))


def edit_prompts(n: int, rng: random.Random) -> list[EditPrompt]:
    """`n` prompts over the blocks in a seeded order, each block used again only once all
    have been."""
    blocks = list(load_blocks())
    prompts: list[EditPrompt] = []
    while len(prompts) < n:
        rng.shuffle(blocks)
        prompts += [edit_prompt(block, rng) for block in blocks[: n - len(prompts)]]
    return prompts
