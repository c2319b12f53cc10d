"""Let ``pytest tests/verify`` import ``specserve`` from the source tree when it is not installed."""

import sys
from importlib.util import find_spec
from pathlib import Path

if find_spec("specserve") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
