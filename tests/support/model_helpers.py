"""Tiny random models of every supported family saved to disk, prompts whose greedy tokens
Hugging Face picks by a clear margin, and a minimal engine loop over ModelRunner.

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
    Gemma2Config,
    Gemma3TextConfig,
    GptOssConfig,
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Olmo2Config,
    Phi3Config,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    SmolLM3Config,
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
def phi3_config(max_position_embeddings: int, original_max_position_embeddings: int) -> Phi3Config:
    return Phi3Config(
        **{**TINY, "max_position_embeddings": max_position_embeddings},
        sliding_window=None,
        original_max_position_embeddings=original_max_position_embeddings,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "short_factor": [1.0, 1.2, 1.6, 2.5],
            "long_factor": [1.5, 2.0, 4.0, 8.0],
            "original_max_position_embeddings": original_max_position_embeddings,
        },
    )


# The other decoder families, each with its own knobs away from their defaults.
FAMILY_CONFIGS = {
    # half the head rotated; LongRoPE's short factors (a context of at most the original
    # 64 tokens; test_model_runner.py tests the long ones)
    "phi3": lambda: phi3_config(max_position_embeddings=64, original_max_position_embeddings=64),
    # layer 1 of 2 without RoPE (NoPE)
    "smollm3": lambda: SmolLM3Config(**TINY, no_rope_layer_interval=2),
    "granite": lambda: GraniteConfig(
        **TINY,
        embedding_multiplier=3.0,
        attention_multiplier=0.1,
        residual_multiplier=0.5,
        logits_scaling=2.0,
    ),
    "olmo2": lambda: Olmo2Config(**TINY),
}
# mixtures of experts: 8 experts, 2 a token, so a short prompt leaves some without any
MOE_CONFIGS = {
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
# sliding windows of 8 tokens that the tests' contexts cross: Gemma's local and global
# layers (Gemma 2 soft-capped; Gemma 3 with QK-norm, local layers on their own RoPE base),
# Mistral and Qwen2 with a window
WINDOW = 8
GEMMA = dict(TINY, num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=24,
             sliding_window=WINDOW)
WINDOWED_CONFIGS = {
    "gemma2": lambda: Gemma2Config(**GEMMA, attn_logit_softcapping=2.0,
                                   final_logit_softcapping=20.0),
    "gemma3": lambda: Gemma3TextConfig(
        **GEMMA,
        layer_types=["sliding_attention", "sliding_attention", "full_attention",
                     "sliding_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        },
    ),
    "mistral-window": lambda: MistralConfig(**TINY, sliding_window=WINDOW),
    "qwen2-window": lambda: Qwen2Config(**dict(TINY, num_hidden_layers=3),
                                        use_sliding_window=True, sliding_window=WINDOW,
                                        max_window_layers=1),
    # sliding and full layers alternating, sinks, 4 experts (2 a token) with biases and a
    # clamped SwiGLU whose limit the activations reach, YaRN stretching 64 positions to 256
    "gpt_oss": lambda: GptOssConfig(
        **dict(TINY, num_hidden_layers=3, head_dim=16, intermediate_size=32),
        sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2, swiglu_limit=1.0,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 64},
    ),
}
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
    **FAMILY_CONFIGS,
    **MOE_CONFIGS,
}



def save_tokenizer(folder: Path) -> None:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(folder)


def make_model_folder(folder: Path, hf_config, norm_noise: float = 0.0) -> torch.nn.Module:
    """A random model from `hf_config` saved to `folder`; `norm_noise` moves the norm
    weights off their init by that much noise (Gemma inits (1 + w) norms at w = 0)."""
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(hf_config).eval()
    if norm_noise:
        with torch.no_grad():
            for name, param in hf_model.named_parameters():
                if "norm" in name:
                    param.add_(torch.randn(param.shape) * norm_noise)
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



def clear_margin_generations(
    hf: torch.nn.Module, candidates: list[list[int]], max_new_tokens: int, min_margin: float
) -> dict[tuple[int, ...], list[int]]:
    """HF's greedy tokens for the candidate prompts whose top-1 logit beats the top-2 by
    more than `min_margin` at every step (random weights give small margins)."""
    found = {}
    for prompt in candidates:
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                          do_sample=False, pad_token_id=0, output_logits=True,
                          return_dict_in_generate=True)
        top2 = torch.cat(out.logits).topk(2, dim=-1).values
        if float((top2[:, 0] - top2[:, 1]).min()) > min_margin:
            found[tuple(prompt)] = out.sequences[0, len(prompt):].tolist()
    return found


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


MIN_MARGIN = 1e-3  # between the top two logits: far above float32's disagreements


@torch.inference_mode()
def greedy_margin(hf_model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> float:
    """The smallest gap between Hugging Face's top two logits over the greedy tokens of
    `prompt`: how far a near tie is from flipping one."""
    out = hf_model.generate(
        torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
        pad_token_id=0, output_scores=True, return_dict_in_generate=True,
    )
    return min(float(-scores[0].float().topk(2).values.diff()) for scores in out.scores)


def margin_prompts(
    hf_model: torch.nn.Module,
    lengths: list[int],
    max_new_tokens: int,
    seed: int = 0,
    shared: int = 0,
) -> list[list[int]]:
    """Random prompts of `lengths` (the first `shared` tokens common to all) whose greedy
    tokens Hugging Face picks by at least MIN_MARGIN at every step: each drawn again (from
    one generator seeded by `seed`) until it does, so random weights' near ties never
    decide a parity test."""
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, VOCAB, (shared,), generator=gen).tolist()
    picked = []
    for length in lengths:
        for _ in range(100):
            prompt = prefix + torch.randint(3, VOCAB, (length - shared,), generator=gen).tolist()
            if greedy_margin(hf_model, prompt, max_new_tokens) >= MIN_MARGIN:
                picked.append(prompt)
                break
        else:
            raise ValueError(f"no prompt of {length} tokens with a clear greedy margin")
    return picked


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


