"""One streamed chat completion against any OpenAI-compatible server, timed chunk by chunk.

Timings follow vLLM's benchmark definitions, measured on the client from the SSE stream:

* TTFT: from sending the request to the first chunk with text;
* ITL (inter-token latency): the gaps between consecutive chunks with text — with speculation one chunk
  may carry several tokens, so ITL shows the burstiness that TPOT averages away;
* TPOT (time per output token): ``(latency - ttft) / (output_tokens - 1)``, latency = end of the stream;
* per-request tokens/s: ``(output_tokens - 1) / (latency - ttft)``, the decode phase (as ``specserve
  generate`` reports it).

``output_tokens`` comes from the usage chunk (``stream_options.include_usage``, which vLLM, llama-server
and specserve send); a server without it is counted one token per text chunk.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from specserve.tools.loadgen.server_metrics import SpecCounters, parse_spec_counters
from specserve.tools.workloads import ToolInputError


@dataclass(frozen=True)
class ServerOptions:
    """How to reach one server: its base URL (``http://host:port``, no ``/v1``), credentials, model."""

    base_url: str
    api_key: str | None = None
    model: str | None = None
    """Model to request; None: the first of its ``GET /v1/models``."""
    timeout: float = 600.0
    """Seconds per request."""


@dataclass(frozen=True)
class Target:
    """A server and how requests to it are marked: one benchmark mode."""

    mode: str
    """``on`` / ``off`` (specserve with the request extension), ``default``, or a peer server's name."""
    base_url: str
    model: str
    extension: dict[str, Any] | None = None
    """The ``speculative`` request object, or None to send a plain OpenAI request."""
    tenant: str | None = None
    """``cache_salt`` of every request (specserve, vLLM): two modes of one server as two tenants, so that
    neither mode's prefix-cache hits nor its suffix drafts come from the other's answers to a prompt."""


@dataclass(frozen=True)
class RequestParams:
    max_tokens: int = 128
    temperature: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False
    top_k: int | None = None


@dataclass
class RequestResult:
    mode: str
    start: float
    """perf_counter() when the request was sent."""
    ttft: float | None = None
    latency: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    """Arrival of each chunk with text, seconds after ``start``."""
    output_tokens: int = 0
    text: str = ""
    finish_reason: str | None = None
    speculative: dict[str, Any] | None = None
    error: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    """``usage.prompt_tokens_details.cached_tokens``, where the server reports it."""
    timings: dict[str, Any] | None = None
    """llama-server's ``timings`` object (its drafted and accepted token counts among them)."""

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    @property
    def tokens_per_second(self) -> float | None:
        tpot = self.tpot
        return 1.0 / tpot if tpot else None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]


