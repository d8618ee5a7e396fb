"""A request body decoded for a request model: in C, and only the fields the model reads.

msgspec splits the body into its top-level fields without building them (each stays raw
bytes, `msgspec.Raw`); then only the model's own fields (their names and aliases) are
decoded into Python objects, once their JSON values are counted (in C: `_num_values`) and
found within --max-json-values. An unknown field costs a scan of its bytes in C, whatever
it holds; a known one at most that many objects. Every JSON error is a 400 that says what
is wrong: not JSON (and at which byte), not UTF-8, nested too deeply, a number too long or
out of range, NaN or Infinity (no JSON numbers), a string holding an unpaired UTF-16
surrogate, not an object.
"""

from __future__ import annotations

import codecs
import contextlib
import functools
import gc
import re
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import pydantic

from server.errors import APIError
from server.limits import RequestLimits, over_limit

_FIELDS = msgspec.json.Decoder(dict[str, msgspec.Raw])
_WHOLE = msgspec.json.Decoder(msgspec.Raw)
_VALUE = msgspec.json.Decoder()

NOT_JSON = "Request body is not valid JSON"
SURROGATE = (f"{NOT_JSON}: a string holds an unpaired UTF-16 surrogate (\\ud800-\\udfff), "
             "which is no Unicode character.")
# An escaped high surrogate not followed by an escaped low one, or a low one alone.
_LONE_SURROGATE_RE = re.compile(
    rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])"
    rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}"
)
_AT_BYTE_RE = re.compile(r"\(byte (\d+)\)$")
_NOT_NUMBERS = (b"NaN", b"Infinity", b"-Infinity")
# the key just before a value: `"temperature": ` (a name up to 64 characters)
_KEY_BEFORE_RE = re.compile(rb'"([A-Za-z0-9_.\-]{1,64})"\s*:\s*$')


def decode_fields(body: bytes, model: type[pydantic.BaseModel], limits: RequestLimits
                  ) -> dict[str, Any]:
    """The JSON object `body` as a dict of only the fields `model` reads (all of them when it
    allows extra fields), for `model.model_validate`; a 400 when `body` is not one, or when
    those fields hold more values than `limits.max_json_values`."""
    body = body.removeprefix(codecs.BOM_UTF8)
    try:
        fields = _FIELDS.decode(body)
    except RecursionError as exc:
        raise APIError(400, f"{NOT_JSON}: nested too deeply.") from exc
    except msgspec.ValidationError as exc:  # JSON, but not an object (or is it JSON?)
        _check_json(body)
        raise APIError(400, "Request body must be a JSON object.") from exc
    except msgspec.DecodeError as exc:
        raise _not_json(body, exc) from exc
    if not body.isascii():
        _check_utf8(body)
    known = _known_fields(model)
    raws = {name: raw for name, raw in fields.items() if known is None or name in known}
    _check_num_values(raws, limits.max_json_values)
    with _gc_paused():
        return {name: _decode_value(name, raw) for name, raw in raws.items()}


def _check_num_values(raws: dict[str, msgspec.Raw], limit: int) -> None:
    """A 400 naming --max-json-values when the fields hold more values than `limit`:
    counted on their bytes in C, before any is built (most bodies: by three
    `bytes.count`s)."""
    texts = {name: bytes(raw) for name, raw in raws.items()}
    if sum(map(_most_values, texts.values())) <= limit:
        return
    for count in (_least_values, _num_values):
        counts = {name: count(text) for name, text in texts.items()}
        total = sum(counts.values())
        if total > limit:
            name = max(counts, key=lambda n: counts[n])
            what = (f"the request's fields hold {total} JSON values or more ({counts[name]} "
                    f"in `{name}`)")
            raise APIError(400, over_limit(what, limit, "max_json_values"), param=name)


def _most_values(text: bytes) -> int:
    """At least the JSON values in `text`: 1, and 1 per comma and opening bracket (of
    its strings too)."""
    return 1 + text.count(b",") + text.count(b"[") + text.count(b"{")


