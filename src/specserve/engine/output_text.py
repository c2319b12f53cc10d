"""Incremental detokenization with stop strings.

Tokens are committed one at a time, also inside a run of accepted draft tokens, so a stop string that
completes in the middle of a run ends the output exactly where plain decoding would have ended it.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable


class OutputText:
    """The text of one request's output, built token by token."""

    def __init__(self, token_bytes: Callable[[int], bytes], stop: tuple[str, ...]) -> None:
        self._token_bytes = token_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = stop
        self._max_stop = max((len(s) for s in stop), default=0)
        self.text = ""
        self.stopped_by: str | None = None
        self._emitted = 0

    def append(self, token_id: int) -> bool:
        """Add one token; returns True when a stop string completed (the text is cut before it)."""
        piece = self._decoder.decode(self._token_bytes(token_id))
        if not piece:
            return False
        search_from = max(0, len(self.text) - self._max_stop + 1)
        self.text += piece
        if self._stop:
            window = self.text[search_from:]
            hits = [(window.find(s), s) for s in self._stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                index, stop = min(hits)
                self.text = self.text[: search_from + index]
                self.stopped_by = stop
                return True
        return False

    def finish(self) -> None:
        """Flush a trailing incomplete UTF-8 sequence (it becomes U+FFFD) unless a stop string ended us."""
        if self.stopped_by is None:
            self.text += self._decoder.decode(b"", final=True)

    def take_delta(self, final: bool) -> str:
        """New text since the last call, holding back a tail that could still grow into a stop string."""
        end = len(self.text)
        if not final and self._stop:
            end -= self._stop_prefix_len()
        delta = self.text[self._emitted : end] if end > self._emitted else ""
        self._emitted = max(self._emitted, end)
        return delta

    def _stop_prefix_len(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of some stop string."""
        best = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(self.text)), best, -1):
                if self.text.endswith(stop[:n]):
                    best = n
                    break
        return best
