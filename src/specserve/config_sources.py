"""Where settings come from: command-line flags, ``SPECSERVE_*`` variables and a YAML config file, merged
over the defaults of :class:`~specserve.config.Settings` and validated once.

Precedence: command-line flags > environment variables > config file > defaults. Secrets (API and admin
keys) come from the environment only: they have no flag, a config file may not hold them, and ``redacted``
hides them.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from specserve.config import SettingGroup, Settings, SettingsError, _base_type, _flag, _hints, env_name


@functools.cache
def _secrets() -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(Settings) if f.metadata["secret"])


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
