"""Typed settings: one definition from which CLI flags, YAML config keys and ``SPECSERVE_*`` variables come.

Precedence: command-line flags > environment variables > config file > defaults. Every field documents
itself (``help``); validation happens once, in ``Settings.validate``, with messages that name the setting.
Secrets (``secret=True``: API and admin keys) come from the environment only: they have no flag, a config
file may not hold them, and ``redacted`` hides them.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from specserve.errors import UserError

DrafterName = Literal["ngram", "draft-model", "dflash2"]
"""The drafters specserve can build (``drafters.registry`` has one factory per name)."""
DrafterChoice = Literal["auto", "none", DrafterName]
"""A drafter setting: one drafter, ``auto`` (the cost policy chooses among the loaded ones) or ``none``."""
PolicyChoice = Literal["cost", "fixed"]
BackendChoice = Literal["auto", "llama.cpp", "torch"]
"""The runtime: llama.cpp (GGUF on the CPU), specserve's own torch runtime, or ``auto``: torch when a CUDA
GPU is visible (or the target is a checkpoint directory), llama.cpp otherwise."""


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
    model_dir: str | None = _model(None, "Model cache directory (default ~/.cache/specserve/models).")
    context_size: int = _model(4096, "Context length per sequence, in tokens.", "--ctx-size")
    threads: int | None = _model(None, "CPU threads for llama.cpp or torch on the CPU (default: all cores).")
    gpu_layers: int = _model(0, "Layers to offload to a GPU (needs a GPU build of llama-cpp-python).")
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
        "Drafter: auto (cost-aware choice among loaded drafters), none, ngram, draft-model, dflash2 (a "
        "DFlash2 block drafter given as --draft DIR; torch backend).",
    )
    num_draft_tokens: int = _speculation(16, "Maximum draft tokens per step.")
    draft_policy: PolicyChoice = _speculation(
        "cost", "Draft length policy: cost (measured cost model, may draft 0) or fixed (always the maximum)."
    )
    ngram_min_n: int = _speculation(2, "Shortest suffix the n-gram drafter looks up.")
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
        ):
            if getattr(self, name) < 0:
                raise SettingsError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("client_timeout", "stream_keepalive"):
            if not getattr(self, name) > 0:
                raise SettingsError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.num_draft_tokens <= 64:
            raise SettingsError(f"num_draft_tokens must be in [0, 64], got {self.num_draft_tokens}")
        if not 0.0 <= self.draft_p_min <= 1.0:
            raise SettingsError(f"draft_p_min must be in [0, 1], got {self.draft_p_min}")
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


@functools.cache
def _secrets() -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(Settings) if f.metadata["secret"])


def _base_type(tp: Any) -> Any:
    """``X`` for ``X | None``, else the type itself."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return next(a for a in typing.get_args(tp) if a is not type(None))
    return tp


def _flag(f: dataclasses.Field[Any]) -> str:
    return str(f.metadata.get("flag") or "--" + f.name.replace("_", "-"))


def env_name(name: str) -> str:
    return "SPECSERVE_" + name.upper()


def add_arguments(
    parser: argparse.ArgumentParser,
    groups: tuple[SettingGroup, ...] | None = None,
    exclude: tuple[str, ...] = (),
) -> None:
    """Add one flag per setting of ``groups`` (default: every group) but ``exclude``; all defaults None, so
    unset flags don't override lower sources."""
    hints = _hints()
    for f in dataclasses.fields(Settings):
        if (groups is not None and f.metadata["group"] not in groups) or f.name in exclude:
            continue
        if f.metadata["secret"]:
            continue  # secrets have no flag: command lines are visible to every user of the machine
        tp = hints[f.name]
        kwargs: dict[str, Any] = {"dest": f.name, "default": None, "help": f.metadata["help"]}
        base = _base_type(tp)
        if base is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(base) is Literal:
            kwargs["choices"] = typing.get_args(base)
        else:
            kwargs["type"] = base
        aliases = ["--" + a.replace("_", "-") for a in f.metadata.get("aliases", ())]
        parser.add_argument(_flag(f), *aliases, **kwargs)


def _convert(name: str, raw: Any, tp: Any) -> Any:
    target = _base_type(tp)
    if raw is None or (
        isinstance(raw, str) and raw.lower() in ("", "null") and type(None) in typing.get_args(tp)
    ):
        return None
    try:
        if target is bool:
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if typing.get_origin(target) is Literal:
            return str(raw)
        return target(raw)
    except (TypeError, ValueError):
        raise SettingsError(f"{name}: cannot read {raw!r} as {getattr(target, '__name__', target)}") from None


def load_settings(
    args: argparse.Namespace | None = None,
    env: Mapping[str, str] | None = None,
    config_file: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Settings:
    """Merge defaults < config file (or ``overrides``, a mapping in its format) < environment < flags,
    then validate."""
    hints = _hints()
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    if config_file is not None:
        values.update(_read_file(Path(config_file)))
    if overrides is not None:
        values.update(settings_mapping(overrides, "settings"))
    for f in dataclasses.fields(Settings):
        for name in (*reversed(f.metadata.get("aliases", ())), f.name):  # the field's own name wins
            if env_name(name) in env:
                values[f.name] = env[env_name(name)]
        if args is not None and getattr(args, f.name, None) is not None:
            values[f.name] = getattr(args, f.name)
    converted = {name: _convert(name, raw, hints[name]) for name, raw in values.items()}
    return Settings(**converted).validate()


def _read_file(path: Path) -> dict[str, Any]:
    import yaml

    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise SettingsError(f"config file {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise SettingsError(f"config file {path}: expected a mapping of settings")
    return settings_mapping(data, f"config file {path}")


def settings_mapping(data: Mapping[str, Any], source: str) -> dict[str, Any]:
    """Settings by field name from a config mapping (keys may use dashes); secrets are refused."""
    known = {f.name for f in dataclasses.fields(Settings)}
    alias_of = {a: f.name for f in dataclasses.fields(Settings) for a in f.metadata.get("aliases", ())}
    flat: dict[str, Any] = {}
    given = {str(key).replace("-", "_") for key in data}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name in alias_of and alias_of[name] in given:
            continue  # the setting's own name wins over its alias, as in the environment
        name = alias_of.get(name, name)
        if name not in known:
            raise SettingsError(f"{source}: unknown setting {key!r}")
        if name in _secrets():
            raise SettingsError(f"{source}: {key!r} is a secret; set {env_name(name)} instead")
        flat[name] = value
    return flat


def redacted(settings: Settings) -> dict[str, Any]:
    """Effective settings for display, secrets replaced."""
    out = {}
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        out[f.name] = "***" if f.metadata.get("secret") and value else value
    return out


def without_secrets(settings: Settings) -> dict[str, Any]:
    """The settings as a plain mapping with every secret unset: what may travel to other processes (Ray
    keeps deployment arguments in its controller's state); each process reads the secrets from its own
    environment with :func:`with_secrets_from_env`."""
    return {
        f.name: None if f.name in _secrets() else getattr(settings, f.name)
        for f in dataclasses.fields(settings)
    }


def with_secrets_from_env(values: Mapping[str, Any], env: Mapping[str, str] | None = None) -> Settings:
    """Settings from :func:`without_secrets`'s mapping, secrets from ``env`` (default: this process's)."""
    env = os.environ if env is None else env
    secrets = {name: env[env_name(name)] for name in _secrets() if env_name(name) in env}
    return Settings(**{**values, **secrets}).validate()
