"""``specserve serve --replicas N``: the command line's Ray Serve mode, started and stopped like a user."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from support.tiny_models import TinyModels

from .cluster import READY_DEADLINE_S, free_port

GRACE_S = 30
SERVE_CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "ray" / "serve-config.yaml"


def wait_until_ready(process: subprocess.Popen[bytes], url: str, replicas: int, log_path: Path) -> None:
    """Poll ``/ready`` until ``replicas`` are ready; the process's log if it exits or takes too long."""
    deadline = time.monotonic() + READY_DEADLINE_S
    while True:
        assert process.poll() is None, log_path.read_text(errors="replace")
        try:
            if httpx.get(f"{url}/ready", timeout=5).json().get("replicas_ready") == replicas:
                return
        except (httpx.TransportError, ValueError):
            pass
        assert time.monotonic() < deadline, log_path.read_text(errors="replace")
        time.sleep(0.5)


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_serve_replicas_serves_then_drains_on_sigterm_and_exits_0(
    tiny_models: TinyModels, tmp_path: Path
) -> None:
    port = free_port()
    log_path = tmp_path / "serve.log"
    command = [
        sys.executable, "-m", "specserve.cli", "serve", "--replicas", "2", "--threads", "1",
        "--target", str(tiny_models.target), "--draft", "none", "--model-dir", str(tmp_path / "store"),
        "--port", str(port), "--log-format", "text", "--shutdown-grace-seconds", str(GRACE_S),
    ]  # fmt: skip
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(process, url, 2, log_path)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        finished: list[str | None] = []
        ended_at: list[float] = []
        started = threading.Semaphore(0)

        def stream(i: int) -> None:
            chunks = client.completions.create(
                model="tiny-target", prompt=f"drain {i}", max_tokens=2000, temperature=0, stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            reasons: list[str | None] = []
            for chunk in chunks:
                if not reasons:
                    started.release()
                reasons += [c.finish_reason for c in chunk.choices]
            finished.append(reasons[-1])
            ended_at.append(time.monotonic())

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for _ in threads:
            assert started.acquire(timeout=60)
        stopped_at = time.monotonic()
        process.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(timeout=GRACE_S + 30)
        assert finished == ["length"] * 4  # in-flight requests finish
        assert max(ended_at) > stopped_at  # they were in flight when the signal came
        assert process.wait(timeout=GRACE_S + 60) == 0, log_path.read_text(errors="replace")
        assert time.monotonic() - stopped_at < GRACE_S + 60
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_without_the_ray_extra_the_error_names_it(tmp_path: Path) -> None:
    hide_ray = (
        "import sys; sys.modules['ray'] = None; from specserve.cli import main; "
        "sys.exit(main(['serve', '--replicas', '2']))"
    )
    result = subprocess.run(
        [sys.executable, "-c", hide_ray], capture_output=True, text=True, timeout=60,
        env={**os.environ, "SPECSERVE_MODEL_DIR": str(tmp_path)},
    )  # fmt: skip
    assert result.returncode != 0
    expected = "specserve: error: Ray Serve is not installed: pip install 'specserve[ray]'"
    assert result.stderr.strip() == expected


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_the_serve_config_file_runs_under_serve_run(tiny_models: TinyModels, tmp_path: Path) -> None:
    """deploy/ray/serve-config.yaml as shipped, models and port swapped for tiny ones, under Ray's own CLI."""
    config = yaml.safe_load(SERVE_CONFIG.read_text())
    port = free_port()
    config["http_options"] = {"host": "127.0.0.1", "port": port}
    application = config["applications"][0]
    application["args"]["replicas"] = 1
    application["args"]["settings"].update(
        target=str(tiny_models.target), draft="none", model_dir=str(tmp_path / "store"), log_format="text"
    )
    path = tmp_path / "serve-config.yaml"
    path.write_text(yaml.safe_dump(config))
    log_path = tmp_path / "serve-run.log"
    serve_cli = Path(sys.executable).parent / "serve"
    with log_path.open("wb") as log:
        # SIGINT back to its default in the child: a shell's background job (a suite started with `&`)
        # ignores it, the child inherits that, and `serve run` then never sees its KeyboardInterrupt
        process = subprocess.Popen(
            [str(serve_cli), "run", str(path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(process, url, 1, log_path)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        completion = client.completions.with_raw_response.create(
            model="tiny-target", prompt="hello", max_tokens=4, temperature=0
        )
        assert completion.headers["x-specserve-replica"]
        assert completion.parse().choices[0].finish_reason == "length"
        process.send_signal(signal.SIGINT)
        # Ray's shutdown after SIGINT once took over 60 s in a clean-clone CI run (alone it takes seconds)
        process.wait(timeout=GRACE_S + 60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
