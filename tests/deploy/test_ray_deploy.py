"""The Ray Serve and KubeRay deployment files, checked without a cluster, Docker or the network.

deploy/ray/serve-config.yaml validates against Ray Serve's own schema and builds, through the same calls
``serve run`` makes, into the application it describes (its commented autoscaling examples too, uncommented);
deploy/k8s/ray/rayservice.yaml embeds the same Serve config, and its Ray cluster fits it: a head without CPUs
for Ray, workers whose CPUs hold the engine replicas, the models at the settings' model_dir on every pod,
secrets from the example Secret, pod specs that pass Kubernetes' schema; the Dockerfile can add the ray extra.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from specserve.config import Settings, env_name
from specserve.config_sources import load_settings, settings_mapping

from .files import cli_args

pytest.importorskip("ray.serve", reason="the ray extra is not installed (pip install 'specserve[ray]')")

ROOT = Path(__file__).resolve().parents[2]
SERVE_CONFIG = ROOT / "deploy" / "ray" / "serve-config.yaml"
RAYSERVICE = ROOT / "deploy" / "k8s" / "ray" / "rayservice.yaml"
DEPLOYMENT = ROOT / "deploy" / "k8s" / "deployment.yaml"
SECRET = ROOT / "deploy" / "k8s" / "secret.example.yaml"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
K8S_SCHEMA_VERSION = "1.30"  # as in test_deploy_files.py
SETTINGS_ENV = {env_name(f.name): f for f in dataclasses.fields(Settings)}
SECRET_ENV = {name for name, f in SETTINGS_ENV.items() if f.metadata.get("secret")}
ENGINE = "SpecserveEngine"
FRONT = "SpecserveFront"
APP_IMPORT_PATH = "specserve.rayserve.app:app_builder"


@pytest.fixture(autouse=True)
def no_specserve_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """app_builder reads SPECSERVE_* variables (they beat the config): keep this shell's out."""
    for name in [n for n in os.environ if n.startswith("SPECSERVE_")]:
        monkeypatch.delenv(name)


# -- helpers ----------------------------------------------------------------------------------------------


@cache
def load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def serve_config() -> dict[str, Any]:
    data: dict[str, Any] = load(SERVE_CONFIG)
    return data


def the_app(config: dict[str, Any]) -> dict[str, Any]:
    apps = config["applications"]
    assert len(apps) == 1, "one application"
    app: dict[str, Any] = apps[0]
    return app


def config_settings(config: dict[str, Any] | None = None) -> Settings:
    """What app_builder makes of the config's settings (no SPECSERVE_* variables set)."""
    return load_settings(overrides=the_app(config or serve_config())["args"]["settings"], env={})


