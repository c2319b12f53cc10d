"""Shared pytest fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.tiny_models import TinyModels, tiny_model_set


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    """Tiny random qwen2 GGUFs (target, unrelated draft, close draft) sharing one vocabulary.

    Written once per session (tens of milliseconds), so tests run the real llama.cpp backend offline.
    """
    directory: Path = tmp_path_factory.mktemp("tiny-models")
    return tiny_model_set(directory)
