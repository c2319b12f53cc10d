"""GGUF tensors to float32 with ggml's own ``to_float``, from the library llama.cpp runs on.

The torch runtime loads a GGUF by dequantizing every tensor. The ``gguf`` package's numpy port of the same
code took 40 s for the 1.5B Q4_K_M default target on an AMD EPYC Zen 3 (7 s for the embedding alone);
ggml's C takes 5–10 s, and its result is bit for bit the port's (``tests/backends/test_ggml_dequantize.py``)
and llama.cpp's own reading of the weights.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from specserve.backends.llama_cpp_lib import ggml_base_lib


class _TypeTraits(ctypes.Structure):
    """ggml.h's ``struct ggml_type_traits`` (the fields up to ``to_float`` are what is read)."""

    _fields_ = [
        ("type_name", ctypes.c_char_p),
        ("blck_size", ctypes.c_int64),
        ("blck_size_interleave", ctypes.c_int64),
        ("type_size", ctypes.c_size_t),
        ("is_quantized", ctypes.c_bool),
        ("to_float", ctypes.c_void_p),
        ("from_float_ref", ctypes.c_void_p),
    ]


# void to_float(const void * x, float * y, int64_t k); CFUNCTYPE calls release the GIL.
_ToFloat = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
_CONVERTERS: dict[int, Any] = {}


def _converter(ggml_type: int) -> Any:
    """``(to_float, block size, bytes per block)`` of a ggml type; None without the library or a converter."""
    if ggml_type not in _CONVERTERS:
        lib = ggml_base_lib()
        converter = None
        if lib is not None:
            lib.ggml_get_type_traits.restype = ctypes.POINTER(_TypeTraits)
            lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
            traits = lib.ggml_get_type_traits(ggml_type).contents
            if traits.to_float:
                converter = (_ToFloat(traits.to_float), int(traits.blck_size), int(traits.type_size))
        _CONVERTERS[ggml_type] = converter
    return _CONVERTERS[ggml_type]


def to_float32(raw: np.ndarray[Any, Any], ggml_type: int, elements: int) -> np.ndarray[Any, Any] | None:
    """``elements`` values of ``ggml_type`` stored in ``raw`` (bytes), as a flat float32 array; None where
    ggml's library or its converter for the type is not available (the caller falls back to ``gguf``)."""
    converter = _converter(ggml_type)
    if converter is None:
        return None
    to_float, block, type_size = converter
    if elements % block or raw.nbytes != elements // block * type_size:
        raise ValueError(f"{raw.nbytes} bytes are not {elements} values of ggml type {ggml_type}")
    data = np.ascontiguousarray(raw)
    out = np.empty(elements, np.float32)
    to_float(data.ctypes.data, out.ctypes.data, elements)
    return out
