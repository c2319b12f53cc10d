"""Grammar specs → llguidance matchers, and one constrained sequence's grammar state.

:class:`GrammarCompiler` turns a request's :class:`~specserve.request.GrammarSpec` into a matcher; a bad
grammar is a :class:`GrammarError` (the server's 400). Compiled matchers are cached by spec, so the engine's
copy for a new request is cheap. :class:`GrammarState` is one sequence's matcher at its committed output:

* ``row_masks(draft_ids)``: the allowed-token bitmask of each verify row, the matcher walked through the
  drafts and back: row ``j`` is the mask after ``draft_ids[:j]``. The walk stops at the first draft the
  grammar forbids (that draft is then rejected by its own row's mask; later rows are never emitted).
* ``forced(limit)``: the tokens the grammar allows as the only continuation (braces, keys, quotes, the tail
  of an enum value): drafted for free, accepted wherever the target agrees, which under a mask that allows
  one token it must.
* ``commit(tokens)``: the emitted tokens consumed.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, TypeVar, cast

import numpy as np
import numpy.typing as npt

from specserve.errors import UserError
from specserve.request import GrammarSpec
from specserve.structured.tokenizer import GrammarVocabulary, llg_tokenizer

log = logging.getLogger("specserve.engine")

CACHE_SIZE = 256
"""Compiled grammars kept (a schema that agents send with every call compiles once)."""
STEP_BUDGET_S = 0.25
"""The most one grammar call (a step's masks, forced tokens, a commit) may take before its request fails."""
MAX_ITEMS_IN_ROW, STEP_MAX_ITEMS, STEP_LEXER_FUEL = 500, 20_000, 100_000
"""llguidance's parser limits, below its defaults (2000, 50k, 200k): an ambiguous grammar fails early (a 400,
or its request failing alone) instead of slowing every step."""

JSON_OBJECT_SCHEMA = '{"type": "object"}'
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""JSON as ``json.dumps`` writes it (``", "`` and ``": "``, the spelling models write unconstrained): one
spelling, so separators, keys and braces are forced tokens the grammar drafts for free. A schema's own
``x-guidance`` options override this."""


class GrammarError(UserError, ValueError):
    """A grammar that cannot be compiled, or output the grammar does not allow."""


def llg_grammar(spec: GrammarSpec) -> str:
    """The llguidance grammar text of a spec (its own JSON format)."""
    import llguidance

    try:
        if spec.kind in ("json_object", "json_schema"):
            schema = JSON_OBJECT_SCHEMA if spec.kind == "json_object" else spec.text
            return str(
                llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=cast(Any, JSON_OPTIONS))
            )
        if spec.kind == "choice":
            choices = json.loads(spec.text)
            if not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
                raise GrammarError("a choice must be a non-empty list of strings")
        return str(llguidance.grammar_from(spec.kind, spec.text))  # type: ignore[arg-type]
    except (ValueError, TypeError) as exc:
        if isinstance(exc, GrammarError):
            raise
        raise GrammarError(f"invalid {spec.kind}: {exc}") from None


class GrammarCompiler:
    """Matchers for one target vocabulary; thread-safe (the server compiles, the engine copies)."""

    def __init__(self, vocabulary: GrammarVocabulary, vocab_size: int) -> None:
        self._vocabulary = vocabulary
        self.vocab_size = vocab_size
        self._tokenizer: Any = None
        self._eos_ids: list[int] = []
        self._cache: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def words(self) -> int:
        """32-bit words of one bitmask row."""
        return (self.vocab_size + 31) // 32

    def tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer, self._eos_ids = llg_tokenizer(self._vocabulary, self.vocab_size)
            return self._tokenizer

    def compile(self, spec: GrammarSpec) -> Any:
        """A fresh ``llguidance.LLMatcher`` at the grammar's start; GrammarError if it does not compile."""
        import llguidance

        with self._lock:
            cached = self._cache.get(spec)
            if cached is not None:
                self._cache.move_to_end(spec)
                return cached.deep_copy()
        grammar = llg_grammar(spec)
        limits = llguidance.LLParserLimits(
            max_items_in_row=MAX_ITEMS_IN_ROW, step_max_items=STEP_MAX_ITEMS, step_lexer_fuel=STEP_LEXER_FUEL
        )
        matcher = llguidance.LLMatcher(self.tokenizer(), grammar, log_level=0, limits=limits)
        if matcher.is_error():
            raise GrammarError(f"invalid {spec.kind}: {matcher.get_error()}")
        with self._lock:
            self._cache[spec] = matcher
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return matcher.deep_copy()

    def state(self, spec: GrammarSpec) -> GrammarState:
        matcher = self.compile(spec)
        if not spec.triggers:
            return GrammarState(matcher, self.words, self._eos_ids)
        try:
            triggers = [re.compile(t.encode()) for t in spec.triggers]
        except re.error as exc:
            raise GrammarError(f"invalid grammar trigger: {exc}") from None
        return LazyGrammarState(matcher, self.words, self._eos_ids, triggers, self.tokenizer())


class GrammarState:
    """One sequence's grammar at its committed output (see the module docstring)."""

    def __init__(self, matcher: Any, words: int, eos_ids: Sequence[int] = ()) -> None:
        self._matcher = matcher
        self._words = words
        self._eos = frozenset(eos_ids)
        self._end = np.zeros(words, dtype=np.int32)  # the end-of-generation tokens only
        for token in eos_ids:
            self._end[token >> 5] |= np.int32(np.uint32(1 << (token & 31)).view(np.int32))
        self.seconds = 0.0
        """Time spent in the grammar engine for this sequence: masks, forced tokens, commits."""

    def row_masks(self, draft_ids: Sequence[int]) -> npt.NDArray[np.int32]:  # [k + 1, words] int32
        """The allowed tokens of each verify row; the matcher is left where it was (see :meth:`_walk`)."""
        start = time.perf_counter()
        masks = np.full((len(draft_ids) + 1, self._words), -1, dtype=np.int32)  # unused rows allow all
        try:
            self._walk(self._matcher, masks, draft_ids, 0)
        finally:
            self._charge(start)
        self._check()
        return masks

    def _walk(self, matcher: Any, masks: npt.NDArray[np.int32], draft_ids: Sequence[int], first: int) -> None:
        """Fill ``masks[first:]`` from ``matcher``, which stands after ``draft_ids[:first]``, and put it back.

        The walk stops at the first draft the grammar forbids and at an end-of-generation draft: rows after
        either are never emitted (the first is rejected by its own row, the second ends the output), and an
        end is never consumed — a complete grammar's matcher takes it without recording it, so counting it
        would roll back a committed token."""
        consumed = 0
        for j in range(first, len(draft_ids) + 1):
            self._fill(matcher, masks[j])
            if j == len(draft_ids):
                break
            token = draft_ids[j]
            if token in self._eos or not _allowed(masks[j], token) or matcher.is_stopped():
                break
            if not matcher.consume_token(token):
                _check(matcher)
                break
            consumed += 1
        if consumed and not matcher.rollback(consumed):
            _check(matcher)

    def forced(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens the grammar forces next (none when it allows a choice)."""
        if limit <= 0 or self._matcher.is_stopped():
            return []
        start = time.perf_counter()
        try:
            tokens: list[int] = self._matcher.compute_ff_tokens()
        finally:
            self._charge(start)
        return tokens[:limit]

    def commit(self, tokens: Sequence[int]) -> None:
        """Consume emitted tokens; each was allowed by its row's mask, so this cannot fail. An end of
        generation is not consumed (the output ends there)."""
        start = time.perf_counter()
        try:
            for token in tokens:
                if token in self._eos:
                    continue
                if not self._matcher.consume_token(token):
                    self._check()
                    raise GrammarError(f"token {token} was emitted against the grammar")
        finally:
            self._charge(start)

    def _charge(self, start: float) -> None:
        """Count the time since ``start``; one call past STEP_BUDGET_S fails the request (alone): a grammar
        whose parse keeps growing must not stall every sequence of the batch."""
        elapsed = time.perf_counter() - start
        self.seconds += elapsed
        if elapsed > STEP_BUDGET_S:
            raise GrammarError(f"the grammar took {elapsed:.2f} s for one step (limit {STEP_BUDGET_S} s)")

    def is_stopped(self) -> bool:
        """The grammar allows nothing more (the output is complete)."""
        return bool(self._matcher.is_stopped())

    def _fill(self, matcher: Any, row: npt.NDArray[np.int32]) -> None:
        matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        if not row.any():  # the grammar is complete (or the row follows its end): only an end may follow
            row[:] = self._end if self._end.any() else -1

    def _check(self) -> None:
        _check(self._matcher)


TRIGGER_LOOKBACK = 512
"""Bytes (characters, for the server's parser) before new output that a trigger's match may start at
(triggers are short)."""
KEPT_OUTPUT = 4 * TRIGGER_LOOKBACK
"""The most output bytes a lazy grammar keeps before its trigger (it keeps the last half of this once more
has come): more than any match can reach back, and no copy per token that grows with the output."""

AnyStr = TypeVar("AnyStr", str, bytes)


def first_trigger(triggers: Sequence[re.Pattern[AnyStr]], text: AnyStr, new_from: int) -> int | None:
    """Where the earliest trigger match in ``text`` that may end in ``text[new_from:]`` starts, or None.
    The lazy grammar (over bytes) and the server's tool-call stream (over text) both ask this, so the two
    switch at the same place. A search from past 0 never matches ``\\A``: anchored triggers fire only while
    the output is short."""
    since = max(0, new_from - TRIGGER_LOOKBACK)
    starts = [m.start() for t in triggers if (m := t.search(text, since)) is not None]
    return min(starts) if starts else None


class LazyGrammarState(GrammarState):
    """A grammar that applies only from its trigger on (``GrammarSpec.triggers``): before, every row allows
    every token and nothing is forced; at the token that completes a trigger's match, the matcher is given
    the text from the match's start (tokenized anew: the grammar reads bytes, and the match may start inside
    a token) and constrains every later token. A draft run that crosses the trigger gets the grammar's
    masks for its rows after it, so the target's distribution is masked from exactly that position on,
    with or without speculation."""

    def __init__(
        self,
        matcher: Any,
        words: int,
        eos_ids: Sequence[int],
        triggers: Sequence[re.Pattern[bytes]],
        tokenizer: Any,
    ) -> None:
        super().__init__(matcher, words, eos_ids)
        self._triggers = list(triggers)
        self._tokenizer = tokenizer
        self._output = b""  # the output's last bytes (see KEPT_OUTPUT)
        self.active = False
        """Whether a trigger has matched (the grammar constrains the output from then on)."""

    def row_masks(self, draft_ids: Sequence[int]) -> npt.NDArray[np.int32]:  # [k + 1, words] int32
        if self.active:
            return super().row_masks(draft_ids)
        start = time.perf_counter()
        masks = np.full((len(draft_ids) + 1, self._words), -1, dtype=np.int32)
        try:
            text = self._output
            for j, token in enumerate(draft_ids):
                if token in self._eos:
                    break
                piece = self._piece(token)
                text += piece
                at = first_trigger(self._triggers, text, len(text) - len(piece))
                if at is not None:
                    matcher = self._matcher.deep_copy()
                    if self._enter(matcher, text[at:]):
                        self._walk(matcher, masks, draft_ids, j + 1)
                    break
        finally:
            self._charge(start)
        return masks

    def forced(self, limit: int) -> list[int]:
        return super().forced(limit) if self.active else []

    def commit(self, tokens: Sequence[int]) -> None:
        if self.active:
            super().commit(tokens)
            return
        start = time.perf_counter()
        try:
            for i, token in enumerate(tokens):
                if token in self._eos:
                    continue
                piece = self._piece(token)
                self._output += piece
                at = first_trigger(self._triggers, self._output, len(self._output) - len(piece))
                if at is None:
                    if len(self._output) > KEPT_OUTPUT:  # what stays is past TRIGGER_LOOKBACK from 0, so
                        self._output = self._output[-KEPT_OUTPUT // 2 :]  # anchored triggers stay off
                    continue
                self.active = self._enter(self._matcher, self._output[at:])
                self._triggers = []  # one activation; should it fail, the output stays free
                if self.active:
                    super().commit(tokens[i + 1 :])
                return
        finally:
            self._charge(start)

    def is_stopped(self) -> bool:
        return self.active and super().is_stopped()

    def _piece(self, token: int) -> bytes:
        return bytes(self._tokenizer.decode_bytes([token]))

    def _enter(self, matcher: Any, text: bytes) -> bool:
        """Give the grammar the text since the trigger's start; False (logged) if it refuses it."""
        tokens = self._tokenizer.tokenize_bytes(text)
        if matcher.consume_tokens(tokens) and not matcher.is_error():
            return True
        log.warning("a lazy grammar refused its own trigger's text %r; the output stays free", text[:80])
        return False


def _check(matcher: Any) -> None:
    if matcher.is_error():
        raise GrammarError(f"grammar state failed: {matcher.get_error()}")


def _allowed(mask: npt.NDArray[np.int32], token: int) -> bool:
    return bool((int(mask[token >> 5]) >> (token & 31)) & 1)
