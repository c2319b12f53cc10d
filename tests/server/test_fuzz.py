"""Schema fuzzing with Schemathesis against the server's own OpenAPI document (issue 10, part 1).

Every generated request — valid and invalid by the schema, with a valid key, with none, on every operation
including the admin switch and the Responses API (``/v1/responses``, ``GET``/``DELETE`` of a stored one) —
must get a documented status code with a conforming body: never a 500, never a dropped connection, never a
stack trace. The short profile runs by default; the long one (``slow``) is what docs/RELIABILITY.md reports.
The server runs the tiny pair with a short context, so generation is cheap.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from support.tiny_models import TinyModels

from .process import ServerProcess, start_server, stop_server

KEY = "fuzz-key"
ADMIN_KEY = "fuzz-admin"
REQUEST_TIMEOUT = 20
"""The server's limit per request, in seconds."""


@pytest.fixture(scope="module")
def fuzz_server(tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    env = {"SPECSERVE_API_KEYS": KEY, "SPECSERVE_ADMIN_KEY": ADMIN_KEY}
    # Generated requests without max_tokens run to the context's end, some with a dozen prompts: a 128-token
    # context and four running sequences: the key's short profile took 55 s, with 256 and 2 118 s (Zen 3).
    proc = start_server(
        tiny_models, tmp_path_factory.mktemp("fuzz"), "--max-running", "4", "--max-waiting", "64",
        "--ctx-size", "128", "--request-timeout", str(REQUEST_TIMEOUT), env=env,
    )  # fmt: skip
    yield proc
    assert stop_server(proc) == 0, proc.log()
    log = proc.log()
    assert "Traceback" not in log and "unhandled error" not in log


def schemathesis(server: ServerProcess, out: Path, examples: int, key: str | None, *extra: str) -> None:
    binary = Path(sys.executable).with_name("schemathesis")
    command = [
        str(binary), "run", f"{server.url}/openapi.json", "--checks", "all",
        # A schema-valid request may still be a 400: the prompt and max_tokens must fit the model's context
        # and token ids its vocabulary, which a schema cannot say. Every other check runs.
        "--exclude-checks", "positive_data_acceptance",
        "--max-examples", str(examples), "--workers", "1", "--seed", "1",
        # The server's promise is an answer within its own --request-timeout (a documented 504 past it), so
        # the client waits, and the response-time check allows, that long and a margin: schemathesis's 10 s
        # default failed a valid 10.2 s request (63 prompts generated to the context's end, AMD Zen 3).
        "--request-timeout", str(REQUEST_TIMEOUT + 10), "--max-response-time", str(REQUEST_TIMEOUT + 10),
        "--report", "junit", "--report-dir", str(out), *extra,
    ]  # fmt: skip
    if key is not None:
        command += ["--header", f"Authorization: Bearer {key}"]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=900, env={**os.environ, "NO_COLOR": "1"}
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]


def test_the_fuzzed_document_has_every_generation_endpoint(fuzz_server: ServerProcess) -> None:
    """The run fuzzes what the document lists: the Responses API with its request body too."""
    doc = httpx.get(f"{fuzz_server.url}/openapi.json", timeout=10).json()
    responses = doc["paths"]["/v1/responses"]["post"]
    schema = responses["requestBody"]["content"]["application/json"]["schema"]
    assert schema == {"$ref": "#/components/schemas/ResponsesRequest"}
    assert set(responses["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert set(doc["paths"]["/v1/responses/{response_id}"]) == {"get", "delete"}
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert "requestBody" in doc["paths"][path]["post"]


@pytest.mark.parametrize("key", [KEY, None, ADMIN_KEY], ids=["api-key", "no-key", "admin-key"])
def test_schema_fuzz_short(fuzz_server: ServerProcess, tmp_path: Path, key: str | None) -> None:
    schemathesis(fuzz_server, tmp_path, 12, key)


@pytest.mark.slow
@pytest.mark.parametrize("key", [KEY, None, ADMIN_KEY], ids=["api-key", "no-key", "admin-key"])
def test_schema_fuzz_long(fuzz_server: ServerProcess, tmp_path: Path, key: str | None) -> None:
    schemathesis(fuzz_server, tmp_path, 300, key)
