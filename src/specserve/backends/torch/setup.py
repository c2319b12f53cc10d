"""What a torch runtime resolves before it runs: the dtype for a device, a handed-in decoder's fit, the
vocabulary of a checkpoint or GGUF."""

from __future__ import annotations

from pathlib import Path

import torch

from specserve.backends.base import ModelLoadError
from specserve.backends.torch.model import Decoder

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: bf16 on a GPU that has it (fp16 otherwise); on a CPU bf16 where it has bf16 instructions
    (AVX-512 BF16 or AMX: half the bytes of float32 and, measured on a Zen 4, twice the speed per step),
    float32 elsewhere (emulated bf16 is slower than float32)."""
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda":
        # Not emulated bf16 (a V100 or T4 "supports" it several times slower than fp16).
        native = torch.cuda.is_bf16_supported(including_emulation=False)
        return torch.bfloat16 if native else torch.float16
    return torch.bfloat16 if cpu_has_bf16() else torch.float32


def cpu_has_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def check_model(model: Decoder, dtype: torch.dtype, device: torch.device, positions: int) -> None:
    """A decoder handed in (not loaded here) must match the runtime: a position past its RoPE table would
    index out of range, on a GPU a device-side assert that poisons the CUDA context."""
    weight = model.embed_tokens.weight
    if weight.dtype != dtype or weight.device.type != device.type:
        raise ModelLoadError(
            f"the model is {weight.dtype} on {weight.device}; the runtime runs {dtype} on {device}"
        )
    if model.rope_cos.shape[0] < positions:
        raise ModelLoadError(
            f"the model's RoPE table covers {model.rope_cos.shape[0]} positions, not {positions}"
        )
