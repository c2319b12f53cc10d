"""Drafter names → factories, imported lazily so listing drafters loads no model and no library.

A factory receives a :class:`DrafterContext` (what the engine has loaded) and returns a drafter, or raises
:class:`~specserve.drafters.base.DrafterError` when it cannot be built (for example no draft model loaded).
Tests and plugins may register their own drafters.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from specserve.backends.base import ModelRuntime
from specserve.drafters.base import Drafter, DrafterError


@dataclass(frozen=True)
class DrafterContext:
    """What a drafter factory may use."""

    draft_runtime: ModelRuntime | None = None
    ngram_min_n: int = 2
    draft_p_min: float = 0.6


DrafterFactory = Callable[[DrafterContext], Drafter]

_LAZY: dict[str, str] = {
    "ngram": "specserve.drafters.ngram:build",
    "draft-model": "specserve.drafters.draft_model:build",
}
_FACTORIES: dict[str, DrafterFactory] = {}


def register_drafter(name: str, factory: DrafterFactory) -> None:
    """Make a drafter available under ``name`` (overrides a built-in of the same name)."""
    _FACTORIES[name] = factory


def unregister_drafter(name: str) -> None:
    _FACTORIES.pop(name, None)


def drafter_names() -> list[str]:
    return sorted(set(_LAZY) | set(_FACTORIES))


def build_drafter(name: str, context: DrafterContext) -> Drafter:
    factory = _FACTORIES.get(name)
    if factory is None:
        target = _LAZY.get(name)
        if target is None:
            raise DrafterError(f"unknown drafter {name!r}; known: {', '.join(drafter_names())}")
        module, attr = target.split(":")
        factory = getattr(importlib.import_module(module), attr)
    return factory(context)
