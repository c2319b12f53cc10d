"""``python -m benchmarks.torch_compile``'s arm on the tiny target: it loads, compiles and times."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from benchmarks.torch_compile import arm
from support.tiny_models import TinyModels


@pytest.mark.parametrize("compile_rows", [False, True], ids=["eager", "compiled"])
def test_an_arm_reports_its_load_and_calls(tiny_models: TinyModels, compile_rows: bool) -> None:
    row = arm(str(tiny_models.target), exact=True, compile_rows=compile_rows, threads=1, repeats=2)
    assert row["ms_1_rows"] > 0 and row["ms_8_rows"] > 0 and row["load_seconds"] >= 0
    assert (row["compile_seconds"] is not None) == compile_rows
