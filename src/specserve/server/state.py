"""What the routes share: settings, the loading status, the engine once it is ready, metrics and access.

The models load on a background thread (``start_loading``); ``status`` goes loading → ready (or failed), then
draining (SIGTERM: new generation requests get 503) → stopped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from specserve.backends.base import BackendError
from specserve.config import Settings
from specserve.engine.async_engine import AsyncEngine
from specserve.engine.builder import BuildReport, build_engine
from specserve.engine.engine import SpeculativeEngine
from specserve.sequence import SpeculationOptions
from specserve.server import protocol as p
from specserve.server.auth import AccessControl
from specserve.server.errors import APIError, invalid_request, unavailable
from specserve.server.metrics import Metrics

log = logging.getLogger("specserve.server")

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

    def _build(self) -> tuple[SpeculativeEngine, BuildReport | None]:
        factory = self._factory
        if isinstance(factory, SpeculativeEngine):
            return factory, None
        result = (factory or build_engine)(self.settings)
        return result if isinstance(result, tuple) else (result, None)

    def load(self) -> None:
        """Build the engine here and now (start_loading does it on a thread)."""
        try:
            engine, report = self._build()
        except Exception as exc:
            from specserve.models import ModelStoreError

            expected = isinstance(exc, BackendError | ModelStoreError | ValueError)  # no traceback needed
            log.error("loading the models failed: %s", exc, exc_info=not expected)
            self.reason = f"loading the models failed: {exc}"
            self.status = "failed"
            if self.on_failure is not None:
                self.on_failure(exc)
            return
        try:  # llguidance's view of the vocabulary (about 1 s for 150k tokens), before ready, not on the
            engine.grammars.tokenizer()  # first structured request
        except Exception as exc:  # structured outputs then fail alone, with their own error
            log.warning("the grammar engine could not read the vocabulary: %s", exc)
        with self._lock:
            if self._closed:  # shut down while loading
                engine.close()
                return
            self.report = report
            self.engine = AsyncEngine(engine, self.settings.max_waiting)
            self.metrics.attach(self.engine, lambda: bool(self.degraded_reasons()))
            self.status, self.reason = "ready", "ready"
        log.info("ready: %s with drafters %s", self.model_id, ", ".join(engine.drafters) or "none")
        for reason in self.degraded_reasons():
            log.warning("degraded: %s", reason)

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