def uncomment(text: str, key: str) -> str:
    """The config text with the commented block that starts ``# <key>:`` uncommented (same indentation)."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if re.fullmatch(rf"\s*# {re.escape(key)}:\s*", line)]
    assert len(starts) == 1, f"expected one commented `{key}:` example, found {len(starts)}"
    start = starts[0]
    indent = lines[start][: len(lines[start]) - len(lines[start].lstrip())]
    end = start + 1
    while end < len(lines) and lines[end].startswith(indent + "#   "):
        end += 1
    assert end > start + 1, f"the `{key}:` example is empty"
    for i in range(start, end):
        lines[i] = indent + lines[i][len(indent) + 2 :]
    return "\n".join(lines) + "\n"


def build(config: dict[str, Any]) -> Any:
    """Validate like ``serve run CONFIG`` does, then import and call the builder and build the application."""
    from ray._common.utils import import_attr
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve._private.build_app import build_app
    from ray.serve.deployment import Application
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(config)
    app_schema = schema.applications[0]
    app = call_user_app_builder_with_args_if_necessary(import_attr(app_schema.import_path), app_schema.args)
    assert isinstance(app, Application)
    return build_app(app, name=app_schema.name)


def deployments(built: Any) -> dict[str, Any]:
    return {d.name: d for d in built.deployments}


def with_overrides(built: Any, config: dict[str, Any]) -> dict[str, Any]:
    """Deployment infos once Serve applied the config's ``deployments:`` overrides (the controller's code)."""
    from ray.serve._private.application_state import override_deployment_info
    from ray.serve._private.deploy_utils import deploy_args_to_deployment_info
    from ray.serve.schema import ServeApplicationSchema

    infos = {
        d.name: deploy_args_to_deployment_info(
            deployment_name=d.name,
            deployment_config_proto_bytes=d._deployment_config.to_proto_bytes(),
            replica_config_proto_bytes=d._replica_config.to_proto_bytes(),
            deployer_job_id="",
            app_name=built.name,
        )
        for d in built.deployments
    }
    return override_deployment_info(infos, ServeApplicationSchema.model_validate(the_app(config)))


def rayservice() -> dict[str, Any]:
    data: dict[str, Any] = load(RAYSERVICE)
    return data


def cluster() -> dict[str, Any]:
    spec: dict[str, Any] = rayservice()["spec"]["rayClusterConfig"]
    return spec


def worker_group() -> dict[str, Any]:
    groups = cluster()["workerGroupSpecs"]
    assert len(groups) == 1, "one worker group"
    group: dict[str, Any] = groups[0]
    return group


def pods() -> dict[str, dict[str, Any]]:
    """Pod spec per node type."""
    return {
        "head": cluster()["headGroupSpec"]["template"]["spec"],
        "worker": worker_group()["template"]["spec"],
    }


def ray_container(pod: dict[str, Any]) -> dict[str, Any]:
    """KubeRay runs Ray in the first container."""
    container: dict[str, Any] = pod["containers"][0]
    return container


def all_containers() -> Iterator[tuple[str, dict[str, Any]]]:
    for node, pod in pods().items():
        for c in [*pod.get("initContainers", []), *pod["containers"]]:
            yield f"{node}/{c['name']}", c


def quantity(value: str | int | float) -> float:
    """A Kubernetes CPU or memory quantity as a number (cores, bytes)."""
    text = str(value)
    suffixes = {"m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9}
    for suffix, factor in sorted(suffixes.items(), key=lambda kv: -len(kv[0])):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * factor
    return float(text)


def literal_env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: str(e["value"]) for e in container.get("env", []) if "value" in e}


def lint(text: str) -> list[str]:
    pytest.importorskip("yamllint")
    from yamllint import linter  # type: ignore[import-untyped]
    from yamllint.config import YamlLintConfig  # type: ignore[import-untyped]

    config = YamlLintConfig("extends: relaxed\nrules:\n  line-length: {max: 110}\n")
    return [f"{e.line}: {e.level} {e.message}" for e in linter.run(text, config)]


# -- the Serve config -------------------------------------------------------------------------------------


def test_serve_config_validates_against_serve_schema() -> None:
    from ray.serve.config import ProxyLocation
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(serve_config())
    assert schema.proxy_location == ProxyLocation.EveryNode
    assert (schema.http_options.host, schema.http_options.port) == ("0.0.0.0", 8000)
    [app] = schema.applications
    assert (app.name, app.route_prefix, app.import_path) == ("specserve", "/", APP_IMPORT_PATH)
    assert not lint(SERVE_CONFIG.read_text())


def test_serve_config_settings() -> None:
    args = the_app(serve_config())["args"]
    assert set(args) <= {"settings", "replicas", "autoscaling_config", "imbalanced_threshold"}, set(args)
    settings_mapping(args["settings"], "serve-config.yaml")  # known names, no secrets
    settings = config_settings()
    assert settings.threads == args["settings"]["threads"], "threads explicit: it is the Ray CPUs per replica"
    assert settings.model_dir == "/models", "the image's model volume"
    assert settings.replicas == 0, "replicas is an app_builder argument, not a setting here"


def test_serve_config_builds_the_application(monkeypatch: pytest.MonkeyPatch) -> None:
    import specserve.rayserve.front as front_module
    import specserve.rayserve.replica as replica_module

    def no_models(*_: Any, **__: Any) -> None:
        raise AssertionError("building the application must not load a model")

    # Models load in the replicas' constructors, on the cluster; building only describes the deployments.
    monkeypatch.setattr(front_module, "LlamaCppVocabulary", no_models)
    monkeypatch.setattr(replica_module, "create_app", no_models)
    had_llama = "llama_cpp" in sys.modules
    config = serve_config()
    settings = config_settings()
    built = build(config)
    by_name = deployments(built)
    assert set(by_name) == {FRONT, ENGINE}
    assert built.ingress_deployment_name == FRONT
    engine, front = by_name[ENGINE], by_name[FRONT]
    assert engine.ray_actor_options["num_cpus"] == settings.threads
    assert front.ray_actor_options["num_cpus"] == 0
    assert engine.num_replicas == the_app(config)["args"]["replicas"]
    assert front.num_replicas == 1
    assert engine._deployment_config.autoscaling_config is None
    assert engine.max_ongoing_requests == 2 * settings.max_running
    assert engine._deployment_config.graceful_shutdown_timeout_s == settings.shutdown_grace_seconds
    assert had_llama or "llama_cpp" not in sys.modules, "building imports llama.cpp"


def test_serve_config_autoscaling_example_in_args() -> None:
    text = uncomment(SERVE_CONFIG.read_text(), "autoscaling_config")
    config = yaml.safe_load(text)
    assert not lint(text)
    example = the_app(config)["args"]["autoscaling_config"]
    settings = config_settings(config)
    engine = deployments(build(config))[ENGINE]
    scaling = engine._deployment_config.autoscaling_config
    assert scaling is not None
    assert (scaling.min_replicas, scaling.max_replicas) == (example["min_replicas"], example["max_replicas"])
    # Serve never scales up when the target exceeds what a replica accepts.
    assert 1 <= scaling.target_ongoing_requests <= engine.max_ongoing_requests
    assert scaling.target_ongoing_requests == settings.max_running, "the comment explains 4 = max_running"
    assert scaling.downscale_delay_s > scaling.upscale_delay_s


def test_serve_config_autoscaling_example_in_deployments() -> None:
    text = uncomment(SERVE_CONFIG.read_text(), "deployments")
    config = yaml.safe_load(text)
    assert not lint(text)
    built = build(config)
    infos = with_overrides(built, config)
    engine = infos[ENGINE].deployment_config
    assert engine.autoscaling_config is not None
    assert 1 <= engine.autoscaling_config.target_ongoing_requests <= engine.max_ongoing_requests
    assert infos[FRONT].deployment_config.autoscaling_config is None
    assert infos[ENGINE].replica_config.ray_actor_options["num_cpus"] == config_settings(config).threads


def test_uncomment_fails_on_a_missing_example() -> None:
    with pytest.raises(AssertionError, match="expected one"):
        uncomment("a: 1\n# b: 2\n", "autoscaling_config")


# -- the RayService ---------------------------------------------------------------------------------------


def test_rayservice_kind_and_versions() -> None:
    doc = rayservice()
    assert (doc["apiVersion"], doc["kind"]) == ("ray.io/v1", "RayService")
    assert "namespace" not in doc["metadata"], "manifests name no namespace"
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    [pin] = [r for r in pyproject["project"]["optional-dependencies"]["ray"] if r.startswith("ray[")]
    assert cluster()["rayVersion"] == pin.partition("==")[2], "rayVersion = the ray extra's pin"
    assert not lint(RAYSERVICE.read_text())


def test_rayservice_serves_the_serve_config() -> None:
    embedded = rayservice()["spec"]["serveConfigV2"]
    assert isinstance(embedded, str), "serveConfigV2 is a YAML string"
    assert yaml.safe_load(embedded) == serve_config(), (
        "keep serveConfigV2 equal to deploy/ray/serve-config.yaml"
    )
    assert not lint(embedded)


def test_rayservice_head() -> None:
    head = cluster()["headGroupSpec"]
    params = head["rayStartParams"]
    assert params["num-cpus"] == "0", "no engine replica on the head"
    assert params["dashboard-host"] == "0.0.0.0"
    assert all(isinstance(v, str) for v in params.values()), "rayStartParams values are strings"
    ports = {p["name"]: p["containerPort"] for p in ray_container(head["template"]["spec"])["ports"]}
    assert ports["serve"] == serve_config()["http_options"]["port"]
    assert {"gcs-server", "dashboard", "client"} <= set(ports)


def test_rayservice_pods_stay_out_of_the_plain_service() -> None:
    selector = load(ROOT / "deploy" / "k8s" / "service.yaml")["spec"]["selector"]
    templates = [cluster()["headGroupSpec"]["template"], worker_group()["template"]]
    for template in templates:
        labels = template["metadata"]["labels"]
        assert not selector.items() <= labels.items(), "deploy/k8s's Service would send traffic to Ray pods"


def test_rayservice_images() -> None:
    deployment = load(DEPLOYMENT)["spec"]["template"]["spec"]["containers"][0]["image"]
    images = {c["image"] for _, c in all_containers()}
    autoscaler = cluster().get("autoscalerOptions", {}).get("image")  # default: the head's Ray image
    images |= {autoscaler} if autoscaler else set()
    assert images == {deployment + "-ray"}, f"one image: deployment.yaml's, built with EXTRAS=ray ({images})"


def test_rayservice_worker_cpus_hold_the_engines() -> None:
    settings = config_settings()
    threads = int(settings.threads or 1)
    group = worker_group()
    container = ray_container(group["template"]["spec"])
    limits, requests = container["resources"]["limits"], container["resources"]["requests"]
    assert quantity(limits["cpu"]) == quantity(requests["cpu"]), "CPU requests = limits (no throttling)"
    assert quantity(limits["memory"]) == quantity(requests["memory"])
    # KubeRay would set num-cpus from the limit rounded up; explicit, it cannot exceed the cores.
    ray_cpus = int(group["rayStartParams"]["num-cpus"])
    assert ray_cpus <= quantity(limits["cpu"])
    engines_per_pod = ray_cpus // threads
    assert engines_per_pod >= 1 and ray_cpus == engines_per_pod * threads, "no CPU left idle between engines"
    assert quantity(limits["cpu"]) >= threads * engines_per_pod
    assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    replicas = the_app(serve_config())["args"]["replicas"]
    assert group["replicas"] * engines_per_pod >= replicas, "the fixed replicas fit at the initial size"
    example = yaml.safe_load(uncomment(SERVE_CONFIG.read_text(), "autoscaling_config"))
    max_replicas = the_app(example)["args"]["autoscaling_config"]["max_replicas"]
    assert group["maxReplicas"] * engines_per_pod >= max_replicas, "the autoscaling example fits"
    assert cluster()["enableInTreeAutoscaling"] is True, "worker pods follow Serve autoscaling"


def test_rayservice_models_volume() -> None:
    settings = config_settings()
    model_dir = str(settings.model_dir)
    needs: dict[str, set[str | None]] = {
        "head": {settings.target},
        "worker": {settings.target, settings.draft_path_or_none},
    }
    for node, pod in pods().items():
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in ray_container(pod)["volumeMounts"]}
        assert model_dir in mounts, f"{node}: models at model_dir ({model_dir})"
        assert mounts[model_dir] in volumes
        pulls = [
            c for c in pod.get("initContainers", []) if c["command"][:3] == ["specserve", "models", "pull"]
        ]
        assert len(pulls) == 1, f"{node}: one init container runs `specserve models pull`"
        pull = pulls[0]
        args = cli_args(pull["command"][1:])
        assert set(args.names) >= needs[node] - {None}, f"{node}: pulls {args.names}"
        init_mounts = {m["mountPath"]: m["name"] for m in pull["volumeMounts"]}
        assert init_mounts.get(model_dir) == mounts[model_dir], (
            f"{node}: the init container fills that volume"
        )
        assert literal_env(pull).get("SPECSERVE_MODEL_DIR") == model_dir
        assert pull["image"] == ray_container(pod)["image"]
    assert pods()["head"]["volumes"] == pods()["worker"]["volumes"]


def test_rayservice_env_and_secrets() -> None:
    secret = load(SECRET)
    envs: dict[str, list[dict[str, Any]]] = {}
    for node, pod in pods().items():
        assert pod.get("enableServiceLinks") is False, (
            f"{node}: Services would inject SPECSERVE_PORT=tcp://..."
        )
        env = ray_container(pod)["env"]
        envs[node] = [e for e in env if e["name"].startswith("SPECSERVE_")]
        names = {e["name"] for e in envs[node]}
        assert "SPECSERVE_API_KEYS" in names, node
        assert names <= set(SETTINGS_ENV), f"{node}: not settings: {names - set(SETTINGS_ENV)}"
        for e in envs[node]:
            if e["name"] in SECRET_ENV:
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                assert ref, f"{node}: {e['name']} must come from a Secret"
                assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["stringData"]
        # The variables beat serve-config.yaml's settings: they may only repeat them.
        literal = {k: v for k, v in literal_env(ray_container(pod)).items() if k.startswith("SPECSERVE_")}
        overrides = the_app(serve_config())["args"]["settings"]
        assert load_settings(overrides=overrides, env=literal) == config_settings(), f"{node}: env differs"
    assert envs["head"] == envs["worker"], "the build task runs on any node: same SPECSERVE_* everywhere"


def test_rayservice_probes() -> None:
    serve_port = serve_config()["http_options"]["port"]
    for node, pod in pods().items():
        container = ray_container(pod)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        for kind in ("livenessProbe", "readinessProbe"):
            probe = container[kind]
            assert "httpGet" in probe, (
                f"{node} {kind}: KubeRay's default exec probes need wget (not in the image)"
            )
        readiness = container["readinessProbe"]["httpGet"]
        if node == "worker":
            assert readiness["path"] == "/-/healthz", "worker readiness = its Serve proxy"
            assert ports.get(readiness["port"], readiness["port"]) == serve_port
        assert container["livenessProbe"]["httpGet"]["path"] == "/api/healthz"


def test_rayservice_pod_security_and_grace() -> None:
    settings = config_settings()
    user = [line.split()[1] for line in DOCKERFILE.read_text().splitlines() if line.startswith("USER ")][-1]
    for node, pod in pods().items():
        security = pod["securityContext"]
        assert security["runAsNonRoot"] is True and str(security["runAsUser"]) == user.split(":")[0], node
        assert pod["terminationGracePeriodSeconds"] > settings.shutdown_grace_seconds, node
    assert pods()["worker"].get("automountServiceAccountToken") is False
    assert pods()["head"].get("automountServiceAccountToken") is not False, "the autoscaler needs the API"
    for where, c in all_containers():
        assert c["securityContext"]["allowPrivilegeEscalation"] is False, where
        assert {"cpu", "memory"} <= set(c["resources"]["requests"]), where
        assert "memory" in c["resources"]["limits"], where


def test_rayservice_pod_specs_pass_kubernetes_schema() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for node, pod in pods().items():
        doc = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"specserve-{node}"}, "spec": pod}
        try:
            kubernetes_validate.validate(doc, K8S_SCHEMA_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{node} pod: {exc.message} at {list(exc.path)}") from exc


# -- the image --------------------------------------------------------------------------------------------


def test_dockerfile_extras_build_arg() -> None:
    text = DOCKERFILE.read_text()
    builder = text.split("\nFROM ")[1]  # the first stage, where the package is installed
    assert re.search(r'^ARG EXTRAS=""$', builder, re.M), "ARG EXTRAS, empty by default (no ray)"
    installs = re.findall(r"pip install --no-cache-dir (\S+)", builder)
    spec = next((i for i in installs if "EXTRAS" in i), None)
    assert spec is not None, "the package install takes the extras"
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "ray" in pyproject["project"]["optional-dependencies"]
    for extras, expected in (("", "."), ("ray", ".[ray]")):
        shell = subprocess.run(
            ["sh", "-c", f"EXTRAS='{extras}'; printf '%s' {spec}"], capture_output=True, text=True, check=True
        )
        assert shell.stdout == expected, f"EXTRAS={extras!r} installs {shell.stdout!r}"


def test_quantity() -> None:
    assert quantity("2500m") == 2.5 and quantity(2) == 2 and quantity("8Gi") == 8 * 2**30
    assert math.isclose(quantity("500m"), 0.5)
