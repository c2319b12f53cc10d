"""deploy/compose.yaml and deploy/prometheus/prometheus.yml: the three services, their health checks and
volumes, secrets in env files only, and Prometheus scraping the specserve service where it listens."""

from __future__ import annotations

import re

from specserve.config import Settings
from specserve.config_sources import load_settings

from .files import (
    DEPLOY,
    DOCKERFILE,
    SECRET_ENV,
    cli_args,
    compose,
    dockerignored,
    duration_seconds,
    image_pinned,
    load_yaml,
    rel,
    runtime_cmd,
    runtime_env,
)


def container_port(mapping: str) -> int:
    return int(str(mapping).split(":")[-1].split("/")[0])


def compose_settings() -> Settings:
    """What the specserve container runs with: image ENV < compose environment, plus the image's CMD."""
    env = {
        **runtime_env(),
        **{k: str(v) for k, v in compose()["services"]["specserve"]["environment"].items()},
    }
    return load_settings(cli_args(runtime_cmd()[1:]), env=env)


def test_compose_structure() -> None:
    c = compose()
    services = c["services"]
    assert set(services) == {"specserve", "prometheus", "grafana"}
    for name, service in services.items():
        assert "healthcheck" in service and service["healthcheck"]["test"][0] in ("CMD", "CMD-SHELL"), name
        assert image_pinned(service["image"]), f"{name}: pin the image tag"
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"{name}: mounts missing {source}"
            else:
                assert source in c["volumes"], f"{name}: undeclared volume {source}"
        for entry in service.get("env_file", []):
            path = entry["path"] if isinstance(entry, dict) else entry
            assert dockerignored(rel(DEPLOY / path)), (
                f"{path} may hold secrets: keep it out of the build context"
            )
    spec = services["specserve"]
    build = spec["build"]
    assert (DEPLOY / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE
    settings = compose_settings()
    assert [container_port(p) for p in spec["ports"]] == [settings.port]
    assert f"models:{settings.model_dir}" in spec["volumes"], "the model cache volume at the model directory"
    assert "/health" in " ".join(spec["healthcheck"]["test"])
    assert duration_seconds(spec["stop_grace_period"]) > settings.shutdown_grace_seconds
    assert services["grafana"]["depends_on"]["prometheus"]["condition"] == "service_healthy"


def test_compose_keeps_secrets_out_of_the_file() -> None:
    for name, service in compose()["services"].items():
        for key in service.get("environment", {}):
            assert key not in SECRET_ENV, f"{name}: {key} inline; put it in an env_file"
            assert not re.search(r"KEY|PASSWORD|TOKEN|SECRET", key), (
                f"{name}: {key} inline; put it in an env_file"
            )


def test_prometheus_scrapes_the_compose_service() -> None:
    config = load_yaml(DEPLOY / "prometheus" / "prometheus.yml")
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    job = jobs["specserve"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    targets = [t for sc in job["static_configs"] for t in sc["targets"]]
    assert targets == [f"specserve:{compose_settings().port}"]
    prometheus = compose()["services"]["prometheus"]
    mounted = {v.split(":")[1] for v in prometheus["volumes"]}
    assert "/etc/prometheus/prometheus.yml" in mounted
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]
