"""How llama.cpp splits one ``llama_decode`` call into passes when every sequence has its own KV stream.

With ``kv_unified = False`` (exact mode needs it: backends/llama_cpp.py) llama.cpp evaluates a call in
micro-batches built by ``llama_batch_allocr::split_equal(n_ubatch, sequential=true)``: each holds a run of
*consecutive* sequence ids (the attention reads the streams ``s0..s1`` as one view) with the *same* number of
tokens each. Every micro-batch is a full forward pass: on a CPU, where a pass costs about a one-token step
before its rows are counted, four one-row sequences in the order 1, 2, 3, 0 ran as two passes (202 ms on a
Xeon where one pass took 120 ms), and verify chunks of 1, 9, 1 and 5 rows as three.

:func:`stream_passes` mirrors that split, so the draft policy prices what will run; ``decode`` writes a
call's tokens in sequence order, which is the best order for it.
"""

from __future__ import annotations

from collections.abc import Sequence


def stream_passes(pieces: Sequence[tuple[int, int]], n_ubatch: int) -> list[int]:
    """Rows of each micro-batch llama.cpp runs for one call holding ``(seq_id, rows)`` pieces, in the
    call's token order (pieces of one sequence count together, as llama.cpp groups them).

    Each micro-batch starts at the first sequence with tokens left and adds every later sequence whose id
    is one more than the last added (scanning in token order); each sequence gives it the same number of
    tokens: the fewest any of them has left, at most ``n_ubatch`` over their count (at least one).

    Example: ``[(0, 1), (1, 9), (2, 1), (3, 5)]`` → ``[4, 8, 4]``: four sequences one row each, then
    sequence 1 alone (3 is not 1 + 1), then sequence 3.
    """
    order: list[int] = []
    left: dict[int, int] = {}
    for seq_id, rows in pieces:
        if rows <= 0:
            continue
        if seq_id not in left:
            order.append(seq_id)
            left[seq_id] = 0
        left[seq_id] += rows
    passes: list[int] = []
    while order:
        group = [order[0]]
        for seq_id in order[1:]:
            if seq_id == group[-1] + 1:
                group.append(seq_id)
        each = min(min(left[s] for s in group), max(1, n_ubatch // len(group)))
        passes.append(each * len(group))
        for seq_id in group:
            left[seq_id] -= each
        order = [s for s in order if left[s] > 0]
    return passes
