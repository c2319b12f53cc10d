"""Settings: one definition for flags, environment and YAML file; precedence, validation, display."""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from pathlib import Path

import pytest

from specserve.config import SettingGroup, Settings, SettingsError, env_name
from specserve.config_sources import add_arguments, load_settings, redacted


def parse(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(flags))


def write_yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "specserve.yaml"
    path.write_text(text)
    return path


def test_defaults() -> None:
    assert load_settings(parse(), env={}) == Settings()
    assert load_settings(None, env={}) == Settings()


def test_precedence_flags_over_env_over_file_over_defaults(tmp_path: Path) -> None:
    config = write_yaml(tmp_path, "context_size: 1024\nthreads: 3\ndrafter: ngram\nnum-draft-tokens: 8\n")
    env = {"SPECSERVE_CONTEXT_SIZE": "2048", "SPECSERVE_THREADS": "5"}

    from_file = load_settings(parse(), env={}, config_file=config)
    assert (from_file.context_size, from_file.threads, from_file.drafter) == (1024, 3, "ngram")
    assert from_file.num_draft_tokens == 8  # YAML keys may use dashes

    from_env = load_settings(parse(), env=env, config_file=config)
    assert (from_env.context_size, from_env.threads, from_env.drafter) == (2048, 5, "ngram")

    from_flags = load_settings(parse("--ctx-size", "3000"), env=env, config_file=config)
    assert (from_flags.context_size, from_flags.threads, from_flags.drafter) == (3000, 5, "ngram")
    assert from_flags.num_draft_tokens == 8
    assert from_flags.draft_policy == Settings().draft_policy  # untouched by all three: default


def test_unset_flags_do_not_override_lower_sources() -> None:
    args = parse()
    assert all(value is None for value in vars(args).values())
    assert load_settings(args, env={"SPECSERVE_EXACT": "false"}).exact is False


def test_every_setting_has_a_flag_and_an_env_name() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    dests = set(vars(parser.parse_args([])))
    for f in dataclasses.fields(Settings):
        assert (f.name not in dests) if f.metadata["secret"] else (f.name in dests)  # secrets: env only
        assert f.metadata["help"]
        assert env_name(f.name) == "SPECSERVE_" + f.name.upper()


def test_add_arguments_by_group() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser, ("models",), exclude=("calibration_cache",))
    expected = {"target", "draft", "backend", "device", "dtype", "model_dir", "context_size", "threads"}
    expected |= {"gpu_layers", "flash_attention", "exact", "attention", "compile"}
    assert set(vars(parser.parse_args([]))) == expected


def test_every_setting_has_a_group() -> None:
    groups = typing.get_args(SettingGroup)
    assert all(f.metadata["group"] in groups for f in dataclasses.fields(Settings))


@pytest.mark.parametrize(
    ("env", "expected"),
    [("false", False), ("0", False), ("no", False), ("OFF", False), ("true", True), ("1", True), ("on", True),
     (" Yes ", True)],
)  # fmt: skip
def test_bool_from_env(env: str, expected: bool) -> None:
    assert load_settings(env={"SPECSERVE_EXACT": env}).exact is expected


def test_bool_from_flags_and_file(tmp_path: Path) -> None:
    assert load_settings(parse("--no-exact"), env={}).exact is False
    assert load_settings(parse("--exact"), env={"SPECSERVE_EXACT": "0"}).exact is True
    assert load_settings(env={}, config_file=write_yaml(tmp_path, "exact: false\n")).exact is False


def test_invalid_bool_names_the_setting() -> None:
    with pytest.raises(SettingsError, match="exact"):
        load_settings(env={"SPECSERVE_EXACT": "maybe"})


def test_optional_settings_read_none(tmp_path: Path) -> None:
    assert load_settings(env={"SPECSERVE_THREADS": ""}).threads is None
    assert load_settings(env={"SPECSERVE_THREADS": "null"}).threads is None
    assert load_settings(env={}, config_file=write_yaml(tmp_path, "draft: null\n")).draft is None
    settings = load_settings(parse("--draft", "none"), env={})
    assert settings.draft == "none"
    assert settings.draft_path_or_none is None
    assert Settings().draft_path_or_none == Settings().draft


@pytest.mark.parametrize(
    ("env", "setting"),
    [
        ({"SPECSERVE_CONTEXT_SIZE": "abc"}, "context_size"),
        ({"SPECSERVE_CONTEXT_SIZE": "0"}, "context_size"),
        ({"SPECSERVE_THREADS": "-2"}, "threads"),
        ({"SPECSERVE_MAX_RUNNING": "0"}, "max_running"),
        ({"SPECSERVE_PREFILL_CHUNK": "0"}, "prefill_chunk"),
        ({"SPECSERVE_NGRAM_MIN_N": "0"}, "ngram_min_n"),
        ({"SPECSERVE_NUM_DRAFT_TOKENS": "65"}, "num_draft_tokens"),
        ({"SPECSERVE_NUM_DRAFT_TOKENS": "-1"}, "num_draft_tokens"),
        ({"SPECSERVE_DRAFT_P_MIN": "1.5"}, "draft_p_min"),
        ({"SPECSERVE_DRAFT_P_MIN": "high"}, "draft_p_min"),
        ({"SPECSERVE_DRAFTER": "bogus"}, "drafter"),
        ({"SPECSERVE_DRAFT_POLICY": "greedy"}, "draft_policy"),
        ({"SPECSERVE_LOAD_DRAFT": "sometimes"}, "load_draft"),
    ],
)
def test_invalid_values_name_the_setting(env: dict[str, str], setting: str) -> None:
    with pytest.raises(SettingsError, match=setting):
        load_settings(env=env)


