"""The real image: built from deploy/Dockerfile by scripts/build-image.sh, served by scripts/serve-image.sh,
and asked one chat through the official ``openai`` client.

Marked ``container`` and excluded by default: the first build compiles llama.cpp (10-20 minutes on 2 cores),
it needs root (container storage, apt-get for the tools) and the default model pair in the host's model
directory. Run it with ``pytest -m container tests/deploy/test_image.py``; a rerun reuses the cached base and
build layers. ``SERVE_IMAGE_ROUTE=chroot`` serves through chroot instead of ``podman run``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from .files import ROOT

pytestmark = [pytest.mark.container, pytest.mark.timeout(3600)]

TAG = os.environ.get("SERVE_IMAGE_TAG", "localhost/specserve:0.1.0")
TOOLS = ("buildah", "podman", "debootstrap", "runc", "iptables", "curl")
MODEL_DIR = Path(os.environ.get("SPECSERVE_MODEL_DIR", "~/.cache/specserve/models")).expanduser()


def _skip_reason() -> str | None:
    """Why this machine cannot build or serve the image, or None. The scripts install missing tools with
    apt-get, which needs root; the storage, mounts and chroot need root too."""
    if os.geteuid() != 0:
        return f"the image build and chroot/podman storage need root (euid is {os.geteuid()})"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing and shutil.which("apt-get") is None:
        return f"missing {', '.join(missing)} and no apt-get to install them"
    if not any(MODEL_DIR.glob("*.gguf")):
        return f"no GGUF models in {MODEL_DIR} to mount at /models: run `specserve models pull` first"
    return None


def _run(*args: str) -> str:
    """Run a repository script; on failure, fail with its stderr (the failing call and its error)."""
    done = subprocess.run(
        [str(ROOT / "scripts" / args[0]), *args[1:]], cwd=ROOT, capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.fail(f"{' '.join(args)} exited {done.returncode}:\n{done.stderr[-4000:]}{done.stdout[-2000:]}")
    return done.stdout


@pytest.fixture(scope="module")
def image() -> str:
    reason = _skip_reason()
    if reason is not None:
        pytest.skip(reason)
    _run("build-image.sh", TAG)
    return TAG


@pytest.fixture(scope="module")
def base_url(image: str) -> Iterator[str]:
    try:
        url = _run("serve-image.sh", "start", image).strip().splitlines()[-1]
        yield url
    finally:
        _run("serve-image.sh", "stop")


def test_image_config(image: str) -> None:
    """What the Dockerfile declares made it into the built image (HEALTHCHECK needs the docker format)."""
    fmt = "{{.Config.User}}|{{json .Config.Cmd}}|{{.Config.WorkingDir}}|{{json .Config.Healthcheck}}"
    out = subprocess.run(
        ["podman", "image", "inspect", "--format", fmt, image], capture_output=True, text=True, check=True
    ).stdout.strip()
    user, cmd, workdir, healthcheck = out.split("|", 3)
    assert user == "10001:10001"
    assert cmd == '["specserve","serve","--host","0.0.0.0"]'
    assert workdir == "/home/specserve"
    assert "/health" in healthcheck
    env = subprocess.run(
        ["podman", "image", "inspect", "--format", "{{range .Config.Env}}{{println .}}{{end}}", image],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert "SPECSERVE_MODEL_DIR=/models" in env
    assert any(e.startswith("PATH=/opt/venv/bin:") for e in env)


def test_one_chat(base_url: str) -> None:
    client = openai.OpenAI(base_url=base_url, api_key="unused", timeout=600, max_retries=0)
    (model,) = [m.id for m in client.models.list().data]
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Write a Python function that returns the square of x."}],
        max_tokens=48,
        temperature=0,
    )
    (choice,) = reply.choices
    assert choice.message.content is not None and choice.message.content.strip()
    # the image's llama.cpp is the patched one: exact mode passed its load-time self-check in the image
    ready = httpx.get(base_url.removesuffix("/v1") + "/ready", timeout=30).json()
    assert ready["exactness"]["mode"] == "batch-invariant", ready["exactness"]
    assert choice.finish_reason in ("stop", "length")
    assert reply.usage is not None and reply.usage.completion_tokens > 0
    if os.environ.get("SERVE_IMAGE_ROUTE", "podman") == "podman":
        # the server runs as the image's non-root user, not as root
        uid = subprocess.run(
            ["podman", "exec", "specserve-image", "id", "-u"], capture_output=True, text=True, check=True
        ).stdout.strip()
        assert uid == "10001"
        # the image's HEALTHCHECK (GET /health with urllib) passes; podman has no systemd timer for it here
        subprocess.run(["podman", "healthcheck", "run", "specserve-image"], check=True, capture_output=True)
