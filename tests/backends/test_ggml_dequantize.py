"""ggml's own dequantization (the torch runtime's GGUF loader) against the ``gguf`` package's numpy port
of it: bit for bit, on files llama.cpp's quantizer wrote."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from specserve.backends.ggml_dequantize import to_float32
from specserve.models.gguf_header import read_header
from support.quantized import KQUANT_SHAPES, tiny_kquant_model
from support.tiny_models import write_tiny_model


def quantized_file(tmp_path: Path, ftype: str) -> Path:
    if ftype == "q8_0":
        return write_tiny_model(tmp_path / "q8.gguf", seed=5, weight_type="q8_0", **KQUANT_SHAPES)
    return tiny_kquant_model(tmp_path, ftype)


@pytest.mark.parametrize("ftype", ["Q4_K_M", "Q5_K_M", "Q6_K", "q8_0"])
def test_every_quantized_tensor_equals_the_gguf_packages_dequantization(ftype: str, tmp_path: Path) -> None:
    path = quantized_file(tmp_path, ftype)
    header = read_header(path)
    seen = set()
    for info in header.tensors:
        qtype = gguf.GGMLQuantizationType(info.ggml_type)
        if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            continue
        raw = np.memmap(path, np.uint8, "r", offset=header.data_offset + info.offset, shape=(info.n_bytes,))
        ours = to_float32(raw, info.ggml_type, int(np.prod(info.shape)))
        assert ours is not None, f"{info.name}: ggml has no converter for {qtype.name}"
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        reference = gguf.quants.dequantize(raw.reshape(-1, info.shape[0] // block * size), qtype)
        assert np.array_equal(ours, np.asarray(reference, np.float32).reshape(-1)), info.name
        seen.add(qtype.name)
    assert seen, "the file holds no quantized tensor"


def test_a_size_that_is_not_whole_blocks_is_refused() -> None:
    raw = np.zeros(34, np.uint8)  # one Q8_0 block: 32 values
    with pytest.raises(ValueError, match="not 31 values"):
        to_float32(raw, int(gguf.GGMLQuantizationType.Q8_0), 31)
