"""Flag values the tools share: comma-separated lists, repeated names, sampling parameters."""

from __future__ import annotations

from typing import Any

from specserve.request import SamplingParams
from specserve.tools.workloads import ToolInputError


def sampling(**fields: Any) -> SamplingParams:
    """SamplingParams from flag values; a value it refuses is a ToolInputError (checked before any model
    loads, so a bad flag costs no minutes). A tool always generates: ``max_tokens`` 0 is the HTTP API's
    prompt-only request."""
    if fields.get("max_tokens", 1) < 1:
        raise ToolInputError(f"max_tokens must be >= 1, got {fields['max_tokens']}")
    try:
        return SamplingParams(**fields)
    except ValueError as exc:
        raise ToolInputError(str(exc)) from None


def names(values: list[str]) -> list[str]:
    """``["a,b", "c"]`` (a repeated or comma-separated flag) → ``["a", "b", "c"]``."""
    return [n for v in values for n in v.split(",") if n]


def parse_int_list(text: str, flag: str, minimum: int = 1) -> list[int]:
    """``"1,2,4"`` → ``[1, 2, 4]``; anything else is a ToolInputError naming the flag."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ToolInputError(f"{flag}: expected comma-separated integers, got {text!r}") from None
    if not values or any(v < minimum for v in values):
        raise ToolInputError(f"{flag}: expected integers >= {minimum}, got {text!r}")
    return list(dict.fromkeys(values))


def parse_float_list(text: str, flag: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ToolInputError(f"{flag}: expected comma-separated numbers, got {text!r}") from None
    if not values or any(not v > 0 for v in values):
        raise ToolInputError(f"{flag}: expected numbers > 0, got {text!r}")
    return list(dict.fromkeys(values))
