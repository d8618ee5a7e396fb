"""A batch's input file read as JSONL: each line `{"custom_id", "method": "POST", "url",
"body"}` for the batch's endpoint, each custom_id once. A file that breaks these rules
fails its batch with OpenAI's `errors` object (a few problems, each naming its line); a
line whose body the route refuses is no such problem: it becomes an error-file line when
it runs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
_MAX_ERRORS = 10  # problems named in a failed batch's `errors`


@dataclass
class InputLines:
    """The lines as `(custom_id, body as JSON text)`, or the problems that fail the batch."""

    lines: list[tuple[str, str]] = field(default_factory=list)
    problems: list[dict[str, Any]] = field(default_factory=list)

    @property
    def errors(self) -> dict[str, Any] | None:
        """OpenAI's `errors` object of a failed batch (None: the file is valid)."""
        if not self.problems:
            return None
        return {"object": "list", "data": self.problems[:_MAX_ERRORS]}

    def fail(self, code: str, message: str, line: int | None = None,
             param: str | None = None) -> None:
        self.problems.append({"code": code, "message": message, "param": param, "line": line})


def read_input(data: bytes, endpoint: str) -> InputLines:
    """The file's lines for `endpoint`, or the problems that fail its batch."""
    read = InputLines()
    try:
        text = data.decode()
    except UnicodeDecodeError:
        read.fail("invalid_file", "The input file is not UTF-8 text.")
        return read
    seen: set[str] = set()
    for number, raw in enumerate(text.splitlines(), start=1):
        if raw.strip():
            _read_line(read, raw, number, endpoint, seen)
        if len(read.problems) >= _MAX_ERRORS:
            break
    if not read.lines and not read.problems:
        read.fail("empty_file", "The input file has no lines.")
    return read


def _read_line(read: InputLines, raw: str, number: int, endpoint: str,
               seen: set[str]) -> None:
    try:
        item = json.loads(raw)
    except ValueError:
        read.fail("invalid_json_line", "This line is not JSON: the input file must be JSONL.",
                  number)
        return
    if not isinstance(item, dict):
        read.fail("invalid_json_line", "This line is not a JSON object.", number)
        return
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        read.fail("missing_required_parameter", "custom_id must be a non-empty string.",
                  number, "custom_id")
    elif custom_id in seen:
        read.fail("duplicate_custom_id", f"custom_id {custom_id[:64]!r} is used more than "
                  "once: each line needs its own.", number, "custom_id")
    elif item.get("method", "POST") != "POST":
        read.fail("invalid_method", "method must be POST.", number, "method")
    elif item.get("url") != endpoint:
        read.fail("mismatched_endpoint", f"url {str(item.get('url'))[:64]!r} is not the "
                  f"batch's endpoint {endpoint}.", number, "url")
    elif not isinstance(item.get("body"), dict):
        read.fail("invalid_request", "body must be a JSON object.", number, "body")
    else:
        seen.add(custom_id)
        read.lines.append((custom_id, json.dumps(item["body"])))
