"""What grammars may hold in memory: a grammar forcing more than MAX_FORCED_BYTES at its
start fails to compile (at the limit it compiles; one past is a 400 over HTTP), a failed
compile keeps nothing of its matcher, and the compiler's cache stays within its memory
budget by the grammars' estimated cost (llguidance on a byte vocabulary)."""

from __future__ import annotations

import pytest
from llguidance import LLMatcher

import structured.compiler as compiler_module
from structured.compiler import GrammarCompiler
from structured.grammars import (
    BYTES_PER_COMPILE_CPU_S,
    BYTES_PER_FORCED_BYTE,
    BYTES_PER_GRAMMAR_BYTE,
    MAX_FORCED_BYTES,
    grammar_cost,
    regex_grammar,
)
from tests.support.structured_helpers import byte_ll_tokenizer


def test_forced_bytes_at_the_limit_compile_and_one_past_is_refused() -> None:
    compiler = GrammarCompiler(byte_ll_tokenizer())
    at_limit = compiler.compile(regex_grammar(f"a{{{MAX_FORCED_BYTES}}}")).result(timeout=30)
    assert len(at_limit.compute_ff_bytes()) == MAX_FORCED_BYTES
    past = compiler.compile(regex_grammar(f"a{{{MAX_FORCED_BYTES + 1}}}"))
    with pytest.raises(ValueError, match=f"forces {MAX_FORCED_BYTES + 1} bytes of output before "
                       f"the model has any choice, more than the {MAX_FORCED_BYTES}"):
        past.result(timeout=30)
    # a choice first: nothing is forced at the start (a later mask is bounded by the fuel)
    compiler.compile(regex_grammar(f"[ab]a{{{4 * MAX_FORCED_BYTES}}}")).result(timeout=30)


def test_a_failed_compile_keeps_nothing_of_its_matcher() -> None:
    """The cached error's traceback holds the compile's frame: not its matcher (37 MB of
    parser state for `(a{1000}){1000}` on a real vocabulary)."""
    compiler = GrammarCompiler(byte_ll_tokenizer())
    for grammar in (regex_grammar(f"a{{{MAX_FORCED_BYTES + 1}}}"), regex_grammar("a(")):
        error = compiler.compile(grammar).exception(timeout=30)
        assert isinstance(error, ValueError)
        traceback = error.__traceback__
        while traceback is not None:
            held = traceback.tb_frame.f_locals.values()
            assert not any(isinstance(value, LLMatcher) for value in held), grammar
            traceback = traceback.tb_next
    assert compiler.cached_bytes == 0  # a failure costs nothing


def test_the_cost_estimate_counts_the_grammar_its_forced_bytes_and_its_compile_time() -> None:
    assert grammar_cost("x" * 100, 10, 0.0) == (100 * BYTES_PER_GRAMMAR_BYTE
                                                + 10 * BYTES_PER_FORCED_BYTE)
    assert grammar_cost("x", 0, 0.5) == BYTES_PER_COMPILE_CPU_S // 2  # lexer states built


def test_the_cache_stays_within_its_memory_budget(monkeypatch) -> None:
    """Least recently used first, by estimated cost; the newest grammar stays whatever it
    costs."""
    costs = {regex_grammar(p): cost for p, cost in (("a+", 40), ("b+", 40), ("c+", 30),
                                                    ("d+", 500))}
    monkeypatch.setattr(compiler_module, "grammar_cost", lambda grammar, *_: costs[grammar])
    compiler = GrammarCompiler(byte_ll_tokenizer(), cache_bytes=100)
    a, b, c, d = costs
    for grammar in (a, b):
        compiler.compile(grammar).result(timeout=30)
    assert compiler.cached_bytes == 80 and len(compiler) == 2
    compiler.compile(a).result(timeout=30)  # a is the most recent now
    compiler.compile(c).result(timeout=30)  # 110 > 100: b goes
    assert compiler.cached_bytes == 70 and len(compiler) == 2
    assert compiler.compile(a).done() and compiler.num_compiles == 3  # a stayed cached
    compiler.compile(d).result(timeout=30)  # over the budget alone: only it stays
    assert len(compiler) == 1 and compiler.cached_bytes == 500
    compiler.compile(b).result(timeout=30)
    assert len(compiler) == 1 and compiler.cached_bytes == 40


def test_a_grammar_forcing_too_much_is_a_400_before_admission(structured_client) -> None:
    client = structured_client()
    body = {"prompt": "x", "max_tokens": 4,
            "structured_outputs": {"regex": f"a{{{MAX_FORCED_BYTES + 1}}}"}}
    response = client.post("/v1/completions", json=body)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "structured_outputs"
    assert f"forces {MAX_FORCED_BYTES + 1} bytes" in error["message"]
    body["structured_outputs"] = {"regex": f"a{{{MAX_FORCED_BYTES}}}"}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == "aaaa"
