"""Loading llama.cpp: import llama-cpp-python lazily (it loads a shared library) and initialise it once.

Its own module because both the full runtime (:mod:`specserve.backends.llama_cpp`) and the vocabulary alone
(:mod:`specserve.backends.llama_cpp_vocab`) need it, and neither should import the other.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

_BACKEND_READY = False
_LOG_CALLBACK: Any = None  # keep the ctypes callback alive for the process lifetime
_GGML_LOG_WARN = 3  # ggml.h: NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5
_GGML_LOG_ERROR = 4
_GGML_LOG_CONT = 5
log = logging.getLogger("specserve.llama_cpp")


def llama_lib() -> Any:
    """Import llama_cpp lazily (it loads a shared library) and initialise the backend once."""
    global _BACKEND_READY, _LOG_CALLBACK
    import llama_cpp

    if not _BACKEND_READY:
        last_level = [0]

        def forward(level: int, text: bytes, _user: Any) -> None:
            # llama.cpp is chatty at load; keep its errors, send the rest to debug logging.
            if level != _GGML_LOG_CONT:
                last_level[0] = level
            message = text.decode("utf-8", errors="replace").rstrip()
            if message:
                level_map = {_GGML_LOG_ERROR: logging.ERROR, _GGML_LOG_WARN: logging.INFO}
                log.log(level_map.get(last_level[0], logging.DEBUG), "%s", message)

        _LOG_CALLBACK = llama_cpp.llama_log_callback(forward)
        llama_cpp.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        _BACKEND_READY = True
    return llama_cpp
