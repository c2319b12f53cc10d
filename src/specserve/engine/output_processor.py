"""Requests' outputs as a client sees them, made from the engine core's token ids (vLLM's OutputProcessor).

The engine core hands out ids (engine/outputs.py). Beside the API server, one :class:`RequestState` per
request turns them into what a response needs: incremental text with stop strings, the raw logprobs of the
tokens kept, the prompt-side facts with the first output and the counters with the last. A stop string
that completes ends the request where plain decoding ends it: the text is cut before it, the ids after it
are not kept, and the request is named in :meth:`OutputProcessor.take_stops` so that its owner asks the
engine to end it (``abort(id, "stop")``); ids that arrive before that takes effect are dropped.

None of this runs on the engine's step: with the engine in its own process it runs in the API process, on
the event loop; with the engine on a thread, on the event loop too; :class:`~specserve.engine.offline.
OfflineEngine` runs it on the caller's thread right after each step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from specserve.engine.output_text import OutputText
from specserve.engine.outputs import EngineOutput, OutputFinish
from specserve.request import SamplingParams
from specserve.sequence import SpecStats, decode_timings
from specserve.verify.logprobs import PromptLogprob, TokenLogprobs


@dataclass(eq=False)
class RequestState:
    """One request as the API side knows it: its output so far, its text, and once finished its counters."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival_time: float
    """``time.perf_counter`` at submission (CLOCK_MONOTONIC: the engine's times compare with it)."""
    text_builder: OutputText
    output_ids: list[int] = field(default_factory=list)
    """The ids kept: up to the one that completed a stop string, never past it."""
    finish_reason: OutputFinish | None = None
    error: str | None = None
    """Why the engine refused the request (``finish_reason == "refused"``)."""
    stopping: bool = False
    """A stop string completed: the engine's last output for the request is on its way."""
    stats: SpecStats = field(default_factory=SpecStats)
    """Speculation counters (from the last output)."""
    cached_tokens: int = 0
    prompt_logprobs: list[PromptLogprob | None] = field(default_factory=list)
    scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    @property
    def text(self) -> str:
        """The output text so far (cut before a stop string)."""
        return self.text_builder.text

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def timings(self, start: float, end: float) -> dict[str, float]:
        return decode_timings(self.first_token_time, len(self.output_ids), start, end)


@dataclass(slots=True)
class RequestOutput:
    """What one step brought one request, as text."""

    state: RequestState
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    """The new tokens' log-probabilities, when the request asked for them."""

    @property
    def request_id(self) -> str:
        return self.state.request_id

    def merge(self, later: RequestOutput) -> None:
        """Take in the request's next output, as if one step had brought both (a consumer that is behind
        gets them together: the text, ids and logprobs joined are the same)."""
        self.new_token_ids += later.new_token_ids
        self.text_delta += later.text_delta
        self.new_logprobs += later.new_logprobs
        self.finished = later.finished


class OutputProcessor:
    """The states of the requests in flight; ``process`` turns an engine output into a request output."""

    def __init__(self, token_bytes: Callable[[int], bytes]) -> None:
        self._token_bytes = token_bytes
        self._states: dict[str, RequestState] = {}
        self._stops: list[str] = []

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def add(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, arrival_time: float
    ) -> RequestState:
        if request_id in self._states:
            raise ValueError(f"request id {request_id!r} is already in use")
        state = RequestState(
            request_id, prompt_ids, params, arrival_time, OutputText(self._token_bytes, params.stop)
        )
        self._states[request_id] = state
        return state

    def drop(self, request_id: str) -> RequestState | None:
        """Forget a request whose last output will never come (its engine is gone)."""
        return self._states.pop(request_id, None)

    def request_ids(self) -> list[str]:
        return list(self._states)

    def process(self, out: EngineOutput) -> RequestOutput | None:
        """The request's output for this step, or None when it brings nothing to show (ids after a stop
        string, or a request already ended)."""
        state = self._states.get(out.request_id)
        if state is None:
            return None
        if out.start is not None:
            start = out.start
            state.cached_tokens, state.prompt_logprobs = start.cached_tokens, start.prompt_logprobs
            state.scheduled_time, state.first_token_time = start.scheduled_time, start.first_token_time
        new: list[int] = []
        if not state.stopping:
            for token in out.new_token_ids:
                state.output_ids.append(token)
                new.append(token)
                if state.text_builder.append(token):
                    state.stopping = True
                    self._stops.append(state.request_id)
                    break
        if out.finish_reason is not None:
            del self._states[out.request_id]
            state.finish_reason = "stop" if state.stopping else out.finish_reason
            state.error = out.error
            if out.end is not None:
                end = out.end
                state.stats, state.finish_time = end.stats, end.finish_time
                state.draft_seconds, state.verify_seconds = end.draft_seconds, end.verify_seconds
            state.text_builder.finish()
        delta = state.text_builder.take_delta(final=state.finished)
        if not (new or delta or state.finished or out.start is not None):
            return None
        logprobs = out.new_logprobs[: len(new)] if out.new_logprobs else []
        return RequestOutput(state, new, delta, state.finished, logprobs)

    def take_stops(self) -> list[str]:
        """Requests whose stop string completed since the last call: end them in the engine (``stop``)."""
        stops, self._stops = self._stops, []
        return stops
