"""The incremental JSON reader behind streamed tool-call arguments: its output is always
a prefix of json.dumps(json.loads(text), ensure_ascii=False), and exactly that at the end."""

from __future__ import annotations

import json
import random

import pytest

from server.json_stream import JsonStream, canonical_json

_STRING_CHARS = ['a', '"', "\\", "\n", "é", "😀", "\t", "/", "\x01", "<", "}", " "]


def _random_value(rng: random.Random, depth: int = 0):
    kind = rng.randint(0, 6 if depth < 3 else 3)
    if kind == 0:
        return rng.choice([0, -7, 10**20, 1.5, -0.0, 1e-7, 1e22, True, False, None])
    if kind in (1, 2, 3):
        return "".join(rng.choice(_STRING_CHARS) for _ in range(rng.randint(0, 6)))
    if kind == 4:
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {f"k{i}" + rng.choice(["", "é", '"']): _random_value(rng, depth + 1)
            for i in range(rng.randint(0, 3))}


@pytest.mark.parametrize("seed", range(4))
def test_every_output_so_far_is_a_prefix_of_the_canonical_text(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(100):
        value = _random_value(rng)
        text = json.dumps(value, ensure_ascii=rng.random() < 0.5,
                          indent=rng.choice([None, 2]), separators=rng.choice([None, (",", ":")]))
        expected = json.dumps(json.loads(text), ensure_ascii=False)
        stream, position = JsonStream(), 0
        while position < len(text):
            step = rng.randint(1, 5)
            stream.feed(text[position : position + step])
            position += step
            assert expected.startswith(stream.output), (text, stream.output)
        stream.feed(" ")
        assert (stream.output, stream.done, stream.failed) == (expected, True, False), text
        assert canonical_json(text) == expected


@pytest.mark.parametrize("text", ["1E2", "-0", "1.50", '"\\ud83d\\ude00"', '"\\ud83dx"',
                                  '{"a":{"b":[]}}', "{}", " [1 ,2] "])
def test_numbers_and_escapes_as_json_dumps_writes_them(text: str) -> None:
    assert canonical_json(text) == json.dumps(json.loads(text), ensure_ascii=False)


@pytest.mark.parametrize("text", ["{", '{"a"}', '{"a":}', "[1,]", "01", "nul", "NaN",
                                  '{"a": 1} x', '"\x01"', "{,}", "[1 2]", '{"a":1,}', "]"])
def test_what_is_no_json_is_refused(text: str) -> None:
    assert canonical_json(text) is None


def test_top_level_members_and_where_the_value_ends() -> None:
    stream, value = JsonStream(), '{"name":"add", "name":"x","arguments":{"a":[1,2]}}'
    stream.feed(value + " tail")
    assert stream.done and stream.num_read == len(value)
    spans = {k: stream.output[m.start : m.end] for k, m in stream.members.items()}
    assert spans == {"name": '"add"', "arguments": '{"a": [1, 2]}'}  # the first "name"
