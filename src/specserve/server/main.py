"""``specserve serve``: run the HTTP server with uvicorn until interrupted."""

from __future__ import annotations

import sys

from specserve.config import Settings
from specserve.server.app import ServerState, create_app

GRACEFUL_SHUTDOWN_SECONDS = 5


def serve(settings: Settings, log_level: str = "warning") -> int:
    """Serve until SIGINT/SIGTERM; returns the exit status (1 if the models could not be loaded)."""
    import uvicorn

    app = create_app(settings)
    state: ServerState = app.state.server
    level = log_level.lower()
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=level,
        access_log=level in ("debug", "info"),
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
    )
    server = uvicorn.Server(config)

    def stop(_: BaseException) -> None:  # a server that can never become ready should not linger
        server.should_exit = True

    state.on_failure = stop
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    print(
        f"specserve: serving {state.model_id} on http://{host}:{settings.port} "
        "(GET /ready answers 200 once the models are loaded)",
        file=sys.stderr,
        flush=True,
    )
    server.run()
    if state.status == "failed":
        print(f"specserve: error: {state.reason}", file=sys.stderr)
        return 1
    return 0
