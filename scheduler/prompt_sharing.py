"""n > 1: the choices of a request compute the prompt once.

A choice naming a `prompt_leader_id` (another choice of the same prompt, in flight) is
held back until the leader has computed every full block of the prompt (and its prompt
logprobs), then goes to `waiting` and shares those blocks: through the prefix cache, or
straight from the leader's block table when caching is off. A choice takes the leader's
prompt logprobs once they are complete. A leader that finishes first lets its choices go
on without it.
"""

from __future__ import annotations

from collections.abc import Iterator

from kvcache.block_pool import KVCacheBlock
from kvcache.kv_cache_manager import KVCacheManager
from scheduler.request import Request


class PromptSharing:
    """The choices held back for their prompt leaders, and the blocks they share."""

    def __init__(self, kv_cache: KVCacheManager) -> None:
        self.kv_cache = kv_cache
        # prompt leader id -> the choices held back until it computed the prompt
        self.held: dict[str, list[Request]] = {}

    def __iter__(self) -> Iterator[Request]:
        """Every choice held back."""
        for choices in self.held.values():
            yield from choices

    def hold(self, request: Request, leader: Request | None) -> bool:
        """Hold a new request back while its prompt `leader` (None: none in flight) has not
        computed the prompt; True if held. Not held, it takes the leader's prompt logprobs
        when they are complete."""
        if leader is None:
            return False
        if not self.has_computed_prompt(leader):
            self.held.setdefault(leader.request_id, []).append(request)
            return True
        _share_prompt_logprobs(leader, request)
        return False

    def has_computed_prompt(self, leader: Request) -> bool:
        """Whether `leader` has computed every full prompt block a choice could share (and
        its prompt logprobs, which the choices then share too)."""
        block_size = self.kv_cache.block_size
        shareable = (leader.num_prompt_tokens - 1) // block_size * block_size
        return leader.num_computed_tokens >= shareable and not leader.needs_prompt_logprobs

    def release(self, leader: Request) -> list[Request]:
        """The choices held back for `leader` (it computed the prompt, or finished), to be
        queued now; they take its prompt logprobs when complete."""
        choices = self.held.pop(leader.request_id, [])
        for request in choices:
            _share_prompt_logprobs(leader, request)
        return choices

    def remove(self, request: Request) -> bool:
        """Take a finished choice out of those held back; False if it is not held."""
        leader_id = request.prompt_leader_id or ""
        siblings = self.held.get(leader_id, [])
        if request not in siblings:
            return False
        siblings.remove(request)
        if not siblings:
            del self.held[leader_id]
        return True

    def leader_blocks(self, request: Request, leader: Request) -> tuple[list[KVCacheBlock], int]:
        """With prefix caching off: the full prompt blocks `leader` has computed that
        `request` takes as computed, and their number of tokens."""
        block_size = self.kv_cache.block_size
        num_shared = min(
            leader.num_computed_tokens,
            request.num_prompt_tokens,
            request.num_tokens - 1,
        ) // block_size
        shared = self.kv_cache.get_leading_blocks(leader.request_id, num_shared)
        return shared, len(shared) * block_size


def _share_prompt_logprobs(leader: Request, request: Request) -> None:
    """A choice takes its prompt leader's prompt logprobs once they are complete (else it
    computes its own)."""
    if request.prompt_logprobs is not None and leader.prompt_logprobs is not None and (
        not leader.needs_prompt_logprobs
    ):
        request.prompt_logprobs = leader.prompt_logprobs
        request.shares_prompt_logprobs = True
