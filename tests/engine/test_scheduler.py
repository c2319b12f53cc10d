"""The scheduler's slot choice: a sequence is admitted beside the running ones, so a step stays one pass."""

from __future__ import annotations

from specserve.backends.llama_cpp_passes import stream_passes
from specserve.engine.scheduler import Scheduler
from specserve.request import PositionalUniforms, SamplingParams
from specserve.sequence import Sequence


def seq(request_id: str) -> Sequence:
    return Sequence(request_id, [1, 2, 3], SamplingParams(), PositionalUniforms(0))


def admit(scheduler: Scheduler, *request_ids: str) -> list[Sequence]:
    seqs = [seq(r) for r in request_ids]
    for s in seqs:
        scheduler.add(s)
    scheduler.schedule()
    return seqs


def passes(scheduler: Scheduler) -> int:
    """llama.cpp passes of a step where every running sequence decodes one token (the runtime writes a
    call in slot order)."""
    return len(stream_passes(sorted((s.slot, 1) for s in scheduler.running), n_ubatch=512))


def test_a_wave_takes_consecutive_slots() -> None:
    scheduler = Scheduler(8)
    wave = admit(scheduler, "a", "b", "c", "d")
    assert sorted(s.slot for s in wave) == [0, 1, 2, 3]


def test_a_new_sequence_fills_the_hole_a_finished_one_left() -> None:
    scheduler = Scheduler(8)
    _, b, _, d = admit(scheduler, "a", "b", "c", "d")
    scheduler.release(b)
    scheduler.release(d)  # freed last: the slot a free list alone would hand out next
    (e,) = admit(scheduler, "e")
    assert e.slot == b.slot
    assert passes(scheduler) == 1


def test_the_choice_is_made_again_for_each_sequence_of_a_wave() -> None:
    scheduler = Scheduler(8)
    first = admit(scheduler, "a", "b", "c", "d")
    for s in first:
        scheduler.release(s)
    # Slots freed in an order that a most-recently-freed rule would turn into 1, 3, 0, 2 and then 4...
    admit(scheduler, "x")
    admit(scheduler, "y", "z", "w")
    assert passes(scheduler) == 1


def test_offered_slots_are_all_free_slots_when_nothing_runs() -> None:
    scheduler = Scheduler(4)
    assert sorted(scheduler.slot_choices()) == [0, 1, 2, 3]
    (a,) = admit(scheduler, "a")
    assert scheduler.slot_choices() == [a.slot + 1] or scheduler.slot_choices() == [a.slot - 1]
