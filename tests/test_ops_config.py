"""Operations settings: secrets only from the environment, the example configs, the generated settings table,
and the log formats."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import pytest

from specserve.cli import main
from specserve.config import SettingsError
from specserve.config_docs import BEGIN, END, settings_table
from specserve.config_sources import load_settings, redacted
from specserve.logging import configure_logging, request_id_var

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["laptop", "production"])
def test_example_configs_load(name: str) -> None:
    settings = load_settings(env={}, config_file=ROOT / "configs" / f"{name}.yaml")
    assert settings.log_prompts is False
    if name == "production":
        assert (settings.log_format, settings.host, settings.rate_limit_per_minute) == (
            "json",
            "0.0.0.0",
            120,
        )


def test_secrets_come_from_the_environment_only(tmp_path: Path) -> None:
    config = tmp_path / "s.yaml"
    config.write_text("api_keys: k1\n")
    with pytest.raises(SettingsError, match="SPECSERVE_API_KEYS"):
        load_settings(env={}, config_file=config)
    settings = load_settings(env={"SPECSERVE_API_KEYS": "k1,k2", "SPECSERVE_ADMIN_KEY": "adm"})
    assert settings.api_keys == "k1,k2" and settings.admin_key == "adm"
    assert redacted(settings)["api_keys"] == "***" and redacted(settings)["admin_key"] == "***"
    with pytest.raises(SystemExit):
        main(["serve", "--api-keys", "k1"])  # no such flag


def test_config_show_never_prints_secrets(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPECSERVE_API_KEYS", "very-secret-key")
    monkeypatch.setenv("SPECSERVE_ADMIN_KEY", "very-secret-admin")
    assert main(["config", "show"]) == 0
    out = capfd.readouterr().out
    assert "very-secret" not in out and json.loads(out)["api_keys"] == "***"


def test_operations_doc_has_the_current_settings_table() -> None:
    doc = (ROOT / "docs" / "OPERATIONS.md").read_text()
    start, end = doc.index(BEGIN), doc.index(END) + len(END)
    assert doc[start:end] == settings_table(), "run `specserve config docs` and paste the table"


def test_json_log_lines_carry_the_request_id_and_fields() -> None:
    stream = io.StringIO()
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    configure_logging("info", "json", stream)
    try:
        log = logging.getLogger("specserve.test")
        token = request_id_var.set("rid-1")
        log.info("hello %s", "there", extra={"fields": {"outcome": "success", "n": 3}})
        request_id_var.reset(token)
        log.debug("hidden")
        log.warning("outside")
        lines = [json.loads(line) for line in stream.getvalue().splitlines()]
        assert lines[0]["msg"] == "hello there" and lines[0]["request_id"] == "rid-1"
        assert (lines[0]["outcome"], lines[0]["n"], lines[0]["level"]) == ("success", 3, "info")
        assert len(lines) == 2 and "request_id" not in lines[1]

        configure_logging("info", "text", stream)
        token = request_id_var.set("rid-2")
        log.info("plain", extra={"fields": {"outcome": "aborted"}})
        request_id_var.reset(token)
        assert stream.getvalue().splitlines()[-1].endswith('[rid-2]: plain outcome="aborted"')
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
