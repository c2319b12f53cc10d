"""Typed settings: one definition from which CLI flags, YAML config keys and ``SPECSERVE_*`` variables come.

Every field documents itself (``help``); validation happens once, in ``Settings.validate``, with messages
that name the setting. Secrets (``secret=True``: API and admin keys) come from the environment only. How
flags, variables and files are read and merged is ``config_sources``.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from specserve.errors import UserError

DrafterName = Literal["ngram", "suffix", "draft-model", "dflash2"]
"""The drafters specserve can build (``drafters.registry`` has one factory per name)."""
DrafterChoice = Literal["auto", "none", DrafterName]
"""A drafter setting: one drafter, ``auto`` (the cost policy chooses among the loaded ones) or ``none``."""
PolicyChoice = Literal["cost", "fixed"]
SUFFIX_DEPTH = 128
"""The suffix drafter's default depth: the longest match it measures, which also caps its confidence
(a match of L tokens is estimated followed at L / (L + 3.5): 0.90 at 32, 0.97 at 128). Where an extra verify
row costs nearly a step (AMD EPYC Zen 4, 2 cores: 17 rows cost 8.7 one-token steps) no draft estimated at
0.90 a token pays, and at 32 specserve drafted nothing on prompts it had answered before (1.00x where
llama-server's ngram-mod ran 1.63x; docs/BENCHMARKS.md, issue 30's third measurement). ArcticInference's
suffix tree is 64 deep; at 64 the 2-token probe that starts a request's drafting clears the policy's margin
by under 3 % on that curve (a noisy table closes it), at 128 by 5 %."""
NUM_DRAFT_TOKENS = 32
"""Most draft tokens per step, the default. A CPU gains where text is copied (an extra verify row costs
a third of a step to most of one), and a copy pays most when drafted in long pieces: on an Intel Xeon
(model 207, 2 cores) 33 rows cost 5.5 one-token steps and 17 rows 3.2, so a fully accepted 32-token draft
emits 6.0 tokens per step's time where two of 16 emit 5.3. The cost policy still picks each draft's length
from its estimate: the bound only lets a confident copy run longer (docs/BENCHMARKS.md, issue 30's fourth
measurement)."""
SUFFIX_FACTOR = 1.0
SUFFIX_MIN_PROB = 0.1
SUFFIX_CACHE_REQUESTS = 256
SUFFIX_CACHE_TOKENS = 131072
"""The suffix drafter's other defaults, one source for the settings, the drafter context and the drafter."""
BackendChoice = Literal["auto", "llama.cpp", "torch"]
"""The runtime: llama.cpp (GGUF on the CPU), specserve's own torch runtime, or ``auto``: torch when a CUDA
GPU is visible (or the target is a checkpoint directory), llama.cpp otherwise."""
FlashAttentionChoice = Literal["auto", "on", "off"]
"""llama.cpp's flash attention (``backends.llama_cpp.uses_flash_attention`` resolves ``auto``)."""


SettingGroup = Literal["models", "speculation", "batching", "server", "scale-out", "operations"]
"""What a setting is about; a command takes the flags of the groups it uses (``add_arguments``)."""
ENGINE_GROUPS: tuple[SettingGroup, ...] = ("models", "speculation")
"""The settings of a command that builds an engine without serving it (``generate``, ``bench``)."""


def _setting(group: SettingGroup) -> Callable[..., Any]:
    """The field maker of one group's settings: ``(default, help, flag=None, secret=False)``."""

    def setting(
        default: Any, help: str, flag: str | None = None, secret: bool = False, aliases: tuple[str, ...] = ()
    ) -> Any:
        metadata = {"help": help, "flag": flag, "secret": secret, "group": group, "aliases": aliases}
        return field(default=default, metadata=metadata)

    return setting


_model, _speculation, _batching = _setting("models"), _setting("speculation"), _setting("batching")
_server, _scale_out, _operations = _setting("server"), _setting("scale-out"), _setting("operations")


class SettingsError(UserError, ValueError):
    """An invalid setting; the message names it."""


