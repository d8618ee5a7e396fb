"""The served tokenizer: a model folder's tokenizer.json on the `tokenizers` library alone,
giving what transformers' fast tokenizer gives (ids with and without special tokens, text,
vocabulary, special ids, the chat template: model_runner/chat_jinja.py) without importing
transformers or torch: the API process's tokenizer. A folder with no tokenizer.json gets
transformers' tokenizer (`load_tokenizer`, imported only then).

NOTE: as transformers 5 reads a folder with a tokenizer.json: its post-processor adds the
BOS/EOS (tokenizer_config.json's add_bos_token and add_eos_token are dropped then), the
named special tokens it lacks are added as special tokens, and the model's own tokenizer
class rebuilds nothing that the tokenizer.json transformers writes does not already say.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer

from model_runner.chat_jinja import render_chat

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"


class TextTokenizer:
    """tokenizer.json and tokenizer_config.json of `folder`, read-only once loaded (no
    truncation or padding, so that threads share one: a 262k-token tokenizer holds ~100 MB,
    ~300 MB while it loads); picklable (template worker processes get a copy)."""

    def __init__(self, folder: Path) -> None:
        try:
            backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
            config_file = folder / "tokenizer_config.json"
            config: dict[str, Any] = (json.loads(config_file.read_text())
                                      if config_file.is_file() else {})
        except Exception as e:  # OSError, ValueError, or tokenizers' plain Exception
            raise ValueError(f"cannot load the tokenizer of {folder}: {e}") from e
        backend.no_truncation()
        backend.no_padding()
        self.special_tokens_map = {name: _content(config[name]) for name in SPECIAL_TOKEN_NAMES
                                   if _content(config.get(name)) is not None}
        listed = config.get("extra_special_tokens") or config.get("additional_special_tokens")
        extra = [_content(t) for t in (listed.values() if isinstance(listed, dict)
                                       else listed or ())]
        _add_missing_special_tokens(backend, [*self.special_tokens_map.values(), *extra])
        backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
        self.backend_tokenizer = backend
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces")) and (
            type(backend.model).__name__ != "BPE" or bool(config.get(
                "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")))
        self.chat_template = _chat_templates(folder, config.get("chat_template"))

    # ------------------------------------------------------------ ids and text

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`text`'s ids (with the post-processor's BOS/EOS when `add_special_tokens`)."""
        return list(self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        text = str(self.backend_tokenizer.decode(token_ids,
                                                 skip_special_tokens=skip_special_tokens))
        return _clean_up_tokenization(text) if self.clean_up_tokenization_spaces else text

    def get_vocab(self) -> dict[str, int]:
        return dict(self.backend_tokenizer.get_vocab(with_added_tokens=True))

    def __len__(self) -> int:
        return int(self.backend_tokenizer.get_vocab_size(with_added_tokens=True))

    def token_id(self, token: str | None) -> int | None:
        """`token`'s id (the unknown token's when it has none), as transformers converts."""
        if token is None:
            return None
        found = self.backend_tokenizer.token_to_id(token)
        unknown = self.special_tokens_map.get("unk_token")
        if found is None and unknown is not None:
            found = self.backend_tokenizer.token_to_id(unknown)
        return None if found is None else int(found)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_id(self.special_tokens_map.get("eos_token"))

    @property
    def bos_token_id(self) -> int | None:
        return self.token_id(self.special_tokens_map.get("bos_token"))

    # ------------------------------------------------------------ chat

    def apply_chat_template(
        self, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None, chat_template: str | None = None,
        add_generation_prompt: bool = False, continue_final_message: bool | str = False,
        tokenize: bool = True, **kwargs: Any,
    ) -> str | list[int]:
        """The messages through the chat template (`chat_template`: a template or the name
        of one of the folder's), as transformers' `apply_chat_template` renders them; their
        ids without further special tokens when `tokenize`. ValueError, TypeError or
        jinja's TemplateError when the messages do not fit."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt are not compatible")
        template = self._template(chat_template, tools)
        text = render_chat(template, conversation, tools=tools, documents=documents,
                           add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message,
                           variables={**self.special_tokens_map, **kwargs})
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _template(self, chat_template: str | None, tools: list[dict[str, Any]] | None) -> str:
        """The template text to render, chosen as transformers' `get_chat_template` does."""
        own = self.chat_template
        if isinstance(own, dict):
            if chat_template is not None:
                return own.get(chat_template, chat_template)
            if tools is not None and "tool_use" in own:
                return own["tool_use"]
            if "default" in own:
                return own["default"]
            raise ValueError("This model has multiple chat templates with no default "
                             f"specified; its template names are {sorted(own)}.")
        if chat_template is not None:
            return chat_template
        if own is None:
            raise ValueError("Cannot use chat template functions because the tokenizer has no "
                             "chat template and no template was passed.")
        return own


def load_tokenizer(folder: Path) -> Any:
    """The folder's tokenizer: a `TextTokenizer` from its tokenizer.json, or transformers'
    (`hf_tokenizer`) for a folder without one (a slow tokenizer's files)."""
    if (folder / "tokenizer.json").is_file():
        return TextTokenizer(folder)
    return hf_tokenizer(folder)


def hf_tokenizer(folder: Path) -> Any:
    """transformers' tokenizer of the folder, read-only from here on: with no truncation or
    padding set (a served prompt is never cut or padded), encoding and decoding only read
    the fast tokenizer's Rust object, so that threads share one."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # NOTE: before transformers is imported
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (ValueError, KeyError, OSError) as e:
        raise ValueError(f"cannot load the tokenizer of {folder}: {e}") from e
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        # NOTE: transformers' encode unsets them on its first call otherwise: a write
        backend.no_truncation()
        backend.no_padding()
    return tokenizer


def _content(token: object) -> str | None:
    """A special token of tokenizer_config.json (a string, or an AddedToken's dict) as text."""
    content = token.get("content") if isinstance(token, dict) else token
    return content if isinstance(content, str) else None


def _add_missing_special_tokens(backend: Tokenizer, tokens: list[str | None]) -> None:
    """The special tokens the tokenizer.json lacks among its added tokens, added as special
    (as transformers adds them at load)."""
    have = {token.content for token in backend.get_added_tokens_decoder().values()}
    missing = [t for t in dict.fromkeys(tokens) if t is not None and t not in have]
    if missing:
        backend.add_tokens([AddedToken(t, special=True) for t in missing])


def _chat_templates(folder: Path, configured: object) -> str | dict[str, str] | None:
    """The folder's chat template(s): chat_template.jinja and additional_chat_templates/
    over tokenizer_config.json's (a template, or a list of named ones), as transformers
    reads them."""
    templates = {}
    if (folder / CHAT_TEMPLATE_FILE).is_file():
        templates["default"] = (folder / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    if (folder / CHAT_TEMPLATE_DIR).is_dir():
        for file in sorted((folder / CHAT_TEMPLATE_DIR).glob("*.jinja")):
            templates[file.name.removesuffix(".jinja")] = file.read_text(encoding="utf-8")
    if templates:
        return templates["default"] if list(templates) == ["default"] else templates
    if isinstance(configured, list):
        return {str(t["name"]): str(t["template"]) for t in configured}
    return configured if isinstance(configured, str) else None


def _clean_up_tokenization(text: str) -> str:
    """transformers' `clean_up_tokenization` (spaces before punctuation and contractions)."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                          (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"),
                          (" 're", "'re")):
        text = text.replace(before, after)
    return text
