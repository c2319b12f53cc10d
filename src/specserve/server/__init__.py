"""The OpenAI-compatible HTTP server over one engine: ``app.create_app`` builds the ASGI app, ``main.serve``
runs it with uvicorn. (Nothing is imported here: a module of this package importing the package must not pull
in the whole app.)"""
