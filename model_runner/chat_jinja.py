"""A chat template rendered as transformers renders it (`render_jinja_template` of its
utils/chat_template_utils.py), on jinja2 alone: the same sandboxed environment
(ImmutableSandboxedEnvironment with trim_blocks, lstrip_blocks, loopcontrols and the
`{% generation %}` tag), its `tojson` (no HTML escaping; indent, separators, sort_keys),
`raise_exception`, `strftime_now`, its restricted `dict` and `namespace`; the messages as
plain JSON data with no None-valued keys and their reasoning under each name templates
read; tools, documents and every other variable (the special tokens, a request's
chat_template_kwargs) passed through; `continue_final_message` cut at the final message.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# the names a message's reasoning goes by (the first: the standard one templates read)
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def render_chat(
    template: str, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None,
    documents: list[dict[str, Any]] | None, add_generation_prompt: bool,
    continue_final_message: bool | str, variables: dict[str, Any],
) -> str:
    """`template` over the messages; ValueError, TypeError or jinja's TemplateError when
    they do not fit it."""
    if tools is not None and not all(isinstance(tool, dict) for tool in tools):
        raise ValueError("Tools should be JSON schemas (dicts).")
    if documents is not None and not all(isinstance(doc, dict) for doc in documents):
        raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
    for message in messages:
        if not isinstance(message, dict):
            raise TypeError(f"Chat messages should be dicts, but got {message!r}.")
    chat = [_aliased({k: v for k, v in _plain(message).items() if v is not None})
            for message in messages]
    final = _tag_final_message(chat, template, continue_final_message)
    text: str = _compiled(template).render(
        messages=chat, tools=_plain(tools), documents=_plain(documents),
        add_generation_prompt=add_generation_prompt, **_plain(variables))
    if final is not None:
        text = _cut_at_final_message(text, final)
    return text


def _plain(value: Any) -> Any:
    """`value` rebuilt of plain JSON types (what the sandbox may see), subclasses stripped."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    return f"<{type(value).__name__}>"


def _aliased(message: dict[str, Any]) -> dict[str, Any]:
    """The message's reasoning under `reasoning_content` and `thinking` too."""
    reasoning = next((message[key] for key in _REASONING_FIELDS
                      if message.get(key) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _tag_final_message(chat: list[dict[str, Any]], template: str,
                       continue_final_message: bool | str) -> str | None:
    """With `continue_final_message`, the final message's text (its field's name when a
    string), tagged in `chat` where the rendering is cut; None without."""
    if not continue_final_message:
        return None
    if not chat:
        raise ValueError("continue_final_message is set but the conversation is empty!")
    name = continue_final_message if isinstance(continue_final_message, str) else "content"
    final = chat[-1].get(name)
    if final is None:
        raise ValueError(f'continue_final_message is set but the final message has no "{name}"'
                         " to continue!")
    names = ([n for n in _REASONING_FIELDS if chat[-1].get(n) == final]
             if name in _REASONING_FIELDS else [name])
    if not any(n in template for n in names):
        raise ValueError(f'continue_final_message is set to "{name}" but this is not an '
                         "accepted field in the chat_template")
    if isinstance(final, list):
        block = next((b for b in reversed(final) if isinstance(b, dict) and "text" in b), None)
        if block is None:
            raise ValueError("continue_final_message is set but we could not find any text to "
                             "continue in the final message!")
        final, block["text"] = block["text"], block["text"] + _CONTINUE_TAG
        return str(final)
    for n in names:
        chat[-1][n] = chat[-1][n] + _CONTINUE_TAG
    return str(final)


def _cut_at_final_message(text: str, final: str) -> str:
    if final.strip() not in text or _CONTINUE_TAG.strip() not in text:
        raise ValueError("continue_final_message is set but the final message does not appear "
                         "in the chat after applying the chat template!")
    at = text.rindex(_CONTINUE_TAG.strip())
    if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()  # the template trimmed the message's trailing space


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (assistant-token masks in training): its
    body, rendered as it is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


class _TemplateDict:
    """`dict` in a template: building dicts only (no attribute or type games)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace` in a template: no underscore-prefixed attributes."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (jinja's own signature)
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                "Chat templates cannot store underscore-prefixed attributes on a namespace, "
                f"but got {name!r}.")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:  # noqa: A002 (the name templates call it with)
    return datetime.now().strftime(format)


@functools.lru_cache(maxsize=8)
def _compiled(template: str) -> jinja2.Template:
    """`template` compiled in transformers' environment (the last few kept)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(template)
