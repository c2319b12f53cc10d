"""Shared pytest fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from support.tiny_models import TinyModels, tiny_model_set

if not Path("/dev/nvidia0").exists():
    # The torch runtime's Triton kernels are checked here in Triton's interpreter (numbers, not speed);
    # the variable is read when a kernel module is first imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    """Tiny random qwen2 GGUFs (target, unrelated draft, close draft) sharing one vocabulary.

    Written once per session (tens of milliseconds), so tests run the real llama.cpp backend offline.
    """
    directory: Path = tmp_path_factory.mktemp("tiny-models")
    return tiny_model_set(directory)
