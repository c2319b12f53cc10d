"""The Kubernetes manifests (deploy/k8s): valid against the schemas, the Deployment's probes, resources,
grace period, volumes and secrets agree with the settings the container runs with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate

from specserve.config import Settings
from specserve.config_sources import load_settings

from .files import K8S_SCHEMA_VERSION, SECRET_ENV, cli_args, image_pinned, k8s_docs, k8s_one, rel

K8S_API_VERSIONS = {
    "Deployment": "apps/v1",
    "Service": "v1",
    "PersistentVolumeClaim": "v1",
    "Secret": "v1",
    "ConfigMap": "v1",
    "Kustomization": "kustomize.config.k8s.io/v1beta1",
}


def test_k8s_kinds_and_api_versions() -> None:
    docs = k8s_docs()
    kinds = [d["kind"] for _, d in docs]
    assert sorted(kinds) == sorted(K8S_API_VERSIONS), kinds
    for path, d in docs:
        assert d["apiVersion"] == K8S_API_VERSIONS[d["kind"]], rel(path)
        assert "namespace" not in d.get("metadata", {}), f"{rel(path)}: manifests name no namespace"


def test_k8s_schemas() -> None:
    for path, d in k8s_docs():
        if d["kind"] != "Kustomization":
            try:
                kubernetes_validate.validate(d, K8S_SCHEMA_VERSION, strict=True)
            except kubernetes_validate.ValidationError as exc:
                raise AssertionError(f"{rel(path)}: {exc.message} at {list(exc.path)}") from exc


def test_k8s_kustomization() -> None:
    resources = k8s_one("Kustomization")["resources"]
    listed = {p.name for p, d in k8s_docs() if d["kind"] not in ("Kustomization", "Secret")}
    assert set(resources) == listed
    secret_files = [p for p, d in k8s_docs() if d["kind"] == "Secret"]
    assert [p.name for p in secret_files] == ["secret.example.yaml"]


def deployment_parts() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    deployment = k8s_one("Deployment")
    pod = deployment["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in pod["containers"]}
    return deployment, pod, containers["specserve"]


def k8s_settings(tmp_path: Path) -> Settings:
    """The settings the container runs with: ConfigMap file < literal env (secrets as dummies) < flags."""
    _, _, container = deployment_parts()
    config_file = tmp_path / "config.yaml"
    config_file.write_text(k8s_one("ConfigMap")["data"]["config.yaml"])
    env = {e["name"]: e.get("value", "dummy-secret") for e in container["env"]}
    args = cli_args(container["command"][1:])
    assert args.command == "serve"
    return load_settings(args, env=env, config_file=config_file)


def test_k8s_deployment(tmp_path: Path) -> None:
    deployment, pod, container = deployment_parts()
    settings = k8s_settings(tmp_path)
    assert (
        deployment["spec"]["selector"]["matchLabels"].items()
        <= deployment["spec"]["template"]["metadata"]["labels"].items()
    )
    ports = container["ports"]
    assert [p["containerPort"] for p in ports] == [settings.port]
    port_refs = {ports[0]["containerPort"], ports[0].get("name")}
    probes = {kind: container[kind] for kind in ("livenessProbe", "readinessProbe", "startupProbe")}
    assert probes["livenessProbe"]["httpGet"]["path"] == "/health"
    assert probes["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert probes["startupProbe"]["httpGet"]["path"] in ("/health", "/ready")
    for kind, probe in probes.items():
        assert probe["httpGet"]["port"] in port_refs, f"{kind} probes another port"
    startup = probes["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, "model loading needs minutes"
    for c in [*pod["containers"], *pod.get("initContainers", [])]:
        assert {"cpu", "memory"} <= set(c["resources"]["requests"]), f"{c['name']}: resource requests"
        assert "memory" in c["resources"]["limits"], f"{c['name']}: a memory limit"
        assert c["securityContext"]["allowPrivilegeEscalation"] is False, c["name"]
        assert image_pinned(c["image"]), c["image"]
    security = pod["securityContext"]
    assert security["runAsNonRoot"] is True and security.get("runAsUser", 1) != 0
    pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    pause = float(pre_stop[1]) if pre_stop[:1] == ["sleep"] else 0.0
    assert pod["terminationGracePeriodSeconds"] > settings.shutdown_grace_seconds + pause
    assert pod.get("enableServiceLinks") is False, "a Service named specserve would inject SPECSERVE_PORT"


def test_k8s_volumes_and_config(tmp_path: Path) -> None:
    _, pod, container = deployment_parts()
    settings = k8s_settings(tmp_path)
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    models = volumes[mounts[str(settings.model_dir)]]
    assert (
        models["persistentVolumeClaim"]["claimName"] == k8s_one("PersistentVolumeClaim")["metadata"]["name"]
    )
    config_path = Path(container["command"][container["command"].index("--config") + 1])
    config_volume = volumes[mounts[str(config_path.parent)]]
    assert config_volume["configMap"]["name"] == k8s_one("ConfigMap")["metadata"]["name"]
    assert config_path.name in k8s_one("ConfigMap")["data"]
    for init in pod.get("initContainers", []):
        init_env = {e["name"]: e.get("value") for e in init.get("env", [])}
        assert init_env.get("SPECSERVE_MODEL_DIR") == settings.model_dir, init["name"]


def test_k8s_secrets() -> None:
    _, _, container = deployment_parts()
    secret = k8s_one("Secret")
    by_name = {e["name"]: e for e in container["env"]}
    assert "SPECSERVE_API_KEYS" in by_name
    for name in SECRET_ENV & set(by_name):
        ref = by_name[name].get("valueFrom", {}).get("secretKeyRef")
        assert ref, f"{name} must come from a Secret"
        assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["stringData"], name
    for value in secret["stringData"].values():
        assert "REPLACE_ME" in value, "the example Secret holds placeholders only"


def test_k8s_service() -> None:
    _, _, container = deployment_parts()
    service = k8s_one("Service")
    labels = k8s_one("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    port = container["ports"][0]
    assert [p["targetPort"] for p in service["spec"]["ports"]] in (
        [port["containerPort"]],
        [port.get("name")],
    )
