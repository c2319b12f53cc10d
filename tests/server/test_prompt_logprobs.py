"""Prompt logprobs over HTTP, as lm-eval's loglikelihood requests send them: token-id prompts (batched),
``echo`` with ``logprobs``, ``max_tokens`` 0 or 1, vLLM's ``prompt_logprobs``, and ``/tokenizer_info``.

The numbers come from the prefill pass; they are the same with speculation on and off, on a prefix-cache
hit, alone or in a batch of prompts, streamed or not."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from .process import ServerProcess

TEXT = "def add(self, other):\n    return self.value + other.value\n"


def _complete(server: ServerProcess, **body: Any) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)


def _ids(server: ServerProcess, text: str) -> list[int]:
    tokens: list[int] = httpx.post(f"{server.url}/tokenize", json={"prompt": text}).json()["tokens"]
    return tokens


def _loglikelihood(server: ServerProcess, prompt: Any, **extra: Any) -> dict[str, Any]:
    """lm-eval's payload (models/openai_completions.py): echo, logprobs 1, max_tokens 1, temperature 0."""
    body = {"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0, "seed": 1234}
    response = _complete(server, **body, **extra)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def test_echo_with_logprobs_gives_every_prompt_token_then_the_completion(server: ServerProcess) -> None:
    ids = _ids(server, TEXT)
    choice = _loglikelihood(server, ids)["choices"][0]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(ids) + 1  # the prompt, then the one generated token
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert all(isinstance(v, float) and v <= 0 for v in logprobs["token_logprobs"][1:])
    assert all(len(top) == 1 for top in logprobs["top_logprobs"][1:])
    assert "".join(logprobs["tokens"][: len(ids)]) == TEXT and choice["text"].startswith(TEXT)
    offsets = logprobs["text_offset"]
    assert offsets == sorted(offsets) and offsets[0] == 0 and offsets[len(ids)] == len(TEXT)
    # lm-eval's is_greedy: a token is greedy where its logprob is its position's best
    greedy = [
        lp == max(top.values())
        for lp, top in zip(logprobs["token_logprobs"][1:], logprobs["top_logprobs"][1:], strict=True)
    ]
    assert not all(greedy)  # a random tiny model: the prompt is not its own greedy continuation


def test_the_same_numbers_with_speculation_off_on_a_cache_hit_and_in_a_batch(server: ServerProcess) -> None:
    ids = _ids(server, TEXT * 2)
    other = _ids(server, "x = [i * i for i in range(10)]\n" * 2)
    first = _loglikelihood(server, ids)["choices"][0]["logprobs"]
    assert _loglikelihood(server, ids)["choices"][0]["logprobs"] == first  # the prompt is cached by now
    off = _loglikelihood(server, ids, speculative={"enabled": False})
    assert off["choices"][0]["logprobs"] == first
    batch = _loglikelihood(server, [other, ids, other[:5]])
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2]
    assert batch["choices"][1]["logprobs"] == first
    alone = _loglikelihood(server, other)["choices"][0]["logprobs"]
    assert batch["choices"][0]["logprobs"] == alone
    assert batch["usage"]["prompt_tokens"] == 2 * len(other) + len(ids) - len(other) + 5
    strings = _loglikelihood(server, [TEXT, TEXT])  # a batch of strings
    assert len(strings["choices"]) == 2 and strings["choices"][0]["text"] == strings["choices"][1]["text"]


def test_max_tokens_zero_echoes_the_prompt_only(server: ServerProcess) -> None:
    ids = _ids(server, TEXT)
    body = _complete(server, prompt=ids, echo=True, logprobs=2, max_tokens=0).json()
    choice = body["choices"][0]
    assert choice["text"] == TEXT and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(ids) and body["usage"]["completion_tokens"] == 0
    tops = choice["logprobs"]["top_logprobs"][1:]  # keyed by text: tokens spelled alike share a key
    assert all(1 <= len(top) <= 2 for top in tops) and sum(len(top) == 2 for top in tops) > len(tops) // 2
    with_one = _loglikelihood(server, ids)["choices"][0]["logprobs"]["token_logprobs"][: len(ids)]
    assert choice["logprobs"]["token_logprobs"] == with_one
    plain = _complete(server, prompt=TEXT, max_tokens=0).json()["choices"][0]
    assert plain["text"] == "" and plain["logprobs"] is None


