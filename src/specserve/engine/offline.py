"""The engine and its output processor on the caller's thread: ``specserve generate``, the tools, the tests.

A server runs the engine core on a thread or in a process of its own and processes its outputs beside the
API (engine/async_engine.py); code that just wants a few requests' text runs both here, one after the
other. A stop string ends its request within the step that completed it, as in the server.
"""

from __future__ import annotations

from specserve.engine.engine import SpeculativeEngine
from specserve.engine.output_processor import OutputProcessor, RequestOutput, RequestState
from specserve.request import SamplingParams
from specserve.sequence import SpeculationOptions


class OfflineEngine:
    """``add_request`` → :class:`RequestState`; ``step`` → the step's :class:`RequestOutput` s."""

    def __init__(self, engine: SpeculativeEngine) -> None:
        self.engine = engine
        self.outputs = OutputProcessor(engine.target.token_bytes)

    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        speculation: SpeculationOptions | None = None,
        cache_salt: str = "",
    ) -> RequestState:
        """Raises ValueError when the engine refuses the request (see ``SpeculativeEngine.add_request``)."""
        seq = self.engine.add_request(request_id, prompt_ids, params, speculation, cache_salt)
        return self.outputs.add(request_id, prompt_ids, params, seq.arrival_time)

    def has_work(self) -> bool:
        return self.engine.has_work()

    def step(self) -> list[RequestOutput]:
        results = [r for out in self.engine.step() if (r := self.outputs.process(out)) is not None]
        for request_id in self.outputs.take_stops():
            last = self.engine.abort(request_id, "stop")
            if last is not None and (result := self.outputs.process(last)) is not None:
                results.append(result)
        return results

    def run(self) -> None:
        """Step until every request has finished."""
        while self.has_work():
            self.step()

    def close(self) -> None:
        self.engine.close()
