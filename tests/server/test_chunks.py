"""A streamed token's event, built around its text, is the chunk the encoder would write."""

from __future__ import annotations

import pytest

from specserve.server.chunks import ChunkFormat, sse

TEXTS = [
    "",
    "x",
    'a "quoted" \\ back\\slash',
    "line\nbreak\ttab",
    "é 漢字 🙂",
    "\u2028\x00\x1f",
    "\ue000text\ue000",
]


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("include_usage", [True, False])
def test_a_text_deltas_event_is_the_encoded_chunk(chat: bool, include_usage: bool) -> None:
    fmt = ChunkFormat(chat, 'cmpl-"1"', 1_700_000_000, 'mödel/"x"', include_usage, lambda t: b"", n=2)
    for index in (0, 1):
        for text in TEXTS:
            assert fmt.delta_event(index, text) == sse(fmt.delta(index, text)), (index, text)
