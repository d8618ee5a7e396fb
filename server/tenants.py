"""Tenants: who is asking, which priority they may ask for, how much, and by when.

`--tenants FILE` (YAML, or TOML by its `.toml` suffix) names each tenant with its API
keys (sha256 hashes in the file, or names of environment variables that hold the keys;
a key itself is never stored, logged or shown), its default and most urgent priority,
a cap on requests in flight, a token rate (prompt plus max_tokens per minute), a
fair-share weight, a default deadline and a prefix-cache salt. The file is validated
with pydantic at start (an error names the bad field) and reloaded on SIGHUP: requests
in flight keep running, and a tenant's counters carry over by name.

Each tenant's prefix cache is its own: its requests are salted with its name, so that
`cached_tokens` cannot tell one tenant what another sent. `share_cache: true` shares the
unsalted cache (with every tenant that says so), and `cache_salt: S` names the tenant's own
cache S instead: the file is refused when S is another tenant's name or salt.

`--api-key K` is the one-tenant shorthand (tenant "default", no limits); with neither,
every request is the open tenant "default" and no key is asked for.

The rate limit counts the tokens a tenant's admitted requests asked for over the last
60 seconds (a sliding window): unlike a token bucket that starts full, which lets a
client that ignores Retry-After take twice the rate in its first minute, no 60-second
window ever holds more than `tokens_per_minute`.

Admission comes before any work for a request: `Tenant.admit` takes a seat when one is
free and the window has room for what the request surely asks for (its max_tokens, and
its prompt when given as token ids); `Seat.charge` counts the exact tokens once the
prompt is tokenized, just before the request is submitted.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
import time
import tomllib
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pydantic
import yaml
from pydantic import BaseModel, ConfigDict, Field

from scheduler.placement import DEFAULT_TENANT
from server.slo import SloTargets

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_SHA256_HEX = r"[0-9a-fA-F]{64}"
RATE_WINDOW_S = 60.0


class TenantSpec(BaseModel):
    """One tenant of the file; names follow the documented shape."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    api_key_sha256: list[str] = Field(default_factory=list)
    api_key_env: list[str] = Field(default_factory=list)
    default_priority: int = Field(default=0, ge=_INT32_MIN, le=_INT32_MAX)
    max_priority: int | None = Field(default=None, ge=_INT32_MIN, le=_INT32_MAX)
    over_max_priority: Literal["reject", "clamp"] = "reject"
    max_in_flight: int | None = Field(default=None, ge=1)
    tokens_per_minute: int | None = Field(default=None, ge=1)
    weight: float = Field(default=1.0, gt=0, le=1e6)
    deadline_ms: int | None = Field(default=None, ge=1)
    slo: SloTargets | None = None  # latency targets for its requests that give none
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    share_cache: bool = False
    # The LoRA adapters its requests may name (None: every adapter served).
    loras: list[str] | None = None
    # May read what the server knows of every tenant's requests (GET /scheduler/state).
    admin: bool = False

    @pydantic.field_validator("api_key_sha256", "api_key_env", mode="before")
    @classmethod
    def _one_or_many(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value

    @pydantic.field_validator("api_key_sha256")
    @classmethod
    def _hex_digests(cls, value: list[str]) -> list[str]:
        for digest in value:
            if not re.fullmatch(_SHA256_HEX, digest):
                raise ValueError(f"{digest!r} is not a hex sha256 digest (64 hex digits)")
        return [d.lower() for d in value]

    @pydantic.model_validator(mode="after")
    def _consistent(self) -> TenantSpec:
        if not self.api_key_sha256 and not self.api_key_env:
            raise ValueError("a tenant needs api_key_sha256 or api_key_env")
        if self.share_cache and self.cache_salt is not None:
            raise ValueError("share_cache and cache_salt: a tenant's cache is one or the other")
        if self.cache_salt is not None and "\x00" in self.cache_salt:
            # NOTE: admission joins the tenant's salt and a request's own with a NUL
            raise ValueError("cache_salt: a NUL character is not allowed")
        if self.max_priority is not None and self.default_priority < self.max_priority:
            raise ValueError(
                f"default_priority {self.default_priority} is more urgent than max_priority "
                f"{self.max_priority}"
            )
        return self


class TenantsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenants: list[TenantSpec] = Field(min_length=1)

    @pydantic.model_validator(mode="after")
    def _unique_names(self) -> TenantsFile:
        names = [t.name for t in self.tenants]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"tenant names must be unique: {', '.join(duplicates)}")
        return self

    @pydantic.model_validator(mode="after")
    def _private_caches(self) -> TenantsFile:
        """No `cache_salt` that is another tenant's name (the salt of its private cache) or
        another tenant's salt: the two would share one prefix cache, and its cached_tokens
        would tell each what the other sent. The shared cache is `share_cache: true`."""
        owners = {spec.name: (spec.name, "the name") for spec in self.tenants}
        for spec in self.tenants:
            salt = spec.cache_salt
            if salt is None:
                continue
            owner, what = owners.setdefault(salt, (spec.name, "the cache_salt"))
            if owner != spec.name:
                raise ValueError(
                    f"tenant {spec.name!r}: its cache_salt {salt!r} is {what} of tenant "
                    f"{owner!r}, so tenants {owner!r} and {spec.name!r} could share one "
                    "prefix cache; give each its own salt (share_cache: true puts a tenant "
                    "in the one shared cache)"
                )
        return self


