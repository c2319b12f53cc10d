"""Drafter names → factories, imported lazily so listing drafters loads no model and no library.

A factory receives a :class:`DrafterContext` (what the engine has loaded) and returns a drafter, or raises
:class:`~specserve.drafters.base.DrafterError` when it cannot be built (for example no draft model loaded).
The names are the settings' ``DrafterName``: a new drafter gets a name there and a factory here.
"""

from __future__ import annotations

import importlib
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from specserve.backends.base import ModelRuntime
from specserve.config import (
    SUFFIX_CACHE_REQUESTS,
    SUFFIX_CACHE_TOKENS,
    SUFFIX_DEPTH,
    SUFFIX_FACTOR,
    SUFFIX_MIN_PROB,
    DrafterName,
)
from specserve.drafters.base import Drafter, DrafterError


@dataclass(frozen=True)
class DrafterContext:
    """What a drafter factory may use."""

    draft_runtime: ModelRuntime[Any] | None = None
    ngram_min_n: int = 2
    draft_p_min: float = 0.6
    target_vocab_size: int | None = None
    """Rows of the target's logits: a draft model of another width proposes only ids the target has."""
    target_logits_device: str = "cpu"
    """Where the target's logits are (``RuntimeInfo.logits_device``): a draft model whose logits are there
    too chooses its tokens there and hands the verifier its distributions there."""
    target_runtime: ModelRuntime[Any] | None = None
    """The target (a block drafter reads its hidden states, embedding and LM head)."""
    block_drafter_path: str | None = None
    """A DFlash2 / DFlash checkpoint directory (``--draft DIR``)."""
    draft_block_size: int | None = None
    candidate_topk: int | None = None
    suffix_depth: int = SUFFIX_DEPTH
    suffix_factor: float = SUFFIX_FACTOR
    suffix_min_prob: float = SUFFIX_MIN_PROB
    suffix_cache_requests: int = SUFFIX_CACHE_REQUESTS
    suffix_cache_tokens: int = SUFFIX_CACHE_TOKENS


DrafterFactory = Callable[[DrafterContext], Drafter]

FACTORIES: dict[str, str] = {
    "ngram": "specserve.drafters.ngram:build",
    "suffix": "specserve.drafters.suffix:build",
    "draft-model": "specserve.drafters.draft_model:build",
    "dflash2": "specserve.drafters.dflash2:build",
}
"""``module:function`` of each drafter's factory, imported when the drafter is built."""
assert set(FACTORIES) == set(typing.get_args(DrafterName)), "every DrafterName needs a factory"


def drafter_names() -> list[str]:
    return sorted(FACTORIES)


def build_drafter(name: str, context: DrafterContext) -> Drafter:
    target = FACTORIES.get(name)
    if target is None:
        raise DrafterError(f"unknown drafter {name!r}; known: {', '.join(drafter_names())}")
    module, attr = target.split(":")
    factory: DrafterFactory = getattr(importlib.import_module(module), attr)
    return factory(context)
