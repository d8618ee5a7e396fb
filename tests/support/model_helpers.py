"""Tiny random models of every supported family saved to disk with the default model's
tokenizer, prompts (token ids or texts) whose greedy tokens Hugging Face picks by a clear
margin, and a minimal engine loop over ModelRunner.

Shared by the runner's unit tests, the CUDA-graph tests and the SmolLM2 parity test: the
loop (`RunnerLoop`) drives `ModelRunner.execute` with hand-built `SchedulerOutput`s, blocks
handed out by a counter, no scheduler.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path

import torch
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
    PretrainedConfig,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    SmolLM3Config,
)

from model_runner.block_tables import BlockTables
from model_runner.config import ModelConfig
from model_runner.loader import LoadedModel, load_model, load_model_spec
from model_runner.runner import ModelRunner, prepare_inputs
from scheduler.output import ScheduledRequest, SchedulerOutput
from scheduler.sampling_params import SamplingParams

# The default model's (SmolLM2's) tokenizer is every tiny checkpoint's: its vocabulary and
# special ids (<|im_start|>, <|im_end|> twice), which save_tokenizer checks against it.
VOCAB = 49152
BOS_ID, EOS_ID, PAD_ID = 1, 2, 2
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
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    pad_token_id=PAD_ID,
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



@cache
def default_tokenizer() -> PreTrainedTokenizerBase:
    """The default model's tokenizer (chat template included) as the loader builds it: from
    the GGUF's metadata on first use, then from its cached folder; once per process."""
    return load_model_spec(ModelConfig()).tokenizer


def load_hf_model(model_path: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Hugging Face's own reading of a model the loader read (`LoadedModel.model_path`): a
    folder, or a GGUF file (transformers dequantizes it: ~5 s for the default model)."""
    path = Path(model_path)
    where, kwargs = (path.parent, {"gguf_file": path.name}) if path.is_file() else (path, {})
    return AutoModelForCausalLM.from_pretrained(
        where, dtype=dtype, local_files_only=True, **kwargs).eval()


def save_tokenizer(folder: Path, hf_config: PretrainedConfig) -> None:
    """The default model's tokenizer into `folder`, once `hf_config`'s vocabulary covers its
    ids and its BOS, EOS and padding ids are the tokenizer's."""
    tokenizer = default_tokenizer()
    ours = (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    theirs = (hf_config.bos_token_id, hf_config.eos_token_id, hf_config.pad_token_id)
    if hf_config.vocab_size < len(tokenizer) or ours != theirs:
        raise ValueError(f"a config of {hf_config.vocab_size} ids and special ids {theirs} "
                         f"does not fit the tokenizer's {len(tokenizer)} and {ours}")
    tokenizer.save_pretrained(folder)


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
    save_tokenizer(folder, hf_config)
    hf_model.generation_config.eos_token_id = None  # generate fixed lengths
    return hf_model


def make_repeating_model(folder: Path, live_ids: int) -> TinyModel:
    """The tiny SmolLM2-shaped model (CONFIGS["smollm2"]) in `folder`, whose output rows
    past the first `live_ids` ids score 0: its greedy text repeats itself, so n-gram drafts
    get accepted as with a small vocabulary (the speculation tests)."""
    hf_model = make_model_folder(folder, CONFIGS["smollm2"]())
    with torch.no_grad():
        hf_model.get_output_embeddings().weight[live_ids:] = 0
    hf_model.save_pretrained(folder)
    return TinyModel(hf_model, load_model(ModelConfig(model=str(folder), num_kv_blocks=1)))


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
        return greedy_margin(self.hf, prompt, max_new_tokens)[0]


MIN_MARGIN = 1e-3  # between the top two logits: far above float32's disagreements


@torch.inference_mode()
def greedy_margin(
    hf_model: torch.nn.Module, prompt: list[int], max_new_tokens: int
) -> tuple[list[int], float]:
    """Hugging Face's greedy tokens after `prompt`, and the smallest gap between its top two
    logits over them: how far a near tie is from flipping one."""
    ids = torch.tensor([prompt])
    # NOTE: the mask given, or generate masks the padding id (a chat's <|im_end|>) out
    out = hf_model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
        do_sample=False, pad_token_id=PAD_ID, output_logits=True, return_dict_in_generate=True,
    )
    top2 = torch.cat(out.logits).float().topk(2, dim=-1).values
    return out.sequences[0, len(prompt) :].tolist(), float((top2[:, 0] - top2[:, 1]).min())


def clear_margin_generations(
    hf: torch.nn.Module, candidates: list[list[int]], max_new_tokens: int, min_margin: float
) -> dict[tuple[int, ...], list[int]]:
    """HF's greedy tokens for the candidate prompts whose top-1 logit beats the top-2 by
    more than `min_margin` at every step (random weights give small margins)."""
    found = {}
    for prompt in candidates:
        tokens, margin = greedy_margin(hf, prompt, max_new_tokens)
        if margin > min_margin:
            found[tuple(prompt)] = tokens
    return found


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]

