"""Stored responses of ``POST /v1/responses``: what ``GET /v1/responses/{id}`` returns and what
``previous_response_id`` continues.

One store per server process, in memory, bounded in entries and in bytes (the JSON size of each response
and its conversation); when a new response would pass either bound the oldest are evicted first. Every
entry belongs to a tenant (a hash of the API key that stored it, "" without keys): another tenant asking for
it is told it does not exist, exactly as for an id never stored or already evicted. A response larger than
the whole byte bound is not stored.

Each entry keeps the whole conversation that produced it (its input items, those of the responses it
continued, then its output items), so continuing it never needs an older entry that may be gone.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("specserve.server")


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]
    """The response object, as returned."""
    conversation: list[dict[str, Any]]
    """Input items (of this and the previous responses, instructions excluded), then the output items."""
    size: int
    """Bytes it counts for (JSON)."""


def json_size(*values: Any) -> int:
    return sum(len(json.dumps(v, ensure_ascii=False, separators=(",", ":")).encode()) for v in values)


class ResponseStore:
    """Responses by (tenant, id), oldest first. Used from the event loop only (no lock)."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[str, str], StoredResponse] = OrderedDict()
        self._bytes = 0
        self.evicted = 0
        """Entries evicted to make room, since the start."""

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self._bytes

    def put(
        self, tenant: str, response_id: str, response: dict[str, Any], conversation: list[dict[str, Any]]
    ) -> bool:
        """Store a response (replacing one of the same id); False if it alone exceeds the bounds."""
        size = json_size(response, conversation)
        if size > self.max_bytes or self.max_entries < 1:
            log.info(
                "response %s not stored: %d bytes, the store's bound is %d", response_id, size, self.max_bytes
            )
            return False
        self.delete(tenant, response_id)
        while self._entries and (
            len(self._entries) >= self.max_entries or self._bytes + size > self.max_bytes
        ):
            _, oldest = self._entries.popitem(last=False)
            self._bytes -= oldest.size
            self.evicted += 1
        self._entries[tenant, response_id] = StoredResponse(response, conversation, size)
        self._bytes += size
        return True

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        return self._entries.get((tenant, response_id))

    def delete(self, tenant: str, response_id: str) -> bool:
        entry = self._entries.pop((tenant, response_id), None)
        if entry is None:
            return False
        self._bytes -= entry.size
        return True
