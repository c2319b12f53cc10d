"""``specserve serve --backend torch`` through the official ``openai`` client: the same API, the same
greedy answers with speculation on and off, streaming equal to non-streaming, parallel equal to alone."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from support.tiny_models import TinyModels

from .process import ServerProcess, start_server, stop_server

pytest.importorskip("torch")

MODEL = "tiny-target"
PROMPT = "def add(self, other):\n    return self.value + other.value\n"


@pytest.fixture(scope="module")
def torch_server(
    tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    proc = start_server(
        tiny_models, tmp_path_factory.mktemp("torch-server"),
        "--backend", "torch", "--device", "cpu", "--max-running", "3",
    )  # fmt: skip
    yield proc
    assert stop_server(proc) == 0, proc.log()
    assert "Traceback" not in proc.log()


@pytest.fixture(scope="module")
def client(torch_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{torch_server.url}/v1", api_key="x", max_retries=0, timeout=60)


def complete(client: openai.OpenAI, prompt: str = PROMPT, **extra: Any) -> Any:
    return client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=32, **extra)


def test_ready_with_both_drafters(torch_server: ServerProcess) -> None:
    ready = httpx.get(f"{torch_server.url}/ready").json()
    assert ready["status"] == "ready"
    assert set(ready["drafters"]) == {"ngram", "suffix", "draft-model"}
    assert ready["runtime"]["logits"] == "torch:cpu" and "torch" in ready["runtime"]["description"]
    assert ready["exactness"]["mode"] == "batch-invariant"


def test_greedy_speculation_on_equals_off(client: openai.OpenAI) -> None:
    plain = complete(client, extra_body={"speculative": {"enabled": False}})
    for drafter in ("draft-model", "ngram"):
        spec = complete(client, extra_body={"speculative": {"drafter": drafter, "num_draft_tokens": 4}})
        assert spec.choices[0].text == plain.choices[0].text
    stats = (spec.model_extra or {})["speculative"]
    assert stats["num_drafts"] > 0


def test_stream_equals_full_and_chat_works(client: openai.OpenAI) -> None:
    full = complete(client).choices[0].text
    streamed = "".join(c.choices[0].text for c in complete(client, stream=True))
    assert streamed == full
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], temperature=0, max_tokens=16
    )
    assert chat.choices[0].message.role == "assistant" and chat.usage is not None
    assert chat.usage.completion_tokens > 0


def test_parallel_clients_match_alone(torch_server: ServerProcess, client: openai.OpenAI) -> None:
    prompts = [f"{PROMPT}# variant {i}\n" for i in range(3)]
    alone = [complete(client, p).choices[0].text for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda p: complete(client, p).choices[0].text, prompts))
    assert together == alone
    torch_server.wait_idle()


def test_serve_a_checkpoint_directory(
    tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """``serve --target DIR``: a Hugging Face checkpoint picks the torch runtime, its tokenizer and its chat
    template (tokenizer_config.json), and the chat endpoint answers with them."""
    from support.tiny_hf import write_tiny_hf_checkpoint

    directory = tmp_path_factory.mktemp("hf-server")
    checkpoint = write_tiny_hf_checkpoint(directory / "tiny-qwen3", "qwen3")
    proc = start_server(
        tiny_models, directory, "--target", str(checkpoint), "--draft", "none", "--drafter", "ngram"
    )
    try:
        ready = httpx.get(f"{proc.url}/ready").json()
        assert ready["model"] == "tiny-qwen3" and ready["runtime"]["logits"] == "torch:cpu"
        client = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="x", max_retries=0, timeout=60)
        chat = client.chat.completions.create(
            model="tiny-qwen3", messages=[{"role": "user", "content": "hello"}], temperature=0, max_tokens=12
        )
        assert chat.usage is not None and chat.usage.prompt_tokens > 3 and chat.usage.completion_tokens == 12
        assert chat.choices[0].message.content
    finally:
        assert stop_server(proc) == 0, proc.log()
    assert "Traceback" not in proc.log()
