"""What the routes share: settings, the loading status, the engine once it is ready, metrics and access.

The models load on a background thread (``start_loading``); ``status`` goes loading → ready (or failed), then
draining (SIGTERM: new generation requests get 503) → stopped.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from specserve.backends.base import BackendError, Vocabulary
from specserve.config import Settings
from specserve.engine.async_engine import AsyncEngine, EngineDeadError
from specserve.engine.builder import BuildReport, build_engine
from specserve.engine.core import CoreHost
from specserve.engine.core_thread import ThreadCore
from specserve.engine.engine import SpeculativeEngine
from specserve.sequence import SpeculationOptions
from specserve.server import protocol as p
from specserve.server.auth import AccessControl
from specserve.server.errors import APIError, invalid_request, unavailable
from specserve.server.metrics import Metrics
from specserve.structured.grammar import GrammarCompiler

log = logging.getLogger("specserve.server")

STATE_TIMEOUT_S = 5.0
"""How long a status answer waits for the engine's state."""

EngineFactory = Callable[[Settings], SpeculativeEngine | tuple[SpeculativeEngine, BuildReport]]


def served_model_id(settings: Settings) -> str:
    """The model name clients use: --served-model-name, else the target's catalog name, file stem or
    checkpoint directory name (``/models/Qwen2.5-7B-Instruct/`` → ``Qwen2.5-7B-Instruct``)."""
    if settings.served_model_name:
        return settings.served_model_name
    target = settings.target
    if target.endswith(".gguf"):
        return Path(target).stem
    return Path(target).name if Path(target).is_dir() else target


class ServerState:
    """What the routes share: settings, the loading status and, once ready, the AsyncEngine."""

    def __init__(self, settings: Settings, factory: EngineFactory | SpeculativeEngine | None) -> None:
        self.settings = settings
        self.model_id = served_model_id(settings)
        self.created = int(time.time())
        self.timeout = settings.request_timeout or None
        self.status: Literal["loading", "ready", "draining", "failed", "stopped"] = "loading"
        self.reason = "the models are loading and calibrating"
        self.engine: AsyncEngine | None = None
        self.report: BuildReport | None = None
        self.on_failure: Callable[[BaseException], None] | None = None
        self.metrics = Metrics()
        self.access = AccessControl(settings)
        self.in_flight = 0
        """Generation requests being served (event loop only)."""
        self._factory = factory
        self._lock = threading.Lock()
        self._closed = False

    def start_loading(self) -> None:
        threading.Thread(target=self.load, name="specserve-loader", daemon=True).start()

    def _start(self) -> tuple[CoreHost, Vocabulary, GrammarCompiler, BuildReport | None]:
        """The engine core, in a process of its own unless the settings say otherwise or the engine was
        given (tests); and this process's vocabulary and grammar compiler."""
        factory = self._factory
        if factory is None and self.settings.engine_process:
            from specserve.backends.vocabulary import open_vocabulary
            from specserve.engine.core_process import ProcessCore

            process = ProcessCore.start(self.settings)
            try:
                vocabulary = open_vocabulary(process.target_path)
            except BaseException:
                process.close()
                raise
            return (
                process,
                vocabulary,
                GrammarCompiler(vocabulary, process.facts.info.vocab_size),
                process.report,
            )
        if isinstance(factory, SpeculativeEngine):
            engine, report = factory, None
        else:
            result = (factory or build_engine)(self.settings)
            engine, report = result if isinstance(result, tuple) else (result, None)
        return ThreadCore(engine), engine.target, engine.grammars, report

    def load(self) -> None:
        """Start the engine here and now (start_loading does it on a thread)."""
        try:
            core, vocabulary, grammars, report = self._start()
        except Exception as exc:
            from specserve.engine.core_process import EngineLoadError
            from specserve.models import ModelStoreError

            expected = isinstance(exc, BackendError | ModelStoreError | ValueError)  # no traceback needed
            if isinstance(exc, EngineLoadError):  # the engine process logged it
                self.reason, expected = str(exc), True
            else:
                log.error("loading the models failed: %s", exc, exc_info=not expected)
                self.reason = f"loading the models failed: {exc}"
            self.status = "failed"
            if self.on_failure is not None:
                self.on_failure(exc)
            return
        try:  # llguidance's view of the vocabulary (about 1 s for 150k tokens), before ready, not on the
            grammars.tokenizer()  # first structured request
        except Exception as exc:  # structured outputs then fail alone, with their own error
            log.warning("the grammar engine could not read the vocabulary: %s", exc)
        with self._lock:
            if self._closed:  # shut down while loading
                core.close()
                return
            self.report = report
            self.engine = AsyncEngine(core, vocabulary, grammars, self.settings.max_waiting)
            self.engine.on_death = self._engine_died
            self.metrics.attach(self.engine, lambda: bool(self.degraded_reasons()))
            self.status, self.reason = "ready", "ready"
        drafters = ", ".join(self.engine.loaded_drafters()) or "none"
        log.info("ready: %s with drafters %s", self.model_id, drafters)
        for reason in self.degraded_reasons():
            log.warning("degraded: %s", reason)

    async def refresh_engine_state(self) -> None:
        """Fetch the engine's counters and drafters (between two of its steps) for a status answer; a
        stopped or stalled engine leaves them as last fetched."""
        if self.engine is not None:
            with contextlib.suppress(EngineDeadError, TimeoutError, RuntimeError):
                await self.engine.refresh(STATE_TIMEOUT_S)

    def _engine_died(self, error: BaseException) -> None:
        """The engine core stopped while serving: not ready from now on, and the server exits non-zero
        (its supervisor restarts it; requests in flight got a 503 or an error event)."""
        with self._lock:
            if self._closed:
                return
            self.status, self.reason = "failed", f"the engine stopped: {error}"
        if self.on_failure is not None:
            self.on_failure(error)

    def degraded_reasons(self) -> list[str]:
        """Why speculation runs with less than configured: a draft model not loaded, a drafter disabled."""
        reasons = list(self.report.notes) if self.report is not None and self.report.degraded else []
        if self.engine is not None:
            reasons += [
                f"drafter {name} disabled after repeated failures" for name in self.engine.disabled_drafters()
            ]
        return reasons

    def begin_drain(self) -> None:
        """Stop taking new generation requests (503); those in flight go on."""
        with self._lock:
            if self.status == "ready":
                self.status, self.reason = "draining", "the server is shutting down"

    def close(self) -> None:
        with self._lock:
            self._closed = True
            engine = self.engine
            if self.status in ("ready", "draining"):
                self.status, self.reason = "stopped", "the server is shutting down"
        if engine is not None:
            engine.close()

    def require_engine(self) -> AsyncEngine:
        if self.status != "ready" or self.engine is None:
            raise unavailable(f"The server is not ready: {self.reason}.", f"server_{self.status}")
        return self.engine

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.model_id, self.settings.target):
            raise APIError(
                404,
                f"The model '{model}' does not exist; this server serves '{self.model_id}'.",
                param="model",
                code="model_not_found",
            )

    def speculation(
        self, engine: AsyncEngine, spec: p.SpeculativeRequest | None
    ) -> SpeculationOptions | None:
        if spec is None:
            return None
        loaded = engine.loaded_drafters()
        if spec.drafter is not None and spec.drafter not in (*loaded, "auto", "none"):
            raise invalid_request(
                f"The drafter '{spec.drafter}' is not available; choose one of "
                f"{', '.join([*loaded, 'auto', 'none'])}.",
                "speculative.drafter",
                "unknown_drafter",
            )
        return spec.options()
