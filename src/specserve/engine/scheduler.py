"""Which sequences run this step, and how much of each prompt is prefilled.

Requests wait in FIFO order until a KV slot is free. Prompts are prefilled in chunks under a per-step token
budget, so a long prompt joins the running batch without stalling the sequences that are already decoding.
Chunk boundaries never depend on other requests (see ``schedule``).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from specserve.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)
    """Sequences with prompt tokens to evaluate, and how many this step."""
    decodes: list[Sequence] = field(default_factory=list)
    """Sequences with a pending token: they take a (speculative) decoding step."""

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    def __init__(
        self,
        max_running: int,
        prefill_budget: int = 256,
        admit: Callable[[Sequence, Seq[int]], int] | None = None,
    ) -> None:
        """``admit(seq, choices)`` picks the slot of a sequence leaving the queue among the free slots
        :meth:`slot_choices` offers (and may fill its KV, as the prefix cache does); by default the most
        recently freed of them."""
        if max_running < 1:
            raise ValueError("max_running must be >= 1")
        self.max_running = max_running
        self.prefill_budget = prefill_budget
        self._admit = admit
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._free_slots = list(range(max_running - 1, -1, -1))

    @property
    def num_free_slots(self) -> int:
        """KV slots no running sequence holds."""
        return len(self._free_slots)

    def add(self, seq: Sequence) -> None:
        assert seq.status is SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        while self.waiting and self._free_slots:
            seq = self.waiting.popleft()
            choices = self.slot_choices()
            seq.slot = self._admit(seq, choices) if self._admit else choices[-1]
            self._free_slots.remove(seq.slot)
            seq.status = SequenceStatus.RUNNING
            seq.scheduled_time = time.perf_counter()
            self.running.append(seq)
        batch = ScheduledBatch()
        budget = self.prefill_budget
        for seq in self.running:
            if seq.is_prefilling:
                # Whole chunks at fixed offsets (multiples of the budget): a prompt is cut the same way
                # whoever else is running, so exact mode computes it exactly as it would alone.
                n = min(self.prefill_budget, len(seq.prompt_ids) - seq.num_computed)
                if n <= budget:
                    batch.prefills.append((seq, n))
                    budget -= n
            else:
                batch.decodes.append(seq)
        if not batch.decodes and not batch.prefills and self.running:
            raise AssertionError("running sequences but nothing scheduled")
        return batch

    def slot_choices(self) -> list[int]:
        """The free slots beside the most running sequences' slots (in the free list's order; none when full).

        llama.cpp evaluates a call as one pass over the weights per run of consecutive sequence ids
        (backends/llama_cpp_passes.py), so a sequence admitted next to the others keeps a step one pass: four
        one-token sequences on slots 0, 1, 4, 5 took 114 ms a step on a Zen 4, on 0-3 91 ms. The prefix cache
        copies a cached prefix into the chosen slot rather than run from the slot that holds it elsewhere."""
        busy = {seq.slot for seq in self.running}

        def neighbours(slot: int) -> int:
            return (slot - 1 in busy) + (slot + 1 in busy)

        most = max((neighbours(slot) for slot in self._free_slots), default=0)
        return [slot for slot in self._free_slots if neighbours(slot) == most]

    def release(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its slot."""
        if seq in self.running:
            self.running.remove(seq)
            self._free_slots.append(seq.slot)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def find(self, request_id: str) -> Sequence | None:
        for seq in (*self.running, *self.waiting):
            if seq.request_id == request_id:
                return seq
        return None
