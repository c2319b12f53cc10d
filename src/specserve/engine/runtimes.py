"""Which runtime the settings name for a model, opened: llama.cpp for a GGUF file, specserve's own torch
runtime for a checkpoint directory or where a CUDA GPU is visible (``backend: auto``). torch is imported only
where the torch runtime is chosen."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from specserve.backends.base import BackendError, ModelRuntime
from specserve.config import Settings

Runtime = ModelRuntime[Any]
"""A target or draft runtime of either backend (numpy logits from llama.cpp, tensors from torch)."""


def open_runtime(path: str, settings: Settings, max_sequences: int, self_check: bool = True) -> Runtime:
    """The runtime ``settings.backend`` names for the model at ``path``; ``self_check=False`` for a draft
    model (its logits only propose tokens, so its exactness need not be proved)."""
    if resolve_backend(settings, path) == "torch":
        try:
            from specserve.backends.torch.runtime import TorchRuntime
        except ImportError as exc:
            raise BackendError(
                f"the torch backend needs PyTorch ({exc.name} is missing): pip install 'specserve[torch]'"
            ) from exc
        return TorchRuntime(
            path,
            context_per_sequence=settings.context_size,
            max_sequences=max_sequences,
            device=resolve_device(settings),
            dtype=settings.dtype,
            n_threads=settings.threads,
            # A draft model's logits only propose tokens: its fast kernels (and CUDA graphs) lose nothing.
            exact=settings.exact and self_check,
            self_check=self_check,
            graph_tokens=settings.num_draft_tokens + 1,
            attention=settings.attention,
            compile=settings.compile,
        )
    if Path(path).is_dir():
        raise BackendError(f"{path} is a checkpoint directory: llama.cpp needs a GGUF file (--backend torch)")
    from specserve.backends.llama_cpp import LlamaCppRuntime

    capacity = max(512, settings.prefill_chunk + max_sequences * (settings.num_draft_tokens + 1))
    return LlamaCppRuntime(
        path,
        context_per_sequence=settings.context_size,
        max_sequences=max_sequences,
        n_threads=settings.threads,
        exact=settings.exact,
        batch_capacity=capacity,
        n_gpu_layers=settings.gpu_layers,
        self_check=self_check,
        flash_attention=settings.flash_attention,
    )


@functools.cache
def cuda_visible() -> bool:
    """Whether torch is installed and sees a CUDA device (torch is imported only where a GPU exists)."""
    import importlib.util

    if importlib.util.find_spec("torch") is None or not any(Path("/dev").glob("nvidia[0-9]*")):
        return False
    import torch

    return bool(torch.cuda.is_available())


def resolve_backend(settings: Settings, path: str) -> str:
    """``auto``: torch for a checkpoint directory, for ``--device cuda`` or where a CUDA GPU is visible;
    llama.cpp otherwise."""
    if settings.backend != "auto":
        return settings.backend
    wants_torch = Path(path).is_dir() or settings.device == "cuda" or cuda_visible()
    return "torch" if wants_torch else "llama.cpp"


def resolve_device(settings: Settings) -> str:
    return ("cuda" if cuda_visible() else "cpu") if settings.device == "auto" else settings.device
