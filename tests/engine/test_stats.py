"""The engine's counters."""

from __future__ import annotations

import dataclasses

from specserve.engine.stats import EngineStats


def test_a_snapshot_is_not_changed_by_later_steps() -> None:
    """The metrics export what a step added since the last snapshot: every container must be its own."""
    stats = EngineStats()
    stats.record(4, 2)
    stats.record_drafter("ngram", 4, 2)
    snapshot = stats.snapshot()
    assert snapshot == stats
    stats.record(6, 6)
    stats.record_drafter("ngram", 6, 6)
    stats.record_drafter("suffix", 3, 1)
    stats.finished["stop"] += 1
    assert snapshot.accepted_per_position == [1, 1, 0, 0]
    assert snapshot.draft_tokens_by_drafter == {"ngram": 4}
    assert snapshot.num_drafts == 1 and not snapshot.finished
    mutable = [f.name for f in dataclasses.fields(stats) if isinstance(getattr(stats, f.name), list | dict)]
    assert all(getattr(snapshot, name) is not getattr(stats, name) for name in mutable)
