"""The server through the official ``openai`` client: schema, streaming, sampling, speculation, batching."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from .process import ServerProcess

MODEL = "tiny-target"
PROMPT = "def add(self, other):\n    return self.value + other.value\n"
GREEDY: dict[str, Any] = {"temperature": 0.0, "max_tokens": 24}


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=30)


def speculative(response: Any) -> dict[str, Any]:
    extra = response.model_extra or {}
    stats: dict[str, Any] = extra["speculative"]
    return stats


def test_health_ready_and_models(server: ServerProcess, client: openai.OpenAI) -> None:
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    ready = httpx.get(f"{server.url}/ready").json()
    assert ready["status"] == "ready"
    assert set(ready["drafters"]) == {"ngram", "suffix", "draft-model"}
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_completion_schema_and_stream_equality(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt=PROMPT, **GREEDY)
    assert full.id.startswith("cmpl-") and full.object == "text_completion" and full.model == MODEL
    choice = full.choices[0]
    assert choice.index == 0 and choice.finish_reason == "length" and choice.logprobs is None
    assert full.usage is not None and full.usage.completion_tokens == 24
    assert full.usage.total_tokens == full.usage.prompt_tokens + 24
    assert set(speculative(full)) == {
        "num_drafts", "num_draft_tokens", "num_accepted_tokens", "mean_acceptance_length", "acceptance_rate",
        "drafts_by_drafter", "accepted_by_drafter",
    }  # fmt: skip

    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, stream=True, **GREEDY))
    assert all(c.object == "text_completion" and c.id.startswith("cmpl-") for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert "speculative" in (chunks[-1].model_extra or {})


def test_prompt_forms(client: openai.OpenAI) -> None:
    text = client.completions.create(model=MODEL, prompt=PROMPT, **GREEDY).choices[0].text
    assert client.completions.create(model=MODEL, prompt=[PROMPT], **GREEDY).choices[0].text == text
    ids = client.completions.create(model=MODEL, prompt=[1, 2, 3], **GREEDY)
    assert ids.usage is not None and ids.usage.prompt_tokens == 3


def test_chat_stream_with_usage(client: openai.OpenAI) -> None:
    messages: Any = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Add two numbers."},
        {"role": "assistant", "content": "def add(a, b):"},
        {"role": "user", "content": "Again."},
    ]
    full = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    assert full.id.startswith("chatcmpl-") and full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant" and full.choices[0].finish_reason == "length"

    stream = client.chat.completions.create(
        model=MODEL, messages=messages, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == "length"
    # Not the same counts: the repeat drafts from the first answer (the suffix drafter's cache).
    assert speculative(finish[0]).keys() == speculative(full).keys()
    usage, full_usage = chunks[-1].usage, full.usage
    assert chunks[-1].choices == [] and usage is not None and full_usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (full_usage.prompt_tokens, 24)
    # The same prompt again: its KV (all but the last token, evaluated for its logits) came from the cache.
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1
    assert all(c.usage is None for c in chunks[:-1])


def test_stop_string(client: openai.OpenAI) -> None:
    text = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=40).choices[0].text
    start = next(i for i in range(6, len(text) - 2) if "\ufffd" not in text[i : i + 2])
    stop = text[start : start + 2]
    expected = text[: text.index(stop)]
    for stream in (False, True):
        kwargs: dict[str, Any] = {"temperature": 0, "max_tokens": 40, "stop": [stop, "\x00never"]}
        if stream:
            chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, stream=True, **kwargs))
            got, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            choice = client.completions.create(model=MODEL, prompt=PROMPT, **kwargs).choices[0]
            got, reason = choice.text, choice.finish_reason
        assert (got, reason) == (expected, "stop")


def test_seeded_sampling_is_reproducible(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        # A model-free drafter: auto may pick the draft model once and the suffix drafter the next time
        # (the first answer is then in its cache), and draft-model sampling is coupled differently.
        response = client.completions.create(
            model=MODEL, prompt=PROMPT, temperature=0.8, seed=seed, max_tokens=32,
            extra_body={"speculative": {"drafter": "suffix"}},
        )  # fmt: skip
        return response.choices[0].text

    assert sample(7) == sample(7)


def test_greedy_speculation_on_equals_off(client: openai.OpenAI) -> None:
    def run(spec: dict[str, Any]) -> Any:
        body = {"speculative": spec}
        return client.completions.create(
            model=MODEL, prompt=PROMPT, temperature=0, max_tokens=48, extra_body=body
        )

    plain = run({"enabled": False})
    spec = run({"drafter": "draft-model", "num_draft_tokens": 4})
    assert spec.choices[0].text == plain.choices[0].text
    assert speculative(plain)["num_drafts"] == 0
    assert speculative(spec)["num_drafts"] > 0 and speculative(spec)["num_accepted_tokens"] > 0


def test_parallel_clients_match_alone(server: ServerProcess, client: openai.OpenAI) -> None:
    prompts = [f"{PROMPT}# variant {i}\n" for i in range(4)]

    def complete(prompt: str) -> str:
        response = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=32)
        return response.choices[0].text

    alone = [complete(p) for p in prompts]
    barrier = threading.Barrier(len(prompts))

    def together(prompt: str) -> str:
        barrier.wait()
        return complete(prompt)

    with ThreadPoolExecutor(len(prompts)) as pool:
        assert list(pool.map(together, prompts)) == alone
    server.wait_idle()


def test_unknown_model_and_bad_drafter_raise(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="gpt-9", prompt="x", max_tokens=1)
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as drafter:
        client.completions.create(
            model=MODEL, prompt="x", max_tokens=1, extra_body={"speculative": {"drafter": "x"}}
        )
    assert "draft-model" in str(drafter.value)


def test_prefix_cache_reuse_is_reported_and_isolated_by_salt(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    history: Any = [{"role": "user", "content": PROMPT * 3}]
    first = client.chat.completions.create(model=MODEL, messages=history, **GREEDY)
    history += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And once more, shorter."},
    ]
    second = client.chat.completions.create(model=MODEL, messages=history, **GREEDY)
    salted = client.chat.completions.create(
        model=MODEL, messages=history, extra_body={"cache_salt": "another-tenant"}, **GREEDY
    )
    assert first.usage and second.usage and salted.usage
    assert second.usage.prompt_tokens_details and salted.usage.prompt_tokens_details
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens // 16 * 16 - 16
    assert salted.usage.prompt_tokens_details.cached_tokens == 0
    assert salted.choices[0].message.content == second.choices[0].message.content  # reuse changes nothing
    metrics = httpx.get(f"{server.url}/metrics").text
    hits = next(line for line in metrics.splitlines() if line.startswith("specserve:prefix_cache_hits_total"))
    assert float(hits.split()[-1]) >= second.usage.prompt_tokens_details.cached_tokens
    assert 'specserve:prefix_cache_tokens{tier="slot"}' in metrics
