"""``scripts/install.sh --system-torch``: a venv on a preinstalled torch that fetches nothing.

The "system" Python of the first test is this checkout's own .venv (torch, and every requirement, already
there): the new venv must run specserve on that torch with nothing installed but specserve itself. The
second builds a system Python that has torch, pip and setuptools and nothing else, and an empty wheel
folder: the script must name the first requirement it cannot satisfy and fail, not reach for an index.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "install.sh"


def install(python: Path | str, venv: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": str(python), "VENV": str(venv), "PIP_NO_INDEX": "1"}
    return subprocess.run(
        [str(SCRIPT), "--system-torch", *args], capture_output=True, text=True, env=env, timeout=300
    )


def purelib(python: Path) -> str:
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    return subprocess.run(
        [str(python), "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()


def test_the_venv_runs_specserve_on_the_system_torch(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    done = install(sys.executable, venv, "--wheels", str(tmp_path))  # an empty folder: nothing to take
    assert done.returncode == 0, done.stderr
    assert "nothing fetched" in done.stderr
    probe = (
        "import json, torch, specserve, fastapi; "
        "print(json.dumps([torch.__file__, specserve.__file__, fastapi.__file__]))"
    )
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", probe], capture_output=True, text=True, check=True
    ).stdout
    system_site = sysconfig.get_paths()["purelib"]
    torch_file, specserve_file, fastapi_file = json.loads(out)
    assert torch_file.startswith(system_site)  # the system's torch, not a copy
    assert fastapi_file.startswith(system_site)
    assert specserve_file.startswith(str(REPO / "src"))  # this tree, editable
    installed = {p.name.split("-")[0] for p in Path(purelib(venv / "bin" / "python")).glob("*.dist-info")}
    assert installed == {"specserve"}, installed  # nothing else went into the venv
    cli = subprocess.run([str(venv / "bin" / "specserve"), "--help"], capture_output=True, text=True)
    assert cli.returncode == 0, cli.stderr


def test_a_missing_requirement_is_named_and_nothing_is_fetched(tmp_path: Path) -> None:
    system = tmp_path / "system"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(system)], check=True, capture_output=True
    )
    site = Path(purelib(system / "bin" / "python"))
    ours = Path(sysconfig.get_paths()["purelib"])
    for pattern in ("pip", "pip-*.dist-info", "setuptools", "setuptools-*.dist-info", "_distutils_hack"):
        for path in ours.glob(pattern):
            (site / path.name).symlink_to(path)
    (site / "torch").mkdir()
    (site / "torch" / "__init__.py").write_text("__version__ = '2.11.0'\n")
    info = site / "torch-2.11.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.11.0\n")
    (info / "RECORD").write_text("")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    done = install(system / "bin" / "python", tmp_path / "venv", "--wheels", str(wheels))
    assert done.returncode == 1, done.stderr
    first_line = done.stderr.splitlines()[0]
    assert first_line.startswith("install.sh --system-torch: missing "), done.stderr
    assert f"no wheel in {wheels}" in first_line
    assert "scripts/system-torch-wheels.sh" in done.stderr


def test_a_python_without_torch_is_refused(tmp_path: Path) -> None:
    system = tmp_path / "system"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(system)], check=True, capture_output=True
    )
    done = install(system / "bin" / "python", tmp_path / "venv")
    assert done.returncode == 2
    assert "has no torch" in done.stderr
    assert not (tmp_path / "venv").exists()
