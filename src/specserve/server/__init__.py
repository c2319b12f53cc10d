"""OpenAI-compatible HTTP server: ``create_app`` builds the ASGI app, ``serve`` runs it with uvicorn."""

from specserve.server.app import create_app

__all__ = ["create_app"]
