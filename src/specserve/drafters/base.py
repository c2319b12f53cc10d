"""The drafter lifecycle shared by every way of guessing tokens.

A drafter proposes tokens that the target then verifies; it never decides what is emitted. Lifecycle per
request: ``begin`` → (``available`` → ``propose`` → ``accept``)* → ``release``. How many tokens to ask for
is not the drafter's business: the length policy decides, from ``available`` and the measured costs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from specserve.sequence import Sequence


class DrafterError(Exception):
    """A drafter failed; the engine falls back to plain decoding for the affected requests."""


@dataclass(frozen=True)
class DraftOption:
    """What a drafter could offer for one sequence this step, before any work is done.

    ``max_tokens`` bounds the proposal (0: nothing to offer). ``bucket`` names the situation for acceptance
    statistics, e.g. the n-gram match length: acceptance differs a lot between situations, so the policy
    keeps one estimate per (drafter, bucket).
    """

    max_tokens: int
    bucket: str = ""
    setup_tokens: int = 0
    """Tokens a model drafter must evaluate before its first guess (its catch-up); enters the cost."""
    token_probs: tuple[float, ...] = ()
    """The drafter's own estimate per offered token (``max_tokens`` of them): the chance token ``i`` is
    accepted given the tokens before it were. Empty: the policy estimates from the bucket's record."""


@dataclass(frozen=True)
class Proposal:
    """Draft tokens for one sequence.

    ``draft_probs`` is ``[len(token_ids), vocab]`` float64, the distributions the tokens were sampled from
    (a numpy array, or a tensor on the device of a drafter that runs there), or None for a deterministic
    (model-free, or greedy) proposal, verified as one-hot drafts.
    """

    token_ids: list[int]
    draft_probs: npt.NDArray[np.float64] | Any = None


def estimated_accepted(token_probs: Seq[float]) -> float:
    """Expected accepted drafts under per-token conditional estimates (``DraftOption.token_probs``): the
    sum of their running products."""
    total, cumulative = 0.0, 1.0
    for p in token_probs:
        cumulative *= p
        total += cumulative
    return total


class Drafter(ABC):
    """Base class of all drafters."""

    name: ClassVar[str]
    uses_model: ClassVar[bool] = False
    """Whether drafting runs a model (its cost then enters the cost model)."""
    reads_target_states: ClassVar[bool] = False
    """Whether it drafts from the target's hidden states: the engine then reports every committed row of
    the target's passes to :meth:`committed`."""
    covers: ClassVar[frozenset[str]] = frozenset()
    """Drafters whose every draft this one could make from the same text, better priced: where both may
    serve an ``auto`` request, only this one is asked (a request naming the other still gets it)."""

    def begin(self, seq: Sequence) -> None:  # noqa: B027 - optional hook
        """A request starts; set up per-request state in ``seq.drafter_state``."""

    @abstractmethod
    def available(self, seq: Sequence, limit: int) -> DraftOption:
        """How many tokens (at most ``limit``) could be proposed for ``seq`` now, cheaply estimated."""

    @abstractmethod
    def propose(self, seqs: Seq[Sequence], num_tokens: Seq[int]) -> list[Proposal]:
        """Draft up to ``num_tokens[i]`` tokens after ``seqs[i].tokens``; one batched call for all sequences.

        A proposal may be shorter than asked (the drafter's confidence dropped) but never longer.
        """

    def draft_seconds(self, num_sequences: int, num_tokens: int) -> float | None:
        """Seconds of one ``propose`` over ``num_sequences`` sequences drafting up to ``num_tokens`` each,
        for a drafter that measures its own cost (a block drafter: one forward whatever the length); None:
        the cost model's draft table prices it (``uses_model``), or it is free."""
        return None

    def committed(self, seq: Sequence, chunk: int, start: int, count: int) -> None:  # noqa: B027
        """``count`` rows of chunk ``chunk`` of the target's last pass became ``seq``'s committed tokens
        at positions ``start …`` (``reads_target_states`` drafters read their hidden states here)."""

    def accept(self, seq: Sequence, num_accepted: int) -> None:  # noqa: B027 - optional hook
        """The target kept ``num_accepted`` of the proposal; roll back any drafter state past that."""

    def release(self, seq: Sequence) -> None:  # noqa: B027 - optional hook
        """The request ended (finished, aborted or failed); free its state."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """The engine shuts down."""
