"""Tiny random Llama-family models saved to disk, and a minimal engine loop over ModelRunner.

Shared by the runner's unit tests, the CUDA-graph tests and the SmolLM2 parity test: the
loop (`Engine`) drives `ModelRunner.execute` with hand-built `SchedulerOutput`s, blocks
handed out by a counter, no scheduler.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from model_runner.config import ModelConfig
from model_runner.loader import LoadedModel
from model_runner.runner import ModelRunner
from scheduler.output import ScheduledRequest, SchedulerOutput
from scheduler.sampling_params import SamplingParams

VOCAB = 256
GREEDY = SamplingParams(temperature=0.0)
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    # NOTE: a wide init makes the logits peaked, so greedy never rests on a near tie
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
CONFIGS = {
    "llama3": lambda: LlamaConfig(
        **TINY,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "smollm2": lambda: LlamaConfig(**TINY, tie_word_embeddings=True),
    "qwen2": lambda: Qwen2Config(**TINY, tie_word_embeddings=True),
    "qwen3": lambda: Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=False),
    "mistral": lambda: MistralConfig(**TINY, sliding_window=None),
    # mixtures of experts: 8 experts, 2 a token, so a short prompt leaves some without any
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **TINY, head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=True, mlp_only_layers=[1],  # layer 1 dense
    ),
    "qwen2_moe": lambda: Qwen2MoeConfig(  # a shared expert behind its gate, no renorm
        **TINY, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
    ),
    "mixtral": lambda: MixtralConfig(**TINY, num_local_experts=8, num_experts_per_tok=2),
}



def save_tokenizer(folder: Path) -> None:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(folder)


def make_model_folder(folder: Path, hf_config) -> torch.nn.Module:
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(hf_config).eval()
    hf_model.save_pretrained(folder)
    save_tokenizer(folder)
    hf_model.generation_config.eos_token_id = None  # generate fixed lengths
    return hf_model


@dataclass
class TinyModel:
    hf: torch.nn.Module
    loaded: LoadedModel

    def runner(
        self,
        block_size: int = 4,
        num_kv_blocks: int = 256,
        seed: int = 0,
        attention_backend: str = "auto",
    ):
        config = ModelConfig(
            model=self.loaded.model_path,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            seed=seed,
            attention_backend=attention_backend,
        )
        return ModelRunner(self.loaded, config)

    def generate(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        ids = torch.tensor([prompt])
        out = self.hf.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
        return out[0, len(prompt) :].tolist()



def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


@dataclass
class Seq:
    request_id: str
    prompt: list[int]
    max_tokens: int
    params: SamplingParams = GREEDY
    output: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_tokens


class Engine:
    """A minimal engine loop: every unfinished sequence gets up to `chunk_size` tokens a
    step; blocks come from a counter and are never freed."""

    def __init__(self, runner: ModelRunner, chunk_size: int | None = None) -> None:
        self.runner = runner
        self.chunk_size = chunk_size
        self.next_block = itertools.count()

    def step(self, seqs: list[Seq]) -> None:
        scheduled = []
        for s in seqs:
            if s.done:
                continue
            tokens = s.tokens
            n = len(tokens) - s.num_computed
            if self.chunk_size is not None:
                n = min(n, self.chunk_size)
            end = s.num_computed + n
            while len(s.block_table) * self.runner.block_size < end:
                s.block_table.append(next(self.next_block))
            scheduled.append(
                ScheduledRequest(
                    request_id=s.request_id,
                    token_ids=tokens[s.num_computed : end],
                    num_computed_tokens=s.num_computed,
                    block_table=list(s.block_table),
                    sample=end == len(tokens),
                    sampling_params=s.params,
                    prompt_token_ids=s.prompt,
                    output_token_ids=s.output,
                )
            )
            s.num_computed = end
        out = self.runner.execute(SchedulerOutput(scheduled=scheduled))
        for s in seqs:
            if s.request_id in out.sampled_token_ids:
                s.output.append(out.sampled_token_ids[s.request_id])

    def run(self, seqs: list[Seq]) -> list[list[int]]:
        while not all(s.done for s in seqs):
            self.step(seqs)
        return [s.output for s in seqs]


def greedy_seqs(lengths: list[int], max_tokens: int, seed: int = 0) -> list[Seq]:
    return [Seq(f"r{i}", p, max_tokens) for i, p in enumerate(prompts(lengths, seed))]


