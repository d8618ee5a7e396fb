"""Incremental detokenization: split multi-byte characters, stop strings across tokens."""

from __future__ import annotations

import pytest

from engine.detokenizer import IncrementalDetokenizer
from tests.conftest import BYTE_EOS, ByteTokenizer


def run(text: str, stop: tuple[str, ...] = (), chunk: int = 1, prompt: str = "Q: "):
    """Feed `text` as byte tokens, `chunk` at a time; return (deltas, stopped, detok)."""
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, tok.encode(prompt), stop)
    ids = tok.encode(text)
    deltas, stopped = [], False
    for i in range(0, len(ids), chunk):
        delta = detok.step(ids[i : i + chunk])
        deltas.append(delta.text)
        if delta.stopped:
            stopped = True
            break
    return deltas, stopped, detok


def test_plain_text_streams_token_by_token() -> None:
    deltas, stopped, detok = run("abc")
    assert deltas == ["a", "b", "c"] and not stopped
    assert detok.flush() == ""


@pytest.mark.parametrize("text", ["wörld", "日本語", "🙂 ok", "e\u0301"])
def test_multibyte_character_is_never_split(text: str) -> None:
    deltas, _, detok = run(text)
    assert "".join(deltas) + detok.flush() == text
    assert all("\ufffd" not in d for d in deltas)
    # the first byte of a multi-byte character yields nothing until it completes
    if len(text[0].encode()) > 1:
        assert deltas[0] == ""


def test_incomplete_character_at_the_end_is_flushed_as_replacement() -> None:
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, [], ())
    assert detok.step(tok.encode("a") + [0xE6]).text == "a"
    assert detok.flush() == "\ufffd"


def test_stop_string_is_not_sent_nor_what_follows() -> None:
    deltas, stopped, detok = run("Hello world, again", stop=("world",))
    assert stopped
    assert "".join(deltas) == "Hello "
    assert detok.flush() == ""


def test_stop_string_across_tokens_holds_back_partial_match() -> None:
    deltas, stopped, _ = run("abXYZ", stop=("XYZ",))
    # "X" and "XY" could start the stop string: held back, never sent
    assert deltas == ["a", "b", "", "", ""] and stopped


def test_partial_match_that_fails_is_released() -> None:
    deltas, stopped, detok = run("abXYq", stop=("XYZ",))
    assert not stopped
    assert deltas == ["a", "b", "", "", "XYq"]
    assert detok.flush() == ""


def test_partial_stop_at_the_end_is_flushed() -> None:
    deltas, stopped, detok = run("abXY", stop=("XYZ",))
    assert not stopped and "".join(deltas) == "ab"
    assert detok.flush() == "XY"


def test_earliest_of_several_stop_strings_wins_within_one_step() -> None:
    deltas, stopped, _ = run("one two three", stop=("three", "two"), chunk=100)
    assert stopped and deltas == ["one "]


def test_stop_string_with_multibyte_characters() -> None:
    deltas, stopped, _ = run("größer als", stop=("ö",))
    assert stopped and "".join(deltas) == "gr"


def test_steps_after_a_stop_return_nothing() -> None:
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, [], ("b",))
    assert detok.step(tok.encode("ab")).stopped
    again = detok.step(tok.encode("cd"))
    assert again.stopped and again.text == ""


def test_special_tokens_are_skipped() -> None:
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, [], ())
    assert detok.step(tok.encode("hi")).text == "hi"
    assert detok.step([BYTE_EOS]).text == ""
    assert detok.flush() == ""


def test_real_tokenizer_spaces_and_accents_round_trip() -> None:
    from model_runner.gguf_cache import cache_root
    from model_runner.text_tokenizer import TextTokenizer

    folders = sorted(cache_root().glob("**/tokenizer.json")) if cache_root().exists() else []
    if not folders:
        pytest.skip("no converted default model in the cache")
    tok = TextTokenizer(folders[0].parent)  # the served tokenizer
    text = " Hello there, naïve café – ça va? 日本 🙂"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, tok.encode("Say:", add_special_tokens=False), ())
    deltas = [detok.step([i]).text for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == tok.decode(ids)


def test_the_served_tokenizer_decodes_each_token_once() -> None:
    """DecodeStream: no full decode per step (the windowed path decoded twice per token)."""
    from model_runner.gguf_cache import cache_root
    from model_runner.text_tokenizer import TextTokenizer

    folders = sorted(cache_root().glob("**/tokenizer.json")) if cache_root().exists() else []
    if not folders:
        pytest.skip("no converted default model in the cache")
    tok = TextTokenizer(folders[0].parent)  # the served tokenizer
    text = " Streaming, token by token: naïve 日本 🙂 and a stop here."
    ids = tok.encode(text, add_special_tokens=False)
    calls = []
    real_decode = tok.decode
    tok.decode = lambda *a, **kw: (calls.append(1), real_decode(*a, **kw))[1]
    detok = IncrementalDetokenizer(tok, tok.encode("Say:", add_special_tokens=False), ("stop",))
    deltas = [detok.step([i]) for i in ids]
    assert not calls
    assert "".join(d.text for d in deltas) == " Streaming, token by token: naïve 日本 🙂 and a "
    assert deltas[-1].stopped or any(d.stopped for d in deltas)