def assert_chunked_logits_match_hf(tiny: TinyModel, runner: ModelRunner) -> None:
    """The runner's logits equal HF's forward for a whole prompt and for a chunk after a
    cached 12-token prefix, in one step (both past a window of 8)."""
    p0, p1 = prompts([21, 29], seed=4)
    first = [ScheduledRequest("b", p1[:12], 0, list(range(10, 18)), False, GREEDY, p1, [])]
    inputs = prepare_inputs(first, BlockTables(4), runner.device)
    tiny.loaded.model(inputs.input_ids, inputs.positions, inputs.meta, runner.kv_cache.layers,
                      runner.attn)
    step = [
        ScheduledRequest("a", p0, 0, list(range(6)), True, GREEDY, p0, []),
        ScheduledRequest("b", p1[12:], 12, list(range(10, 18)), True, GREEDY, p1, []),
    ]
    inputs = prepare_inputs(step, BlockTables(4), runner.device)
    hidden = tiny.loaded.model(inputs.input_ids, inputs.positions, inputs.meta,
                               runner.kv_cache.layers, runner.attn)
    logits = tiny.loaded.model.compute_logits(hidden)
    want = torch.cat([tiny.hf(torch.tensor([p0])).logits[0],
                      tiny.hf(torch.tensor([p1])).logits[0, 12:]])
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())



@cache
def token_texts() -> tuple[str, ...]:
    """Each id's text under the default tokenizer: how a server's logprobs name a token."""
    tokenizer = default_tokenizer()
    return tuple(tokenizer.batch_decode([[i] for i in range(len(tokenizer))]))


@cache
def _named_ids() -> frozenset[int]:
    """The ids whose text no other id has (all but the bytes of longer UTF-8 characters)."""
    counts: dict[str, int] = {}
    for text in token_texts():
        counts[text] = counts.get(text, 0) + 1
    return frozenset(i for i, text in enumerate(token_texts()) if counts[text] == 1)


@cache
def _word_ids() -> tuple[int, ...]:
    """The ids whose text is a space and a lowercase ASCII word: most runs of them are texts
    that tokenize back to those ids (`text_prompt` checks)."""
    return tuple(i for i, text in enumerate(token_texts())
                 if text[:1] == " " and text[1:].isascii() and text[1:].isalpha()
                 and text[1:].islower())


@dataclass(frozen=True)
class TextPrompt:
    """A text as a request sends it (a completion's prompt, or a chat's one user message),
    its ids as the server tokenizes it (the text, or the chat it renders), and Hugging
    Face's greedy tokens after them."""

    text: str
    ids: list[int]
    greedy: list[int] = field(default_factory=list)

    @property
    def messages(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.text}]


def text_prompt(word_ids: list[int], chat: bool) -> TextPrompt | None:
    """The text of `word_ids`, or the chat of one user message saying it; None when the text
    does not tokenize back to `word_ids`."""
    tokenizer = default_tokenizer()
    text = tokenizer.decode(word_ids)
    if tokenizer.encode(text, add_special_tokens=False) != word_ids:
        return None
    if not chat:
        return TextPrompt(text, tokenizer.encode(text))
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    return TextPrompt(text, tokenizer.encode(rendered, add_special_tokens=False))


def margin_texts(
    hf_model: torch.nn.Module,
    lengths: list[int],
    max_new_tokens: int,
    seed: int = 0,
    shared: int = 0,
    chat: bool = False,
) -> list[TextPrompt]:
    """Texts of `lengths` words of the default tokenizer (the first `shared` common to all;
    sent as they are, or as a chat's user message) with their `max_new_tokens` greedy
    tokens, which Hugging Face picks by at least MIN_MARGIN at every step, each a token
    whose text names it: each text drawn again (from one generator seeded by `seed`) until
    they are, so that random weights' near ties never decide a parity test, and the tokens
    a server's logprobs name are its ids."""
    gen = torch.Generator().manual_seed(seed)
    words = _word_ids()

    def draw(n: int) -> list[int]:
        return [words[i] for i in torch.randint(len(words), (n,), generator=gen).tolist()]

    prefix = draw(shared)
    picked = []
    for length in lengths:
        for _ in range(100):
            prompt = text_prompt(prefix + draw(length - shared), chat)
            if prompt is None:
                continue
            tokens, margin = greedy_margin(hf_model, prompt.ids, max_new_tokens)
            if margin >= MIN_MARGIN and _named_ids().issuperset(tokens):
                picked.append(replace(prompt, greedy=tokens))
                break
        else:
            raise ValueError(f"no text of {length} words with a clear greedy margin")
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
    lora_name: str | None = None  # its LoRA adapter (None: the base model)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_tokens


class RunnerLoop:
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
                    lora_name=s.lora_name,
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