@dataclass(frozen=True)
class Settings:
    # -- models
    target: str = _model(
        "qwen2.5-coder-1.5b-instruct",
        "Target model: a catalog name, a GGUF path, or a Hugging Face checkpoint directory (torch backend).",
    )
    draft: str | None = _model(
        "qwen2.5-coder-0.5b-instruct",
        "Draft model: a catalog name, a GGUF path, a checkpoint directory, or 'none'.",
    )
    backend: BackendChoice = _model(
        "auto",
        "Runtime: llama.cpp, torch (specserve's own; the torch extra), or auto (torch when a CUDA GPU is "
        "visible or the target is a checkpoint directory, else llama.cpp).",
    )
    device: Literal["auto", "cpu", "cuda"] = _model(
        "auto", "Device of the torch runtime: cuda when one is visible (auto), or cpu."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = _model(
        "auto",
        "Weight and KV dtype of the torch runtime: auto = bf16 on a GPU (else fp16) and on a CPU with bf16 "
        "instructions (AVX-512 BF16, AMX), else float32.",
    )
    attention: Literal["auto", "rows", "masked"] = _model(
        "auto",
        "Attention of the torch runtime: rows (a Triton kernel reading the KV cache in place, each row to "
        "its own length; CUDA graphs for every decode and verify step), masked (SDPA over gathered keys "
        "with a mask), or auto (rows on CUDA, masked on a CPU).",
    )
    compile: bool = _model(
        False,
        "Fuse the torch runtime's row-wise work (RMSNorm, the q/k/v and MLP products, SiLU·mul) with "
        "torch.compile, one graph for every layer, compiled at load (its seconds are in /ready's notes); "
        "exact mode compiles its fixed tiles, and the load-time self-check proves them as before.",
    )
    model_dir: str | None = _model(None, "Model cache directory (default ~/.cache/specserve/models).")
    context_size: int = _model(4096, "Context length per sequence, in tokens.", "--ctx-size")
    threads: int | None = _model(None, "CPU threads for llama.cpp or torch on the CPU (default: all cores).")
    gpu_layers: int = _model(0, "Layers to offload to a GPU (needs a GPU build of llama-cpp-python).")
    flash_attention: FlashAttentionChoice = _model(
        "auto",
        "llama.cpp's flash attention: on, off (ggml's product, softmax and product), or auto (on only with "
        "layers on a GPU: on a CPU exact mode can use only its per-row kernel, which costs more than plain "
        "attention from about a thousand cached tokens on; docs/BENCHMARKS.md). Exact either way.",
        "--flash-attn",  # llama-server's name for it, as --ctx-size
    )
    exact: bool = _model(
        True,
        "Exact mode: batch-invariant kernels (patched llama.cpp, proved at load), so greedy speculative "
        "output equals plain greedy output token for token. Without the patch: no flash attention, "
        "no weight repacking and verify calls of at most 7 rows (docs/EXACTNESS.md).",
    )
    calibration_cache: bool = _model(
        True,
        "Reuse a cost calibration (and the kernel settings tuned with it, such as llama.cpp's tiled kernel "
        "start) measured in the last 24 h for the same model file, threads and mode.",
    )
    # -- speculation
    drafter: DrafterChoice = _speculation(
        "auto",
        "Drafter: auto (cost-aware choice among loaded drafters), none, ngram, suffix (the request's context "
        "and its tenant's recent outputs), draft-model, dflash2 (a DFlash2 block drafter given as --draft "
        "DIR; torch backend).",
    )
    num_draft_tokens: int = _speculation(NUM_DRAFT_TOKENS, "Maximum draft tokens per step.")
    draft_policy: PolicyChoice = _speculation(
        "cost", "Draft length policy: cost (measured cost model, may draft 0) or fixed (always the maximum)."
    )
    ngram_min_n: int = _speculation(2, "Shortest suffix the n-gram drafter looks up.")
    suffix_depth: int = _speculation(
        SUFFIX_DEPTH, "Longest context suffix the suffix drafter matches (its tree depth), in tokens."
    )
    suffix_factor: float = _speculation(
        SUFFIX_FACTOR, "The suffix drafter drafts at most this many tokens per token of matched suffix."
    )
    suffix_min_prob: float = _speculation(
        SUFFIX_MIN_PROB,
        "The suffix drafter stops where its estimate that the whole draft is accepted falls below this.",
    )
    suffix_cache_requests: int = _speculation(
        SUFFIX_CACHE_REQUESTS,
        "Finished outputs the suffix drafter remembers (over all tenants; 0 = only the request's own).",
    )
    suffix_cache_tokens: int = _speculation(
        SUFFIX_CACHE_TOKENS, "Tokens of finished outputs the suffix drafter remembers (oldest evicted first)."
    )
    draft_p_min: float = _speculation(
        0.6, "The draft model stops drafting when its top probability is lower."
    )
    draft_block_size: int | None = _speculation(
        None,
        "Block of a DFlash2 drafter: positions of one drafting forward, the anchor included (it drafts up "
        "to this minus 1 tokens); default: the checkpoint's block_size.",
        aliases=("block_size",),
    )
    candidate_topk: int | None = _speculation(
        None,
        "Candidates per block position the DFlash2 selector walks; default: the checkpoint's selector_top_k.",
        aliases=("selector_top_k",),
    )
    load_draft: Literal["auto", "always", "never"] = _speculation(
        "auto",
        "Load the draft model: always (fail without it), never, or auto (only when the cost model says "
        "it could pay, or when --drafter draft-model asks for it).",
    )
    # -- batching
    max_running: int = _batching(4, "Maximum sequences decoded together.", "--max-running")
    prefill_chunk: int = _batching(256, "Prompt tokens evaluated per engine step (chunked prefill).")
    prefix_cache: bool = _batching(
        True,
        "Automatic prefix caching: a request reuses the KV of the longest prompt prefix an earlier request "
        "computed (same cache salt), kept in its slot, copied from another, or loaded from host RAM.",
    )
    prefix_cache_ram: int = _batching(
        1024, "Host-RAM tier of the prefix cache, MiB (KV of slots about to be overwritten; 0 = off)."
    )

    # -- server
    host: str = _server("127.0.0.1", "Address the HTTP server binds to.")
    port: int = _server(8000, "TCP port of the HTTP server.")
    served_model_name: str | None = _server(
        None, "Model id reported by /v1/models and accepted in requests (default: the target's name)."
    )
    engine_process: bool = _server(
        True,
        "Run the engine core in a process of its own, beside the API server's (one message per step between "
        "them; detokenizing and streaming never hold up a step); off: on a thread of the server's process.",
    )
    max_waiting: int = _server(64, "Requests allowed to wait for a free sequence slot; more get 429.")
    request_timeout: float = _server(600.0, "Seconds a request may take before it is aborted (0 = none).")
    max_request_bytes: int = _server(1_000_000, "Largest accepted request body, in bytes.")
    stream_keepalive: float = _server(
        5.0, "Seconds between SSE keep-alive comments while a stream waits for a slot and its first token."
    )
    client_timeout: float = _server(
        10.0,
        "Seconds a client has to send a request's headers, and then its body; a streaming client that reads "
        "nothing for 3 times this is cut off and its request cancelled.",
    )
    max_connections: int = _server(
        256, "Open HTTP connections allowed; more are closed at once (put a proxy in front for more)."
    )
    shutdown_grace_seconds: float = _server(
        30.0, "On SIGTERM, seconds in-flight requests may take to finish before the server exits."
    )
    responses_store_entries: int = _server(
        1024,
        "Responses (POST /v1/responses with store) kept for GET and previous_response_id, over all API "
        "keys; the oldest is evicted first (0 = none kept).",
    )
    responses_store_bytes: int = _server(
        64 * 1024 * 1024,
        "Bytes of stored responses (each with its conversation, as JSON) kept; the oldest is evicted first.",
    )
    # -- scale-out (Ray Serve; needs the extra: pip install 'specserve[ray]')
    replicas: int = _scale_out(
        0,
        "Engine replicas behind one endpoint on Ray Serve (0 = the single-process server). Each replica runs "
        "its own engine with --threads threads (default 1 here) and reserves that many Ray CPUs.",
    )
    ray_address: str | None = _scale_out(
        None, "Ray cluster to join with --replicas (e.g. ray://head:10001 or auto; default: start one here)."
    )
    # -- operations
    log_format: Literal["json", "text"] = _operations("json", "Server log lines: json objects or text.")
    log_level: Literal["debug", "info", "warning", "error"] = _operations(
        "info", "Server log level (info logs one summary line per request)."
    )
    log_prompts: bool = _operations(False, "Log prompt and output text in request lines (off: never logged).")
    step_log: str | None = _operations(
        None,
        "Append one JSON line per engine step to this file: its passes with their priced and measured "
        "seconds, and each sequence's drafter, tokens drafted, kept and expected (counts, never text).",
    )
    api_keys: str | None = _operations(
        None, "Comma-separated API keys for /v1/* (environment only: SPECSERVE_API_KEYS).", secret=True
    )
    api_key_file: str | None = _operations(None, "File of API keys, one per line ('#' starts a comment).")
    admin_key: str | None = _operations(
        None,
        "Key for /admin/* endpoints (environment only: SPECSERVE_ADMIN_KEY; unset = disabled).",
        secret=True,
    )
    rate_limit_per_minute: int = _operations(
        0, "Requests per minute per API key, token bucket (0 = no limit)."
    )
    metrics_require_key: bool = _operations(False, "Require an API key for GET /metrics (default: public).")

    def validate(self) -> Settings:
        def positive(name: str) -> None:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise SettingsError(f"{name} must be >= 1, got {value}")

        for name in (
            "context_size",
            "threads",
            "max_running",
            "prefill_chunk",
            "ngram_min_n",
            "max_waiting",
            "max_request_bytes",
            "max_connections",
            "candidate_topk",
        ):
            positive(name)
        if self.suffix_depth < 2:
            raise SettingsError(f"suffix_depth must be >= 2, got {self.suffix_depth}")
        if self.draft_block_size is not None and not 2 <= self.draft_block_size <= 65:
            raise SettingsError(f"draft_block_size must be in [2, 65], got {self.draft_block_size}")
        if not 0 < self.port < 65536:
            raise SettingsError(f"port must be in 1..65535, got {self.port}")
        for name in (
            "request_timeout",
            "shutdown_grace_seconds",
            "rate_limit_per_minute",
            "prefix_cache_ram",
            "replicas",
            "suffix_cache_requests",
            "suffix_cache_tokens",
            "responses_store_entries",
            "responses_store_bytes",
        ):
            if getattr(self, name) < 0:
                raise SettingsError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("client_timeout", "stream_keepalive"):
            if not getattr(self, name) > 0:
                raise SettingsError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.num_draft_tokens <= 64:
            raise SettingsError(f"num_draft_tokens must be in [0, 64], got {self.num_draft_tokens}")
        for name in ("draft_p_min", "suffix_min_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise SettingsError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if not self.suffix_factor > 0:
            raise SettingsError(f"suffix_factor must be > 0, got {self.suffix_factor}")
        for name, tp in _hints().items():
            choices = typing.get_args(tp) if typing.get_origin(tp) is Literal else ()
            if choices and getattr(self, name) not in choices:
                raise SettingsError(
                    f"{name} must be one of {', '.join(choices)}; got {getattr(self, name)!r}"
                )
        return self

    @property
    def draft_path_or_none(self) -> str | None:
        return None if self.draft in (None, "", "none") else self.draft


@functools.cache
def _hints() -> dict[str, Any]:
    return typing.get_type_hints(Settings)


def _base_type(tp: Any) -> Any:
    """``X`` for ``X | None``, else the type itself."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return next(a for a in typing.get_args(tp) if a is not type(None))
    return tp


def _flag(f: dataclasses.Field[Any]) -> str:
    return str(f.metadata.get("flag") or "--" + f.name.replace("_", "-"))


def env_name(name: str) -> str:
    return "SPECSERVE_" + name.upper()
