"""Grammar compilation for a tokenizer: off the caller's thread, cached by grammar.

`GrammarCompiler.compile(grammar)` returns a future of a compiled grammar: an llguidance
matcher in its start state, which every request constrained by that grammar copies. The
compile runs on a thread pool (llguidance drops the GIL while it builds the grammar) and
the futures are kept in an LRU cache keyed by the grammar string, so the choices of an
n > 1 request and repeated schemas compile once. A grammar that fails to compile is
cached too: its future raises the ValueError again.

A compile includes the first token mask (computed on the start-state matcher, whose
lexer states its copies then share), and both run under llguidance's resource limits
(`PARSER_LIMITS` of structured/grammars.py): a grammar too costly for them, or that forces
more than `MAX_FORCED_BYTES` at its start, fails here, not in a step. The API process
compiles each grammar before admitting its request (bounded in time by
--grammar-timeout-s), the engine core again for its own matchers.

Memory: one compile holds what those limits allow (tens of MB at most, while it runs); the
cache holds at most `cache_size` grammars and `cache_bytes` of their estimated memory
(`grammar_cost`), the least recently used going first: a stream of distinct costly
grammars cannot pile up. (A request's own copy of its matcher is freed with the request.)

The tokenizer may be built on first use (the engine core's: on the compile thread, at the
first compile, ~1-3 s and ~150-250 MB for a 262k-token vocabulary, which a server never
asked for a grammar does not pay): the compiles wait for it, and a tokenizer that failed
to build fails every compile with its ValueError.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import llguidance
import numpy as np
from llguidance import LLMatcher

from structured.grammars import PARSER_LIMITS, forced_bytes_error, grammar_cost

DEFAULT_CACHE_SIZE = 256
DEFAULT_CACHE_BYTES = 64 * 1024**2


def build_ll_tokenizer(
    tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]
) -> llguidance.LLTokenizer:
    """llguidance's tokenizer from a fast tokenizer's JSON (no truncation or padding set:
    `fast_tokenizer_json`), with the model's vocabulary size (masks cover every logit) and
    EOS ids (what a finished grammar allows); ValueError for one llguidance cannot read.
    The build's transient memory (the JSON's parse) is handed back to the system after."""
    tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                       eos_token=eos_token_ids)
    return_free_memory()
    return tokenizer


def fast_tokenizer_json(hf_tokenizer: Any) -> str:
    """A Hugging Face fast tokenizer as JSON (the added tokens of tokenizer_config.json
    included); ValueError for a slow one.

    NOTE: llguidance.hf copies the backend first to unset truncation and padding (a
    second tokenizer: ~300 MB for a 262k-token vocabulary); the loader's tokenizer has
    neither set (model_runner/loader.py), so its own JSON is written."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError("llguidance reads fast tokenizers only")
    if backend.truncation is not None or backend.padding is not None:
        raise ValueError("a tokenizer with truncation or padding set")
    return str(backend.to_str())


def return_free_memory() -> None:
    """glibc's free heap pages given back to the system (malloc_trim); nothing elsewhere
    (the engine core's start-up, too: engine/core_process.py)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class GrammarCompiler:
    """Compiles grammars for one tokenizer on `num_threads` threads, LRU-cached: at most
    `cache_size` grammars and `cache_bytes` of their estimated memory."""

    def __init__(
        self,
        tokenizer: llguidance.LLTokenizer | Callable[[], llguidance.LLTokenizer],
        num_threads: int = 1,
        cache_size: int = DEFAULT_CACHE_SIZE,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
    ) -> None:
        """`tokenizer`: llguidance's tokenizer, or a function that builds it, called on
        the compile thread at the first compile (which waits for it, as do the compiles
        after it; a ValueError of the build is every compile's)."""
        if cache_size < 1:
            raise ValueError("cache_size must be >= 1")
        self.cache_size = cache_size
        self.cache_bytes = cache_bytes
        self._pool = concurrent.futures.ThreadPoolExecutor(
            num_threads, thread_name_prefix="grammar-compile"
        )
        self._build: Callable[[], llguidance.LLTokenizer] | None = None
        self._tokenizer: concurrent.futures.Future[llguidance.LLTokenizer] = (
            concurrent.futures.Future())
        if isinstance(tokenizer, llguidance.LLTokenizer):
            self._tokenizer.set_result(tokenizer)
        else:
            self._build = tokenizer
        self._cache: OrderedDict[str, concurrent.futures.Future[LLMatcher]] = OrderedDict()
        self._costs: dict[str, int] = {}  # the cached compiled grammars' estimated memory
        self._lock = threading.Lock()
        self.num_compiles = 0  # grammars compiled (cache misses)

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """The tokenizer (built first if it was not; waits while it builds; raises its
        build's ValueError)."""
        with self._lock:
            self._start_build()
        return self._tokenizer.result()

    def _start_build(self) -> None:
        """Start building the tokenizer on the compile thread, unless it was started (the
        caller holds the lock)."""
        if self._build is not None:
            self._tokenizer = self._pool.submit(self._build)
            self._build = None

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.vocab_size)

    @property
    def cached_bytes(self) -> int:
        """The estimated memory of the compiled grammars in the cache."""
        with self._lock:
            return sum(self._costs.values())

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
            self._start_build()
            future = self._pool.submit(self._compile, grammar)
            self._cache[grammar] = future
            self.num_compiles += 1
            self._evict()
            return future

    def _compile(self, grammar: str) -> LLMatcher:
        started = time.thread_time()
        matcher = LLMatcher(self.tokenizer, grammar, log_level=0, limits=PARSER_LIMITS)
        num_forced = 0
        if not matcher.is_error():
            words = (self.vocab_size + 31) // 32
            mask = np.empty(words, dtype=np.int32)
            matcher.unsafe_compute_mask_ptr(mask.ctypes.data, words * 4)
            num_forced = len(matcher.compute_ff_bytes())
        error = matcher_error(matcher) if matcher.is_error() else forced_bytes_error(num_forced)
        if error is not None:
            # NOTE: the cached error's traceback holds this frame: not the matcher with it
            del matcher
            raise ValueError(f"the grammar does not compile: {error}")
        cost = grammar_cost(grammar, num_forced, time.thread_time() - started)
        with self._lock:
            if grammar in self._cache:  # NOTE: not when evicted while it compiled
                self._costs[grammar] = cost
                self._evict()
        return matcher

    def _evict(self) -> None:
        """Drop the least recently used grammars until the cache is within its size and
        its memory budget (the newest stays, whatever it costs). The caller holds the
        lock."""
        total = sum(self._costs.values())
        while len(self._cache) > 1 and (len(self._cache) > self.cache_size
                                        or total > self.cache_bytes):
            grammar, _ = self._cache.popitem(last=False)
            total -= self._costs.pop(grammar, 0)


def matcher_error(matcher: LLMatcher) -> str:
    """Why a matcher is in its error state, without the marker that errors without the
    parser's state end with (PARSER_LIMITS)."""
    return str(matcher.get_error()).removesuffix("<non-verbose/>").strip()
