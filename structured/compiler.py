"""Grammar compilation for a tokenizer: off the caller's thread, cached by grammar.

`GrammarCompiler.compile(grammar)` returns a future of a compiled grammar: an llguidance
matcher in its start state, which every request constrained by that grammar copies. The
compile runs on a thread pool (llguidance drops the GIL while it builds the grammar) and
the futures are kept in an LRU cache keyed by the grammar string, so the choices of an
n > 1 request and repeated schemas compile once. A grammar that fails to compile is
cached too: its future raises the ValueError again.

A compile includes the first token mask (computed on the start-state matcher, whose
lexer states its copies then share), and both run under llguidance's resource limits
(`PARSER_LIMITS` of structured/grammars.py): a grammar too costly for them fails here,
not in a step. The API process compiles each grammar before admitting its request
(bounded in time by --grammar-timeout-s), the engine core again for its own matchers.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections import OrderedDict
from typing import Any

import llguidance
import llguidance.hf
import numpy as np
from llguidance import LLMatcher

from structured.grammars import PARSER_LIMITS

DEFAULT_CACHE_SIZE = 256


def build_ll_tokenizer(
    hf_tokenizer: Any, vocab_size: int, eos_token_ids: list[int]
) -> llguidance.LLTokenizer:
    """llguidance's view of a Hugging Face fast tokenizer, with the model's vocabulary
    size (masks cover every logit) and EOS ids (what a finished grammar allows)."""
    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size,
                                        eos_token=eos_token_ids)


class GrammarCompiler:
    """Compiles grammars for one tokenizer on `num_threads` threads, LRU-cached."""

    def __init__(
        self,
        tokenizer: llguidance.LLTokenizer,
        num_threads: int = 1,
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        if cache_size < 1:
            raise ValueError("cache_size must be >= 1")
        self.tokenizer = tokenizer
        self.cache_size = cache_size
        self._pool = concurrent.futures.ThreadPoolExecutor(
            num_threads, thread_name_prefix="grammar-compile"
        )
        self._cache: OrderedDict[str, concurrent.futures.Future[LLMatcher]] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiles = 0  # grammars compiled (cache misses)

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.vocab_size)

    def __len__(self) -> int:
        return len(self._cache)

    def compile(self, grammar: str) -> concurrent.futures.Future[LLMatcher]:
        """The compiled grammar (a start-state matcher to copy; never mutate it), or a
        ValueError naming why it does not compile."""
        with self._lock:
            future = self._cache.get(grammar)
            if future is not None:
                self._cache.move_to_end(grammar)
                return future
            future = self._pool.submit(self._compile, grammar)
            self._cache[grammar] = future
            self.num_compiles += 1
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return future

    def _compile(self, grammar: str) -> LLMatcher:
        matcher = LLMatcher(self.tokenizer, grammar, log_level=0, limits=PARSER_LIMITS)
        if not matcher.is_error():
            words = (self.vocab_size + 31) // 32
            mask = np.empty(words, dtype=np.int32)
            matcher.unsafe_compute_mask_ptr(mask.ctypes.data, words * 4)
        if matcher.is_error():
            raise ValueError(f"the grammar does not compile: {matcher_error(matcher)}")
        return matcher


def matcher_error(matcher: LLMatcher) -> str:
    """Why a matcher is in its error state, without the marker that errors without the
    parser's state end with (PARSER_LIMITS)."""
    return str(matcher.get_error()).removesuffix("<non-verbose/>").strip()