def test_invalid_flag_value_names_the_setting() -> None:
    with pytest.raises(SettingsError, match="context_size"):
        load_settings(parse("--ctx-size", "0"), env={})


def test_invalid_value_in_file_names_the_setting(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="drafter"):
        load_settings(env={}, config_file=write_yaml(tmp_path, "drafter: magic\n"))
    with pytest.raises(SettingsError, match="context_size"):
        load_settings(env={}, config_file=write_yaml(tmp_path, "context_size: [1, 2]\n"))


def test_unknown_key_in_file(tmp_path: Path) -> None:
    config = write_yaml(tmp_path, "context_size: 1024\nrope_scaling: true\n")
    with pytest.raises(SettingsError, match="unknown setting 'rope_scaling'") as excinfo:
        load_settings(env={}, config_file=config)
    assert str(config) in str(excinfo.value)


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "key: [unclosed\n"])
def test_malformed_file(tmp_path: Path, text: str) -> None:
    config = write_yaml(tmp_path, text)
    with pytest.raises(SettingsError, match="config file") as excinfo:
        load_settings(env={}, config_file=config)
    assert str(config) in str(excinfo.value)


def test_missing_or_empty_file(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="config file"):
        load_settings(env={}, config_file=tmp_path / "absent.yaml")
    assert load_settings(env={}, config_file=write_yaml(tmp_path, "")) == Settings()


def test_environment_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECSERVE_NUM_DRAFT_TOKENS", "5")
    assert load_settings().num_draft_tokens == 5


def test_redacted_shows_every_setting() -> None:
    settings = load_settings(parse("--ctx-size", "512"), env={})
    shown = redacted(settings)
    assert list(shown) == [f.name for f in dataclasses.fields(Settings)]
    assert shown["context_size"] == 512
    assert json.loads(json.dumps(shown)) == shown


def test_redacted_hides_secrets() -> None:
    @dataclasses.dataclass(frozen=True)
    class WithSecret(Settings):
        api_key: str | None = dataclasses.field(default=None, metadata={"help": "key", "secret": True})

    assert redacted(WithSecret(api_key="s3cret"))["api_key"] == "***"
    assert redacted(WithSecret())["api_key"] is None
    assert redacted(WithSecret(api_key="s3cret"))["target"] == Settings().target


def test_secrets_never_travel_and_come_back_from_the_environment() -> None:
    from specserve.config_sources import with_secrets_from_env, without_secrets

    settings = Settings(api_keys="k1,k2", admin_key="adm", threads=3)
    shipped = without_secrets(settings)
    assert shipped["api_keys"] is None and shipped["admin_key"] is None and shipped["threads"] == 3
    back = with_secrets_from_env(shipped, {"SPECSERVE_API_KEYS": "k9", "SPECSERVE_ADMIN_KEY": "a9"})
    assert (back.api_keys, back.admin_key, back.threads) == ("k9", "a9", 3)
    assert with_secrets_from_env(shipped, {}).api_keys is None


def test_dflash2_settings_take_the_upstream_names_too(tmp_path: Path) -> None:
    """The guide's draft_block_size / candidate_topk, and upstream's block_size / selector_top_k, from
    every source; the setting's own name wins over its alias."""
    assert load_settings(parse("--block-size", "8"), env={}).draft_block_size == 8
    assert load_settings(parse("--selector-top-k", "4"), env={}).candidate_topk == 4
    from_file = load_settings(
        None, env={}, config_file=write_yaml(tmp_path, "block_size: 4\nselector-top-k: 12\n")
    )
    assert (from_file.draft_block_size, from_file.candidate_topk) == (4, 12)
    env = {"SPECSERVE_BLOCK_SIZE": "16", "SPECSERVE_DRAFT_BLOCK_SIZE": "6", "SPECSERVE_SELECTOR_TOP_K": "3"}
    from_env = load_settings(None, env=env)
    assert (from_env.draft_block_size, from_env.candidate_topk) == (6, 3)
    both = load_settings(None, env={}, overrides={"draft_block_size": 8, "block_size": 4})
    assert both.draft_block_size == 8  # in a file too, whatever the order of the keys


@pytest.mark.parametrize("env", [{"SPECSERVE_DRAFT_BLOCK_SIZE": "1"}, {"SPECSERVE_CANDIDATE_TOPK": "0"}])
def test_dflash2_settings_are_checked(env: dict[str, str]) -> None:
    with pytest.raises(SettingsError):
        load_settings(None, env=env)
