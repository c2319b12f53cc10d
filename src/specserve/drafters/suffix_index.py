"""Token documents indexed for suffix matching, and the frequency walk that drafts from their occurrences.

This is a suffix tree read through its leaves. A suffix tree over a corpus answers two questions for the
context's last tokens: how long a suffix of the context occurs in the corpus (the match), and how often each
token follows that suffix (a node's children counts). Both can be read from the *occurrences* of the
context's last ``key_len`` tokens: extending each occurrence backwards gives its match length, the
occurrences whose match is at least ``L`` are exactly the suffix-tree node of the ``L``-token suffix, and
walking them forwards, keeping those that agree with the chosen token, visits that node's most frequent
path with its counts. So a document keeps only its tokens and a dict from each ``key_len``-gram to the
positions just after it (one append per token, no tree nodes), and the walk costs O(occurrences × length).

Measured on AMD EPYC (Zen 1, Python 3.11; ``benchmarks/suffix_cost.py``): see docs/BENCHMARKS.md. A Python
dict trie of every suffix up to depth D costs D node inserts per token (D = 32: ~20x more per appended
token, ~100 bytes a node), and ArcticInference's C++ tree builds against torch and carries vLLM plugins.

The estimate of each drafted token (``conditional``): the share of the surviving occurrences that continue
with it (the tree's child count over its node's count; an occurrence that runs into the end of a text that
ended there, an output that stopped, counts against it, while one that runs into the end of a text still
being written, a running request's or one cut at its length limit, says nothing and is left out), times the
chance that a copy of that length is followed at all, ``L / (L + MATCH_HALF)`` for the match length ``L``
the token extends (the context matched plus the tokens drafted before it). The second factor is what makes
a two-token coincidence weak and a 30-token copy strong even when each has a single occurrence: at 3.5 it
reproduces the n-gram drafter's measured bucket priors (0.36 at 2 tokens, 0.70 at 8, 0.90 at 32).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.drafters.base import estimated_accepted

MATCH_HALF = 3.5
"""The match length at which a copy is as likely followed as not (see the module docstring)."""


def index_continuations(
    positions: dict[tuple[int, ...], list[int]], tokens: list[int], indexed: int, key_len: int
) -> int:
    """Index the ``key_len``-grams of ``tokens`` not indexed yet (``tokens[:indexed]`` are) by the position
    just after each; returns the new ``indexed``.

    A key is indexed once the position after it holds a token: the key at the very end is the query itself
    and has no continuation yet."""
    for end in range(max(indexed, key_len), len(tokens)):
        positions.setdefault(tuple(tokens[end - key_len : end]), []).append(end)
    return max(indexed, len(tokens))


@dataclass
class Document:
    """Tokens with an index from each ``key_len``-gram to the positions just after its occurrences.

    ``continuation_start``: other requests' drafts may continue only at positions from here on (a finished
    output is kept with a few prompt tokens before it as match context; a live request's prompt is its
    own, its output its tenant's)."""

    key_len: int
    tokens: list[int] = field(default_factory=list)
    continuation_start: int = 0
    positions: dict[tuple[int, ...], list[int]] = field(default_factory=dict)
    indexed: int = 0
    """``tokens[:indexed]`` have had their key indexed."""
    ends: bool = False
    """The text ends where its tokens do (an output that stopped). False while it may go on: a running
    request's document, or an output cut at its length limit. Two requests copying the same text side by
    side, one a token ahead: the trailing one counted the leader's end against the copy, rated its second
    token 0.49, and at concurrency 4 two repeated tasks drafted one token a step."""

    def extend(self, new_tokens: list[int]) -> None:
        """Append tokens and index every key whose continuation is now known."""
        self.tokens.extend(new_tokens)
        self.indexed = index_continuations(self.positions, self.tokens, self.indexed, self.key_len)

    def occurrences(self, key: tuple[int, ...], limit: int, start: int | None = None) -> list[int]:
        """Positions after the latest ``limit`` occurrences of ``key`` from ``start`` on (default:
        ``continuation_start``), latest first."""
        found = self.positions.get(key)
        if not found:
            return []
        start = self.continuation_start if start is None else start
        out: list[int] = []
        for pos in reversed(found):
            if pos < start:
                break  # positions are appended in order: the rest are earlier still
            out.append(pos)
            if len(out) == limit:
                break
        return out


@dataclass(frozen=True)
class Occurrence:
    """Where a document continues the context: ``doc.tokens[pos]`` would be the next token."""

    doc: Document
    pos: int
    match_len: int
    """Tokens before ``pos`` equal to the context's last tokens (at least the key, at most the depth)."""


def match_length(context: list[int], doc: Document, pos: int, depth: int) -> int:
    """How many tokens before ``pos`` in ``doc`` equal the context's last ones (capped at ``depth``)."""
    tokens, length = doc.tokens, doc.key_len
    end = len(context)
    while length < depth and pos - length - 1 >= 0 and end - length - 1 >= 0:
        if tokens[pos - length - 1] != context[end - length - 1]:
            break
        length += 1
    return length


@dataclass(frozen=True)
class Walk:
    """A chain draft and its estimate: ``conditional[i]`` is the chance token ``i`` is accepted given the
    ones before it were."""

    token_ids: tuple[int, ...]
    conditional: tuple[float, ...]
    match_len: int

    @property
    def score(self) -> float:
        """Expected accepted tokens under the estimate."""
        return estimated_accepted(self.conditional)


EMPTY_WALK = Walk((), (), 0)


def walk(occurrences: list[Occurrence], match_len: int, max_tokens: int, min_prob: float) -> Walk:
    """Follow the most frequent continuation of ``occurrences`` (all of match >= ``match_len``) while the
    cumulative estimate stays at least ``min_prob``; ties go to the earliest listed (the latest written)."""
    active = [(o.doc.tokens, o.pos, o.doc.ends) for o in occurrences]
    drafted: list[int] = []
    conditional: list[float] = []
    cumulative = 1.0
    for depth in range(max_tokens):
        counts: dict[int, int] = {}
        ended = 0  # occurrences whose text ended here: evidence that the copy stops
        for tokens, pos, ends in active:
            if pos + depth < len(tokens):
                token = tokens[pos + depth]
                counts[token] = counts.get(token, 0) + 1
            elif ends:
                ended += 1
        if not counts:
            break
        token, count = max(counts.items(), key=lambda kv: kv[1])  # first maximum: the latest occurrence's
        reach = match_len + depth
        p = count / (sum(counts.values()) + ended) * reach / (reach + MATCH_HALF)
        if cumulative * p < min_prob:
            break
        cumulative *= p
        drafted.append(token)
        conditional.append(p)
        active = [o for o in active if o[1] + depth < len(o[0]) and o[0][o[1] + depth] == token]
    return Walk(tuple(drafted), tuple(conditional), match_len)


def best_walk(
    occurrences: list[Occurrence], limit: int, factor: float, min_prob: float, max_lengths: int = 6
) -> Walk:
    """The best-scoring draft over the suffix lengths the occurrences match (at most ``max_lengths`` of the
    longest): a suffix of length ``L`` may draft ``factor × L`` tokens (SuffixDecoding's adaptive length)."""
    best = EMPTY_WALK
    lengths = sorted({o.match_len for o in occurrences}, reverse=True)[:max_lengths]
    for length in lengths:
        chosen = [o for o in occurrences if o.match_len >= length]
        max_tokens = min(limit, max(1, int(factor * length)))
        candidate = walk(chosen, length, max_tokens, min_prob)
        if candidate.score > best.score:
            best = candidate
    return best
