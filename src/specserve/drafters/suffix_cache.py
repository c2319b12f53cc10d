"""The suffix drafter's memory across requests: recent outputs, per tenant, bounded in requests and tokens.

Each finished request leaves its output (with the last prompt tokens before it as match context, so the
output's first tokens can be matched) under its tenant: the request's cache salt, which holds its API key's
hash and its own ``cache_salt`` as the prefix cache's does. A request drafts only from its own tenant's
documents, so no tenant's text can shape another's drafts (nor could it time them). Requests still running
are visible to their tenant too, from their output on: the copies of an ``n > 1`` request, or a batch of
similar extractions, draft from each other while they run. Eviction is oldest first over all tenants.
"""

from __future__ import annotations

from collections import OrderedDict

from specserve.drafters.suffix_index import Document


class SuffixCache:
    """Finished outputs by tenant (bounded), and the live requests' documents by tenant."""

    def __init__(self, max_requests: int, max_tokens: int, key_len: int, context_tokens: int) -> None:
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.key_len = key_len
        self.context_tokens = context_tokens
        """Prompt tokens kept before a finished output as match context (the drafter's depth)."""
        self._finished: OrderedDict[int, tuple[str, Document]] = OrderedDict()  # oldest first
        self._by_tenant: dict[str, OrderedDict[int, Document]] = {}
        self._live: dict[str, dict[str, Document]] = {}
        self._next_id = 0
        self.num_tokens = 0
        """Tokens held by finished documents (what ``max_tokens`` bounds)."""

    @property
    def num_requests(self) -> int:
        return len(self._finished)

    def add_live(self, tenant: str, request_id: str, doc: Document) -> None:
        self._live.setdefault(tenant, {})[request_id] = doc

    def drop_live(self, tenant: str, request_id: str) -> None:
        live = self._live.get(tenant)
        if live is not None:
            live.pop(request_id, None)
            if not live:
                del self._live[tenant]

    def add_finished(self, tenant: str, prompt_tail: list[int], output: list[int], ends: bool = True) -> None:
        """Keep a finished output (``ends``: it stopped, rather than being cut at its length limit); evict the
        oldest documents (any tenant's) beyond the bounds."""
        if not output or self.max_requests <= 0 or self.max_tokens <= 0:
            return
        room = self.max_tokens - len(output)
        context = prompt_tail[len(prompt_tail) - max(0, min(self.context_tokens, room)) :] if room > 0 else []
        doc = Document(self.key_len, continuation_start=len(context), ends=ends)
        doc.extend([*context, *output[-self.max_tokens :]])
        doc_id, self._next_id = self._next_id, self._next_id + 1
        self._finished[doc_id] = (tenant, doc)
        self._by_tenant.setdefault(tenant, OrderedDict())[doc_id] = doc
        self.num_tokens += len(doc.tokens)
        while self._finished and (
            len(self._finished) > self.max_requests or self.num_tokens > self.max_tokens
        ):
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        doc_id, (tenant, doc) = self._finished.popitem(last=False)
        self.num_tokens -= len(doc.tokens)
        docs = self._by_tenant[tenant]
        del docs[doc_id]
        if not docs:
            del self._by_tenant[tenant]

    def documents(self, tenant: str, exclude: str) -> list[Document]:
        """The tenant's documents a request may draft from besides its own: live ones first, then finished
        ones latest first."""
        live = [doc for rid, doc in self._live.get(tenant, {}).items() if rid != exclude]
        finished = self._by_tenant.get(tenant)
        return live + (list(reversed(finished.values())) if finished else [])

    def clear(self) -> None:
        self._finished.clear()
        self._by_tenant.clear()
        self.num_tokens = 0
