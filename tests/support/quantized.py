"""Tiny K-quant models, quantized by llama.cpp's own quantizer, for tests that must see its K-quant kernels.

Why: the f32/f16/q8_0 tiny models never reach the kernels that make a token's logits depend on its batch
size in stock ggml: the repacked Q4_K gemv/gemm pair and the Q6_K vec_dot/tiled pair. A ``Q4_K_M`` mix of a
tiny model whose row lengths are multiples of 256 (a K-quant super-block) and whose output row counts are
multiples of 8 (the repacked layout) reaches all four. ``Q4_K_M`` makes ``output.weight`` and, in the
last layer, ``attn_v``/``ffn_down`` Q6_K, and the rest Q4_K.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any

import gguf

from support.tiny_models import write_tiny_model

# llama.h: enum llama_ftype
FTYPES = {"Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18}

KQUANT_SHAPES: dict[str, Any] = {"n_embd": 256, "n_layer": 2, "n_head": 4, "n_head_kv": 2, "n_ff": 512}
"""Every matrix row is 256 or 512 long; attn_k/attn_v have 128 rows, the rest 256 or 512."""


def quantize(src: Path, dst: Path, ftype: str = "Q4_K_M") -> Path:
    """Quantize a GGUF with ``llama_model_quantize`` (the library behind ``llama-quantize``)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[ftype]
    params.nthread = 1
    tmp = dst.with_name(f"{dst.name}.{os.getpid()}.partial")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src} -> {ftype}) failed with code {rc}")
    tmp.replace(dst)
    return dst


def tiny_kquant_model(directory: Path, ftype: str = "Q4_K_M", seed: int = 5) -> Path:
    """Write (if absent) a tiny qwen2 model quantized to ``ftype``; returns its path."""
    directory = Path(directory)
    dst = directory / f"tiny-{ftype.lower()}-seed{seed}.gguf"
    if not dst.exists():
        src = write_tiny_model(directory / f"tiny-f32-seed{seed}.gguf", seed=seed, **KQUANT_SHAPES)
        quantize(src, dst, ftype)
    return dst


def tensor_types(path: Path) -> dict[str, str]:
    """Tensor name -> ggml type name (``Q4_K``, ``Q6_K``, ``F32`` ...) of a GGUF file."""
    reader = gguf.GGUFReader(path)
    return {t.name: t.tensor_type.name for t in reader.tensors}