class TenantsFileError(ValueError):
    """The tenants file cannot be used; the message names the file and the bad field."""


class TenantRefused(Exception):
    """A request over one of its tenant's limits; `reason` labels the metric."""

    def __init__(self, status_code: int, reason: str, message: str,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.reason = reason
        self.retry_after_s = retry_after_s


@dataclass
class _Usage:
    """A tenant's counters, carried over a reload by name; guarded by the registry lock."""

    in_flight: int = 0
    window: deque[tuple[float, int]] | None = None  # (admitted at, tokens)
    window_tokens: int = 0


class Tenant:
    """A tenant's limits (from its spec) and its live counters."""

    def __init__(self, spec: TenantSpec, usage: _Usage, lock: threading.Lock) -> None:
        self.spec = spec
        self.name = spec.name
        self._usage = usage
        self._lock = lock

    @property
    def weight(self) -> float:
        return self.spec.weight

    @property
    def cache_salt(self) -> str | None:
        """The salt of its requests' prefix cache: its own (None: the shared cache)."""
        spec = self.spec
        if spec.cache_salt is not None or spec.share_cache:
            return spec.cache_salt
        return spec.name

    def may_use_lora(self, name: str) -> bool:
        """Whether its requests may run the LoRA adapter `name`."""
        return self.spec.loras is None or name in self.spec.loras

    @property
    def is_admin(self) -> bool:
        """Whether it may read every tenant's requests (GET /scheduler/state)."""
        return self.spec.admin

    def priority(self, requested: int | None) -> int:
        """The priority a request runs at: its own (or the tenant's default), within the
        tenant's bound; TenantRefused (403) when more urgent and the tenant rejects."""
        spec = self.spec
        priority = spec.default_priority if requested is None else requested
        bound = spec.max_priority
        if bound is not None and priority < bound:
            if spec.over_max_priority == "clamp":
                return bound
            raise TenantRefused(
                403, "priority",
                f"priority {priority} is more urgent than tenant {self.name!r} may ask for: "
                f"its bound is {bound} (lower is more urgent).",
            )
        return priority

    def deadline(self, arrival: float, deadline_ms: int | None) -> float | None:
        """The request's deadline on the monotonic clock: its own, else the tenant's."""
        ms = deadline_ms if deadline_ms is not None else self.spec.deadline_ms
        return None if ms is None else arrival + ms / 1000.0

    def admit(self, num_tokens: int, now: float | None = None) -> Seat:
        """A seat for a request that asks for at least `num_tokens` (prompt plus
        max_tokens, as far as known before any work), or TenantRefused (429) when no seat
        is free or the rate window has no room for them. Nothing is counted against the
        rate yet: `Seat.charge` counts the exact tokens."""
        spec = self.spec
        now = time.monotonic() if now is None else now
        with self._lock:
            usage = self._usage
            if spec.max_in_flight is not None and usage.in_flight >= spec.max_in_flight:
                raise TenantRefused(
                    429, "in_flight",
                    f"Tenant {self.name!r} has {usage.in_flight} requests in flight, its "
                    "limit. Retry when one finishes.", retry_after_s=1.0,
                )
            if spec.tokens_per_minute is not None:
                self._check_rate(num_tokens, now, spec.tokens_per_minute)
            usage.in_flight += 1
        return Seat(self)

    def _charge(self, num_tokens: int, now: float) -> None:
        """Count `num_tokens` in the rate window, or TenantRefused (429) if over it."""
        limit = self.spec.tokens_per_minute
        if limit is None:
            return
        with self._lock:
            self._check_rate(num_tokens, now, limit).append((now, num_tokens))
            self._usage.window_tokens += num_tokens

    def _spend(self, num_tokens: int, now: float) -> None:
        """Count `num_tokens` in the rate window whatever room it has (work already done)."""
        if self.spec.tokens_per_minute is None or num_tokens <= 0:
            return
        with self._lock:
            usage = self._usage
            if usage.window is None:
                usage.window = deque()
            usage.window.append((now, num_tokens))  # expired ones go at the next check
            usage.window_tokens += num_tokens

    def _release(self) -> None:
        with self._lock:
            self._usage.in_flight -= 1

    def _check_rate(
        self, num_tokens: int, now: float, limit: int
    ) -> deque[tuple[float, int]]:
        """The window, its expired entries dropped; TenantRefused unless it has room for
        `num_tokens`. The caller holds the lock."""
        usage = self._usage
        window = usage.window if usage.window is not None else deque()
        usage.window = window
        while window and window[0][0] <= now - RATE_WINDOW_S:
            usage.window_tokens -= window.popleft()[1]
        if num_tokens > limit:
            raise TenantRefused(
                429, "rate",
                f"Request too large for tenant {self.name!r}: it asks for {num_tokens} tokens "
                f"(prompt plus max_tokens), more than its {limit} tokens per minute. Reduce "
                "max_tokens or the prompt.",
            )
        if usage.window_tokens + num_tokens > limit:
            # Enough of the window must expire: the oldest entries, in order.
            excess, retry_at = usage.window_tokens + num_tokens - limit, now
            for admitted_at, tokens in window:
                excess -= tokens
                retry_at = admitted_at + RATE_WINDOW_S
                if excess <= 0:
                    break
            raise TenantRefused(
                429, "rate",
                f"Tenant {self.name!r} is over its rate limit of {limit} tokens per minute "
                f"(prompt plus max_tokens). Retry after {retry_at - now:.1f} s.",
                retry_after_s=retry_at - now,
            )
        return window

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._usage.in_flight


class Seat:
    """A request's seat among its tenant's requests in flight (`Tenant.admit`): charged
    its exact tokens before it is submitted, released once, when it ends or fails."""

    def __init__(self, tenant: Tenant) -> None:
        self._tenant = tenant
        self._released = False
        self._lock = threading.Lock()

    def charge(self, num_tokens: int, now: float | None = None) -> None:
        """Count the request's `num_tokens` (prompt plus max_tokens) against the token
        rate, or TenantRefused (429) if they do not fit; the seat stays taken."""
        self._tenant._charge(num_tokens, time.monotonic() if now is None else now)

    def spend(self, num_tokens: int, now: float | None = None) -> None:
        """Count `num_tokens` the request cost (a prompt tokenized, then refused; a
        /tokenize) against the token rate even past it: the window then refuses what
        follows until they expire. Nothing is refused here."""
        self._tenant._spend(num_tokens, time.monotonic() if now is None else now)

    def release(self) -> None:
        """Free the seat; idempotent (the engine's thread and the route may both call)."""
        with self._lock:
            if self._released:
                return
            self._released = True
        self._tenant._release()


class TenantRegistry:
    """The tenants by key; thread-safe (seats are released from the engine's thread)."""

    def __init__(self, specs: Iterable[TenantSpec], *, keys_required: bool = True,
                 environ: dict[str, str] | None = None) -> None:
        self.keys_required = keys_required
        self._lock = threading.Lock()
        self._usage: dict[str, _Usage] = {}
        self._by_key: dict[bytes, Tenant] = {}
        self._by_name: dict[str, Tenant] = {}
        self._install(list(specs), os.environ if environ is None else environ)

    @classmethod
    def from_file(cls, path: str | Path, environ: dict[str, str] | None = None
                  ) -> TenantRegistry:
        return cls(load_tenants_file(path), environ=environ)

    @classmethod
    def single(cls, api_key: str | None) -> TenantRegistry:
        """`--api-key` (one tenant "default", no limits), or no key at all."""
        digest = [hashlib.sha256(api_key.encode()).hexdigest()] if api_key is not None else []
        # NOTE: model_construct: the open tenant has no key, which a file's tenant must have.
        spec = TenantSpec.model_construct(name=DEFAULT_TENANT, api_key_sha256=digest,
                                          share_cache=True,  # nobody to keep apart
                                          admin=True)  # the one key is the operator's
        return cls([spec], keys_required=api_key is not None)

    @property
    def names(self) -> list[str]:
        return list(self._by_name)

    def by_name(self, name: str) -> Tenant | None:
        """The tenant named `name` (None: no longer in the tenants file)."""
        return self._by_name.get(name)

    def identify(self, key: bytes | None) -> Tenant | None:
        """The tenant of an API key (None: unknown); without keys, the open tenant."""
        if not self.keys_required:
            return self._by_name[DEFAULT_TENANT]
        if not key:
            return None
        return self._by_key.get(hashlib.sha256(key).digest())

    def reload(self, path: str | Path, environ: dict[str, str] | None = None) -> None:
        """Replace the tenants with the file's; TenantsFileError leaves them as they were.
        Counters carry over by name, so in-flight requests release the right seats."""
        self._install(load_tenants_file(path), os.environ if environ is None else environ)

    def _install(self, specs: list[TenantSpec], environ: Mapping[str, str]) -> None:
        by_key: dict[bytes, Tenant] = {}
        by_name: dict[str, Tenant] = {}
        for spec in specs:
            usage = self._usage.setdefault(spec.name, _Usage())
            tenant = Tenant(spec, usage, self._lock)
            by_name[spec.name] = tenant
            for digest in _key_digests(spec, environ):
                owner = by_key.setdefault(digest, tenant)
                if owner is not tenant:
                    raise TenantsFileError(
                        f"tenants {owner.name!r} and {spec.name!r} share an API key"
                    )
        self._by_key, self._by_name = by_key, by_name


def _key_digests(spec: TenantSpec, environ: Mapping[str, str]) -> list[bytes]:
    digests = [bytes.fromhex(d) for d in spec.api_key_sha256]
    for variable in spec.api_key_env:
        key = environ.get(variable)
        if not key:
            raise TenantsFileError(
                f"tenant {spec.name!r}: the environment variable {variable} (api_key_env) "
                "is not set"
            )
        digests.append(hashlib.sha256(key.encode()).digest())
    return digests


def load_tenants_file(path: str | Path) -> list[TenantSpec]:
    """The file's tenants, validated; TenantsFileError naming the file and the field."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise TenantsFileError(f"cannot read the tenants file {path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise TenantsFileError(
            f"the tenants file {path} is not UTF-8 text: byte {exc.object[exc.start]:#04x} at "
            f"offset {exc.start}"
        ) from exc
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise TenantsFileError(f"the tenants file {path} does not parse: {exc}") from exc
    try:
        return TenantsFile.model_validate(data).tenants
    except pydantic.ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(x) for x in error['loc']) or 'the file'}: "
            f"{str(error['msg']).removeprefix('Value error, ')}"
            for error in exc.errors(include_url=False, include_input=False)
        )
        raise TenantsFileError(f"the tenants file {path} is invalid: {problems}") from exc
