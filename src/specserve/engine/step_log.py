"""One JSON line per engine step, for diagnosing what the draft policy chose and what it cost (``step_log``).

The request summary lines say what a request's speculation gained in all; this says why, step by step: the
passes the runtime made of the step and their priced and measured seconds, and for each sequence its slot,
the drafter and match bucket it drafted from, the tokens it drafted and kept, and the tokens the policy
expected. Two runs of one task side by side at concurrency 4 drafted one token a step for 90 steps, with
every token kept; the lines showed why (the drafter rated the trailing run's second token 0.49).

A line holds counts, never token ids or text (a prompt never reaches the log this way), and costs a few
microseconds; without the setting nothing is written or computed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import IO, Any

from specserve.engine.emitting import Emitting
from specserve.engine.scheduler import ScheduledBatch

ESTIMATES_KEPT = 4
"""A draft's first per-token estimates written out (where its drafter gives them)."""


class StepLog:
    """Appends a step's line to a file (line-buffered: ``tail -f`` shows each step as it ends)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file: IO[str] = self.path.open("a", buffering=1, encoding="utf-8")

    def record(
        self,
        batch: ScheduledBatch,
        emitting: Seq[Emitting],
        emitted: Seq[list[int] | Exception],
        passes: list[int],
        seconds: float,
        priced: float,
    ) -> None:
        """``passes``: rows of each pass the runtime made; ``seconds``: the target pass as measured;
        ``priced``: the cost table's price of those passes, as the policy planned the step (before the
        step's own time refines the table)."""
        sequences: list[dict[str, Any]] = []
        for e, tokens in zip(emitting, emitted, strict=True):
            line: dict[str, Any] = {"id": e.seq.request_id, "slot": e.seq.slot}
            if isinstance(tokens, Exception):
                line["error"] = type(tokens).__name__
            elif e.plan is None:
                line["first_token"] = True
            else:
                plan = e.plan
                drafted = len(e.request.draft_ids)
                line["drafted"], line["kept"] = drafted, max(len(tokens) - 1, 0)
                if plan.drafter is not None:
                    line["drafter"], line["bucket"] = plan.drafter.name, plan.bucket
                    line["expected"] = round(plan.expected_tokens(), 3)
                    if plan.token_probs:
                        line["estimates"] = [round(p, 3) for p in plan.token_probs[:ESTIMATES_KEPT]]
            sequences.append(line)
        record = {
            "time": round(time.time(), 4),
            "prefill": [[seq.slot, n] for seq, n in batch.prefills],
            "passes": passes,
            "seconds": round(seconds, 5),
            "priced": round(priced, 5),
            "sequences": sequences,
        }
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._file.close()
