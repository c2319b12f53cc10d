"""Engine-wide speculation settings (the server's switch changes ``speculation_enabled`` between steps)."""

from __future__ import annotations

from dataclasses import dataclass

from specserve.config import NUM_DRAFT_TOKENS


@dataclass(frozen=True)
class EngineOptions:
    """Engine-wide speculation defaults (per-request options override them)."""

    drafters: tuple[str, ...] = ("ngram",)
    """Drafters the policy may choose from when a request does not name one (``auto``)."""
    num_draft_tokens: int = NUM_DRAFT_TOKENS
    """Upper bound on draft tokens per step."""
    speculation_enabled: bool = True
    """Server-wide switch: False runs every request as plain decoding."""
