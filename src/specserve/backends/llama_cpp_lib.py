"""Loading llama.cpp: import llama-cpp-python lazily (it loads a shared library) and initialise it once.

Its own module because both the full runtime (:mod:`specserve.backends.llama_cpp`) and the vocabulary alone
(:mod:`specserve.backends.llama_cpp_vocab`) need it, and neither should import the other.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path
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


_LOADED: dict[str, Any] = {}


def ggml_cpu_lib() -> Any:
    """The CPU backend library llama.cpp runs on (``libggml-cpu``), for the calls llama-cpp-python's bindings
    lack (the tiled kernel's start: llama_cpp_tiled.py); None where it cannot be found."""
    return _mapped_library("libggml-cpu")


def ggml_base_lib() -> Any:
    """ggml's core library (``libggml-base``: type traits, dequantization); None where it cannot be found."""
    return _mapped_library("libggml-base")


def _mapped_library(stem: str) -> Any:
    """The very file of that name the process mapped when it loaded llama.cpp, not any file of that name: a
    wheel holds ``libggml-cpu.so``, ``.so.0`` and ``.so.0.x`` as three copies (zip archives keep no links),
    and loading another copy would give a second library with state of its own, which llama.cpp never
    reads."""
    if stem not in _LOADED:
        llama_lib()
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return None
        loaded = sorted({line.split()[-1] for line in maps.splitlines() if f"/{stem}" in line})
        if not loaded:
            return None
        _LOADED[stem] = ctypes.CDLL(loaded[0])
    return _LOADED[stem]
