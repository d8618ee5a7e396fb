"""The field types the request models share: JSON's integers (`JsonInt`: 7.0 is 7), lists
held to a request limit before any of their items is read (`limited`, a flag of
server/limits.py; `at_most`, a fixed bound), lists that stop at their first bad item
(`FailFastList`: one error, not one per item), and token ids read in C (`token_ids`).
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

import msgspec
from pydantic import BeforeValidator, Field, ValidationInfo

_TOKEN_IDS = list[Annotated[int, msgspec.Meta(ge=0)]]


def _integral(value: Any) -> Any:
    """An integral float within int64 as the int it is (JSON's 7.0 is the integer 7);
    anything else is left to the strict int check, which refuses true, "7", 7.5 and
    1e20."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        return int(value)
    return value


JsonInt = Annotated[int, BeforeValidator(_integral)]
_ListT = TypeVar("_ListT")
FailFastList = Annotated[_ListT, Field(fail_fast=True)]  # a list that stops at its first bad item


def limited(field_name: str, noun: str) -> Any:
    """An annotation: a list (or object) of at most the request limit `field_name` items
    (a field of server/limits.py's RequestLimits), counted before any item is validated by
    the validation context `Admission.parse_json` gives (`ListBudgets`; none: unchecked).
    The lists under one limit count together."""

    def count(value: Any, info: ValidationInfo) -> Any:
        if info.context is not None and isinstance(value, list | dict):
            info.context.take(field_name, len(value), noun)
        return value

    return BeforeValidator(count)


def at_most(num: int, noun: str) -> Any:
    """An annotation: a list (or object) of at most `num` items (a bound no flag sets),
    counted before any item is validated."""

    def count(value: Any) -> Any:
        if isinstance(value, list | dict) and len(value) > num:
            raise ValueError(f"{len(value)} {noun}: the limit is {num}")
        return value

    return BeforeValidator(count)


def token_ids(value: list[Any]) -> list[int] | None:
    """`value` as token ids (ints >= 0; an integral float is its int, as `_integral` has
    it for every other integer field), or None; in C, for a prompt may hold many."""
    try:
        return msgspec.convert(value, _TOKEN_IDS)
    except msgspec.ValidationError:
        pass
    try:
        msgspec.convert(value, list[int | float])  # numbers only: no "7", no true
        return msgspec.convert(value, _TOKEN_IDS, strict=False)
    except msgspec.ValidationError:
        return None
