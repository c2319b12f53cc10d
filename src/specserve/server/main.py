"""``specserve serve``: run the HTTP server with uvicorn until SIGTERM or SIGINT, then stop gracefully.

Graceful stop: the first signal makes the server refuse new generation requests (503, and ``/ready`` says
503 so a load balancer stops sending), waits up to ``shutdown_grace_seconds`` for the requests in flight to
finish, then tells uvicorn to exit; the process exits 0. A second signal stops at once.
"""

from __future__ import annotations

import logging
import math
import signal
import sys
import threading
import time
from types import FrameType

import uvicorn

from specserve.config import Settings
from specserve.logging import configure_logging
from specserve.server.app import create_app
from specserve.server.connections import bounded_protocol
from specserve.server.state import ServerState

log = logging.getLogger("specserve.server")

CONNECTIONS_CLOSE_SECONDS = 5  # uvicorn's own wait for connections, once our drain is over
DRAIN_POLL_SECONDS = 0.05


class GracefulServer(uvicorn.Server):
    """uvicorn, with the first signal draining requests instead of stopping, and no re-raised signal."""

    def __init__(self, config: uvicorn.Config, state: ServerState, grace_seconds: float) -> None:
        super().__init__(config)
        self.state = state
        self.grace_seconds = grace_seconds
        self._draining = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded in _captured_signals: uvicorn would re-raise it after exiting (exit status -15).
        if self._draining or self.should_exit:
            log.warning("second signal %s: stopping now", signal.Signals(sig).name)
            self.should_exit = self.force_exit = True
            return
        self._draining = True
        threading.Thread(target=self._drain, args=(sig,), name="specserve-drain", daemon=True).start()

    def _drain(self, sig: int) -> None:
        state = self.state
        state.begin_drain()
        log.info(
            "%s: draining %d in-flight requests (grace %g s)",
            signal.Signals(sig).name,
            state.in_flight,
            self.grace_seconds,
        )
        deadline = time.monotonic() + self.grace_seconds
        while state.in_flight > 0 and time.monotonic() < deadline:
            time.sleep(DRAIN_POLL_SECONDS)
        if state.in_flight > 0:
            log.warning("grace period over: stopping with %d requests in flight", state.in_flight)
        self.should_exit = True


def serve(settings: Settings) -> int:
    """Serve until SIGINT/SIGTERM; returns the exit status (1 if the models could not be loaded)."""
    configure_logging(settings.log_level, settings.log_format)
    app = create_app(settings)
    state: ServerState = app.state.server
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,  # our handler and format (specserve.logging); no access log: requests log themselves
        log_level=settings.log_level,
        access_log=False,
        timeout_graceful_shutdown=CONNECTIONS_CLOSE_SECONDS,
        http=bounded_protocol(settings.client_timeout, settings.max_connections),
        # Idle kept-alive connections close at client_timeout (the header deadline re-armed after each
        # response), not at uvicorn's 5 s: that is httpx's (so the openai client's) idle expiry, and a request
        # sent into a connection the server is closing at that moment is lost (5 in 1,200 in a test).
        timeout_keep_alive=math.ceil(settings.client_timeout),
    )
    server = GracefulServer(config, state, settings.shutdown_grace_seconds)

    def stop(_: BaseException) -> None:  # a server that can never become ready should not linger
        server.should_exit = True

    state.on_failure = stop
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    log.info(
        "serving %s on http://%s:%d (GET /ready answers 200 once the models are loaded)",
        state.model_id,
        host,
        settings.port,
    )
    server.run()
    if state.status == "failed":  # already logged; one plain last line, like every CLI error
        print(f"specserve: error: {state.reason}", file=sys.stderr)
        return 1
    log.info("stopped")
    return 0
