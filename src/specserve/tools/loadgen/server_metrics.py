"""Speculative decoding counters from a server's Prometheus ``GET /metrics``, as deltas over a window.

specserve and vLLM export the same counter names (``<prefix>:spec_decode_num_drafts``,
``…_num_draft_tokens``, ``…_num_accepted_tokens``, ``…_num_accepted_tokens_per_pos{position="i"}``), so
the benchmark scrapes them before and after each wave: that gives per-position acceptance, which the
per-response ``speculative`` object does not carry, and acceptance figures for a vLLM peer too. Series of
the same name with other labels (model, engine) are summed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfINFaN]+)")
_POSITION = re.compile(r'position="(\d+)"')
_NAMES = {
    "spec_decode_num_drafts": "num_drafts",
    "spec_decode_num_draft_tokens": "num_draft_tokens",
    "spec_decode_num_accepted_tokens": "num_accepted_tokens",
}
_PER_POSITION = "spec_decode_num_accepted_tokens_per_pos"


@dataclass
class SpecCounters:
    num_drafts: float = 0.0
    num_draft_tokens: float = 0.0
    num_accepted_tokens: float = 0.0
    accepted_per_position: dict[int, float] = field(default_factory=dict)

    def minus(self, before: SpecCounters) -> SpecCounters:
        positions = set(self.accepted_per_position) | set(before.accepted_per_position)
        return SpecCounters(
            self.num_drafts - before.num_drafts,
            self.num_draft_tokens - before.num_draft_tokens,
            self.num_accepted_tokens - before.num_accepted_tokens,
            {
                p: self.accepted_per_position.get(p, 0.0) - before.accepted_per_position.get(p, 0.0)
                for p in positions
            },
        )

    def add(self, other: SpecCounters) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for p, n in other.accepted_per_position.items():
            self.accepted_per_position[p] = self.accepted_per_position.get(p, 0.0) + n

    def per_position(self) -> list[int]:
        """Accepted tokens by position (0 = first draft token), up to the last position seen."""
        if not self.accepted_per_position:
            return []
        return [
            round(self.accepted_per_position.get(p, 0.0)) for p in range(max(self.accepted_per_position) + 1)
        ]


def _base_name(name: str) -> str:
    name = name.removesuffix("_total")
    return name.rsplit(":", 1)[-1]


def parse_spec_counters(text: str) -> SpecCounters | None:
    """The counters in a Prometheus exposition, or None when it has no speculative decoding counters."""
    counters = SpecCounters()
    found = False
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, labels, raw = match.groups()
        base = _base_name(name)
        try:
            value = float(raw)
        except ValueError:
            continue
        if base in _NAMES:
            setattr(counters, _NAMES[base], getattr(counters, _NAMES[base]) + value)
            found = True
        elif base == _PER_POSITION and labels:
            position = _POSITION.search(labels)
            if position is not None:
                p = int(position.group(1))
                counters.accepted_per_position[p] = counters.accepted_per_position.get(p, 0.0) + value
                found = True
    return counters if found else None