def normalize_base_url(url: str) -> str:
    """``http://host:port[/v1][/]`` → ``http://host:port``; anything not http(s) is a ToolInputError."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ToolInputError(f"--url must start with http:// or https://, got {url!r}")
    return url[:-3].rstrip("/") if url.endswith("/v1") else url


class BenchClient:
    """An httpx.AsyncClient with the benchmark's request shapes."""

    def __init__(self, api_key: str | None = None, timeout: float = 600.0, max_connections: int = 64) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self.http = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(timeout), limits=limits)

    async def aclose(self) -> None:
        await self.http.aclose()

    async def served_model(self, base_url: str) -> str:
        """The first model of ``GET /v1/models``; an unreachable or non-OpenAI server is a ToolInputError."""
        try:
            response = await self.http.get(f"{base_url}/v1/models", timeout=10.0)
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            raise ToolInputError(f"cannot reach {base_url}: {exc or type(exc).__name__}") from None
        if response.status_code in (401, 403):
            raise ToolInputError(
                f"{base_url} refused the request ({response.status_code}); "
                "give --api-key or set OPENAI_API_KEY"
            )
        try:
            models = response.json()["data"]
            return str(models[0]["id"])
        except (ValueError, KeyError, IndexError, TypeError):
            raise ToolInputError(
                f"{base_url}/v1/models answered {response.status_code} without a model list; "
                "is this an OpenAI-compatible server?"
            ) from None

    async def spec_counters(self, base_url: str) -> SpecCounters | None:
        """The server's speculative decoding counters from ``GET /metrics``; None if it exports none."""
        try:
            response = await self.http.get(f"{base_url}/metrics", timeout=10.0)
        except httpx.HTTPError:
            return None
        return parse_spec_counters(response.text) if response.status_code == 200 else None

    async def tokenize(self, base_url: str, model: str, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens) from the server's vLLM-style ``POST /tokenize``."""
        body = {"model": model, "prompt": text, "add_special_tokens": False}
        response = await self.http.post(f"{base_url}/tokenize", json=body)
        if response.status_code != 200:
            raise ToolInputError(f"{base_url}/tokenize answered {response.status_code}")
        return [int(t) for t in response.json()["tokens"]]

    async def reports_speculative(self, base_url: str, model: str) -> bool:
        """Whether the server takes the ``speculative`` extension and reports it (i.e. it is specserve)."""
        probe = Target("probe", base_url, model, {"enabled": False})
        result = await self.chat(probe, "Say hi.", RequestParams(max_tokens=1))
        if result.error is not None:
            plain = await self.chat(Target("probe", base_url, model), "Say hi.", RequestParams(max_tokens=1))
            if plain.error is not None:
                raise ToolInputError(f"{base_url} fails a one-token chat completion: {plain.error}")
            return False
        return result.speculative is not None

    async def chat(
        self,
        target: Target,
        prompt: str | list[dict[str, str]],
        params: RequestParams,
        extra: dict[str, Any] | None = None,
    ) -> RequestResult:
        """Stream one chat completion (a user prompt, or whole messages); failures are recorded in the
        result, never raised. ``extra`` adds body fields (e.g. ``cache_salt``)."""
        body = chat_body(target, prompt, params, extra)
        result = RequestResult(target.mode, time.perf_counter())
        try:
            await self._stream(f"{target.base_url}/v1/chat/completions", body, result)
        except httpx.HTTPError as exc:
            result.error = f"{type(exc).__name__}: {exc}"
        except ValueError as exc:  # a stream event that is not JSON
            result.error = f"malformed stream event ({exc})"
        result.latency = time.perf_counter() - result.start
        if result.error is None and result.ttft is None and result.output_tokens > 0:
            result.error = "the stream carried no text"
        return result

    async def _stream(self, url: str, body: dict[str, Any], result: RequestResult) -> None:
        usage_tokens: int | None = None
        chunks = 0
        async with self.http.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                raw = await response.aread()
                result.error = f"HTTP {response.status_code}: {_error_message(raw)}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                event = json.loads(payload)
                if "error" in event:
                    result.error = _error_message(payload.encode())
                    break
                for choice in event.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                    if text:
                        now = time.perf_counter() - result.start
                        result.ttft = now if result.ttft is None else result.ttft
                        result.chunk_times.append(now)
                        result.text += text
                        chunks += 1
                    result.finish_reason = choice.get("finish_reason") or result.finish_reason
                if isinstance(event.get("speculative"), dict):
                    result.speculative = event["speculative"]
                if isinstance(event.get("timings"), dict):
                    result.timings = event["timings"]
                usage = event.get("usage")
                if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                    usage_tokens = usage["completion_tokens"]
                    result.prompt_tokens = usage.get("prompt_tokens")
                    details = usage.get("prompt_tokens_details")
                    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                        result.cached_tokens = details["cached_tokens"]
        result.output_tokens = usage_tokens if usage_tokens is not None else chunks


def _error_message(raw: bytes) -> str:
    try:
        error = json.loads(raw)["error"]
        return str(error.get("message", error)) if isinstance(error, dict) else str(error)
    except (ValueError, KeyError, TypeError):
        return raw.decode(errors="replace")[:200]


def chat_body(
    target: Target,
    prompt: str | list[dict[str, str]],
    params: RequestParams,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The streamed chat request ``Client.chat`` sends (``extra``'s fields override the target's tenant)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    body: dict[str, Any] = {
        **({"cache_salt": target.tenant} if target.tenant else {}),
        **(extra or {}),
        "model": target.model,
        "messages": messages,
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if params.seed is not None:
        body["seed"] = params.seed
    if params.top_k is not None:
        body["top_k"] = params.top_k
    if params.ignore_eos:
        body["ignore_eos"] = True
    if target.extension is not None:
        body["speculative"] = target.extension
    return body