def _least_values(text: bytes) -> int:
    """At most the JSON values in `text`: its strings (by their quotes) less its keys (by
    its colons)."""
    num_strings = (text.count(b'"') - text.count(b'\\"')) // 2
    return max(0, num_strings - text.count(b":"))


def _num_values(text: bytes) -> int:
    """The JSON values in `text` (valid JSON), as `_most_values` counts them but outside
    its strings (an array's or object's first value follows its bracket, the others a
    comma), less its empty arrays and objects (with no space inside)."""
    if b'"' not in text:
        return _most_values(text) - text.count(b"[]") - text.count(b"{}")
    # NOTE: with the escaped backslashes and quotes gone, every quote left opens or closes
    # a string: a byte is outside the strings after an even number of quotes.
    array = np.frombuffer(text.replace(b"\\\\", b"").replace(b'\\"', b""), dtype=np.uint8)
    outside = (np.cumsum(array == ord('"'), dtype=np.uint8) & 1) == 0
    opens = (array == ord(",")) | (array == ord("[")) | (array == ord("{"))
    empty = (((array[:-1] == ord("[")) & (array[1:] == ord("]")))
             | ((array[:-1] == ord("{")) & (array[1:] == ord("}"))))
    return (1 + int(np.count_nonzero(opens & outside))
            - int(np.count_nonzero(empty & outside[:-1])))


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """NOTE: the cyclic collector runs again and again while many containers are built
    (2.6 million empty lists: 1.9 s with it, 0.25 s without); it sees them once after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@functools.cache
def _known_fields(model: type[pydantic.BaseModel]) -> frozenset[str] | None:
    """The keys `model` reads: its fields' names and aliases (None: every key)."""
    if model.model_config.get("extra") == "allow":
        return None
    names = set()
    for name, field in model.model_fields.items():
        names.add(name)
        for alias in (field.alias, field.validation_alias):
            if isinstance(alias, str):
                names.add(alias)
    return frozenset(names)


def _decode_value(name: str, raw: msgspec.Raw) -> Any:
    try:
        return _VALUE.decode(raw)
    except msgspec.ValidationError as exc:
        if str(exc).startswith("Integer"):  # more than 4300 digits, as Python's int() takes
            raise APIError(400, f"{NOT_JSON}: a number in `{name}` is too long.",
                           param=name) from exc
        raise APIError(400, f"{NOT_JSON}: a number in `{name}` is out of range (beyond a "
                       "64-bit float).", param=name) from exc


def _check_json(body: bytes) -> None:
    """A 400 naming why `body` is not JSON, if it is not."""
    try:
        _WHOLE.decode(body)
    except RecursionError as exc:
        raise APIError(400, f"{NOT_JSON}: nested too deeply.") from exc
    except msgspec.DecodeError as exc:
        raise _not_json(body, exc) from exc


def _check_utf8(body: bytes) -> None:
    try:
        body.decode()
    except UnicodeDecodeError as exc:
        raise APIError(400, f"{NOT_JSON}: invalid UTF-8 (byte {exc.start}).") from exc


def _not_json(body: bytes, exc: msgspec.DecodeError) -> APIError:
    """The 400 of a body msgspec could not read, naming why in the client's terms."""
    if _LONE_SURROGATE_RE.search(body):
        return APIError(400, SURROGATE)
    reason = str(exc).removeprefix("JSON is malformed: ")
    if reason == "Input data was truncated":
        return APIError(400, f"{NOT_JSON}: it ends before its JSON value does.")
    at = _AT_BYTE_RE.search(reason)
    start = int(at.group(1)) if at else 0
    start -= body.startswith(b"-Infinity", start - 1)  # msgspec names the I
    token = next((t for t in _NOT_NUMBERS if at and body.startswith(t, start)), None)
    if token is None:
        return APIError(400, f"{NOT_JSON}: {reason}.")
    key = _KEY_BEFORE_RE.search(body, max(0, start - 100), start)
    where = f"the value of `{key.group(1).decode()}`" if key else f"byte {start}"
    return APIError(400, f"{NOT_JSON}: {token.decode()} ({where}) is no JSON number.",
                    param=key.group(1).decode() if key else None)