def test_vllm_prompt_logprobs_on_completions_and_chat(server: ServerProcess) -> None:
    ids = _ids(server, TEXT)
    choice = _complete(server, prompt=ids, max_tokens=2, prompt_logprobs=3).json()["choices"][0]
    prompt = choice["prompt_logprobs"]
    assert len(prompt) == len(ids) and prompt[0] is None
    for token, position in zip(ids[1:], prompt[1:], strict=True):
        assert str(token) in position and 3 <= len(position) <= 4  # the prompt token, and the top 3
        ranks = sorted(v["rank"] for v in position.values())
        assert ranks[:3] == [1, 2, 3] and all(isinstance(v["decoded_token"], str) for v in position.values())
    echoed = _loglikelihood(server, ids)["choices"][0]["logprobs"]["token_logprobs"]
    assert [p[str(t)]["logprob"] for t, p in zip(ids[1:], prompt[1:], strict=True)] == echoed[1 : len(ids)]
    chat = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "prompt_logprobs": 0},
    ).json()
    assert chat["prompt_logprobs"][0] is None and all(len(p) == 1 for p in chat["prompt_logprobs"][1:])
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]


def test_streamed_echo_logprobs_equal_the_whole_response(server: ServerProcess) -> None:
    ids = _ids(server, TEXT)
    body = {
        "prompt": ids,
        "echo": True,
        "logprobs": 1,
        "max_tokens": 4,
        "temperature": 0,
        "prompt_logprobs": 1,
    }
    whole = _complete(server, **body).json()["choices"][0]
    chunks = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:])["choices"][0])
    assert chunks[0]["text"] == TEXT and chunks[0]["prompt_logprobs"] == whole["prompt_logprobs"]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    streamed = {k: [v for c in chunks if c["logprobs"] for v in c["logprobs"][k]] for k in keys}
    assert streamed == whole["logprobs"]


def test_the_openai_client_reads_echoed_logprobs(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    ids = _ids(server, TEXT)
    completion = client.completions.create(model=model, prompt=[ids], echo=True, logprobs=0, max_tokens=0)
    assert completion.choices[0].logprobs is not None
    assert completion.choices[0].logprobs.token_logprobs is not None
    assert completion.choices[0].logprobs.token_logprobs[0] is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": [[1, 2]] * 65, "max_tokens": 1}, "prompt"),
        ({"prompt": [[1, 2]] * 20, "n": 4, "max_tokens": 1}, None),
        ({"prompt": [[1, 2], []], "max_tokens": 1}, "prompt"),
        ({"prompt": [[1, 10**9]], "max_tokens": 1, "echo": True, "logprobs": 1}, "prompt"),
        ({"prompt": "x", "prompt_logprobs": 21, "max_tokens": 1}, "prompt_logprobs"),
        ({"prompt": [[5] * 5000], "max_tokens": 0, "echo": True, "logprobs": 1}, "prompt"),
    ],
)
def test_bad_prompt_requests_are_clear_400s(
    server: ServerProcess, body: dict[str, Any], param: str | None
) -> None:
    response = _complete(server, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param
    assert _complete(server, prompt="ok", max_tokens=1).status_code == 200  # and the server goes on


def test_tokenizer_info_serves_lm_evals_remote_tokenizer(server: ServerProcess) -> None:
    info = httpx.get(f"{server.url}/tokenizer_info").json()
    assert info["eos_token"] and info["model_max_length"] > 0 and isinstance(info["add_bos_token"], bool)
    assert "chat_template" in info
