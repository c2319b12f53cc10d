"""Sampling parameters and the per-request random streams.

Sampling is *coupled by position*: the token a request emits at output position ``i`` is drawn from the
target's filtered distribution with the uniform number ``uniforms(SAMPLE_STREAM)[i]`` (inverse-CDF sampling).
Plain decoding and speculative decoding with a deterministic (model-free) drafter therefore emit the *same*
sampled text for the same seed, whatever the draft length chosen at each step. The draft model, whose
proposals are themselves random, consumes a separate stream.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

# Stream ids for :class:`PositionalUniforms`; one independent uniform sequence per purpose.
SAMPLE_STREAM = 0  # target sampling: plain steps, recovered and bonus tokens
ACCEPT_STREAM = 1  # the accept/reject coin of rejection sampling against draft-model probabilities
DRAFT_STREAM = 2  # the draft model sampling its own proposals


MAX_LOGPROBS = 20
"""The most alternatives per token a request may ask for (OpenAI's top_logprobs limit)."""

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class GrammarSpec:
    """A structured-output constraint as the request gave it: ``kind`` and its text.

    ``json_schema``: a JSON Schema (as JSON text); ``json_object``: any JSON object (text unused);
    ``regex``: a regular expression; ``choice``: a JSON list of strings; ``grammar``: Lark or GBNF (EBNF).

    With ``triggers`` the grammar is *lazy*, as llama.cpp's are for tool calls: the output is free until one
    of these regular expressions (Python syntax, over the output's UTF-8 bytes) first matches it; from that
    match's start on, the output must follow the grammar (the matched text included).
    """

    kind: str
    text: str = ""
    triggers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, got {self.kind!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. ``temperature == 0`` means greedy (argmax, no softmax)."""

    temperature: float = 0.0
    """Softmax temperature; 0 selects greedy decoding."""
    top_k: int = 0
    """Keep the k most probable tokens; 0 disables."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability mass reaches top_p; 1 disables."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most probable one; 0 disables."""
    seed: int | None = None
    """Seed of the request's random streams; None draws one from the OS."""
    max_tokens: int = 256
    """Maximum number of generated tokens; 0 evaluates the prompt only (for its ``prompt_logprobs``)."""
    stop: tuple[str, ...] = ()
    """Stop strings; the output ends just before the first occurrence and excludes it."""
    ignore_eos: bool = False
    """Keep generating past end-of-generation tokens (benchmarks)."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token already in the output (OpenAI's, in [-2, 2])."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per occurrence in the output (OpenAI's, in [-2, 2])."""
    repetition_penalty: float = 1.0
    """vLLM's: a logit of a token in the prompt or output is divided by it if positive, multiplied if not."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to the raw logits (OpenAI's, bias in [-100, 100])."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end the output like end-of-generation (not emitted)."""
    logprobs: int | None = None
    """Return each emitted token's log-probability and this many most likely alternatives; None: none."""
    grammar: GrammarSpec | None = None
    """Constrain the output to a grammar (structured outputs); None: free text."""
    prompt_logprobs: int | None = None
    """Return each prompt token's log-probability (the first has none) and this many most likely
    alternatives at its position, from the prefill pass; None: none."""

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2.0 <= value <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not (math.isfinite(self.repetition_penalty) and 0.01 <= self.repetition_penalty <= 10.0):
            raise ValueError(f"repetition_penalty must be in [0.01, 10], got {self.repetition_penalty}")
        if any(not (math.isfinite(b) and -100.0 <= b <= 100.0) for _, b in self.logit_bias):
            raise ValueError("logit_bias values must be in [-100, 100]")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")

    def unknown_token_ids(self, vocab: int) -> str | None:
        """The field (``logit_bias`` or ``stop_token_ids``) with a token id outside ``[0, vocab)``, if any."""
        for name, ids in (
            ("logit_bias", [t for t, _ in self.logit_bias]),
            ("stop_token_ids", self.stop_token_ids),
        ):
            if any(not 0 <= t < vocab for t in ids):
                return name
        return None

    @property
    def penalized(self) -> bool:
        """Some knob changes the raw logits before the target chooses (penalties or logit_bias)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class PositionalUniforms:
    """Reproducible uniforms in [0, 1) indexed by (stream, output position).

    Each stream is an independent PCG64 sequence keyed by (seed, stream); values are generated in order and
    cached, so ``take(s, i)`` is the same number however the positions are visited.
    """

    seed: int
    _cache: dict[int, np.ndarray] = field(default_factory=dict)
    _gens: dict[int, np.random.Generator] = field(default_factory=dict)

    def take(self, stream: int, start: int, count: int) -> np.ndarray:
        """Uniforms for positions ``start .. start + count - 1`` of ``stream``; float64 ``[count]``."""
        end = start + count
        have = self._cache.get(stream, np.empty(0))
        if end > have.size:
            gen = self._gens.setdefault(stream, np.random.Generator(np.random.PCG64([self.seed, stream])))
            more = gen.random(max(end - have.size, 256))
            have = np.concatenate([have, more])
            self._cache[stream] = have
        return have[start:end]
