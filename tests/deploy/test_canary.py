"""The canary overlay (deploy/k8s/canary): `kubectl apply -k` adds a one-replica canary next to the stable
Deployment, `kubectl delete -k` takes it away again and touches nothing stable.

The overlay is plain manifests plus an `images:` entry, so it renders here in Python (the resources, with the
image set); where kubectl or kustomize is on PATH the real `kustomize build` must render the same objects
(skipped without one). Checked on the rendered objects: only canary objects, all
named *-canary and none sharing a name with a stable object; valid against the Kubernetes schemas; the stable
Service selects the canary pods and the canary Service selects nothing else; the canary has its own model
volume; and the canary Deployment, Service and PVC are the stable ones with the canary differences only.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
from typing import Any

import pytest
import yaml

from .files import K8S, K8S_SCHEMA_VERSION, image_pinned, k8s_docs, rel

CANARY = K8S / "canary"
SUFFIX = "-canary"
TRACK = {"track": "canary"}
KINDS = ["Deployment", "PersistentVolumeClaim", "Service"]  # what the overlay adds, one of each
# The kustomization fields the Python rendering below understands; anything else needs kustomize itself.
KUSTOMIZATION_FIELDS = {"apiVersion", "kind", "resources", "images"}
YAMLLINT_CONFIG = "extends: relaxed\nrules:\n  line-length: {max: 110}\n"  # as test_deploy_files.py


def kustomization() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((CANARY / "kustomization.yaml").read_text())
    return loaded


def split_image(ref: str) -> tuple[str, str | None, str | None]:
    """name, tag, digest of an image reference (a port in the registry host is not a tag)."""
    ref, _, digest = ref.partition("@")
    name, sep, tag = ref.rpartition(":")
    if not sep or "/" in tag:
        return ref, None, digest or None
    return name, tag, digest or None


def set_image(ref: str, entry: dict[str, Any]) -> str:
    """What kustomize's `images:` entry makes of an image reference."""
    name, tag, digest = split_image(ref)
    if name != entry["name"]:
        return ref
    new = entry.get("newName", name)
    if entry.get("digest"):
        return f"{new}@{entry['digest']}"
    if entry.get("newTag"):
        return f"{new}:{entry['newTag']}"
    return str(new) + (f":{tag}" if tag else "") + (f"@{digest}" if digest else "")


def containers(deployment: dict[str, Any]) -> list[dict[str, Any]]:
    pod = deployment["spec"]["template"]["spec"]
    return [*pod.get("initContainers", []), *pod["containers"]]


def raw_docs() -> list[dict[str, Any]]:
    return [
        d for r in kustomization()["resources"] for d in yaml.safe_load_all((CANARY / r).read_text()) if d
    ]


def render() -> list[dict[str, Any]]:
    """`kustomize build deploy/k8s/canary`, for the fields the overlay uses."""
    docs = copy.deepcopy(raw_docs())
    for d in docs:
        if d["kind"] == "Deployment":
            for c in containers(d):
                for entry in kustomization().get("images", []):
                    c["image"] = set_image(c["image"], entry)
    return docs


def by_kind(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == KINDS, f"the overlay adds one {', one '.join(KINDS)}; it has {kinds}"
    return {d["kind"]: d for d in docs}


def canary() -> dict[str, dict[str, Any]]:
    return by_kind(render())


def stable(kind: str, name: str = "specserve") -> dict[str, Any]:
    docs = [d for _, d in k8s_docs() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(docs) == 1, f"expected one {kind} {name} in deploy/k8s, found {len(docs)}"
    return docs[0]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def pod_labels(deployment: dict[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = deployment["spec"]["template"]["metadata"]["labels"]
    return labels


def volume_of(deployment: dict[str, Any], mount_path: str) -> dict[str, Any]:
    pod = deployment["spec"]["template"]["spec"]
    mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
    volume: dict[str, Any] = {v["name"]: v for v in pod["volumes"]}[mounts[mount_path]]
    return volume


def kustomize_command() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


# -- the overlay only adds ---------------------------------------------------------------------------------


def test_overlay_is_plain_files_of_its_own() -> None:
    k = kustomization()
    assert k["apiVersion"] == "kustomize.config.k8s.io/v1beta1" and k["kind"] == "Kustomization"
    assert set(k) <= KUSTOMIZATION_FIELDS, f"render() does not apply {sorted(set(k) - KUSTOMIZATION_FIELDS)}"
    # A base (../), a remote or a file elsewhere would bring stable objects in: `delete -k` would delete them.
    for resource in k["resources"]:
        assert "/" not in resource and (CANARY / resource).is_file(), f"not a file of the overlay: {resource}"
    files = {p.name for p in CANARY.glob("*.y*ml")} - {"kustomization.yaml"}
    assert files == set(k["resources"]), "every manifest in deploy/k8s/canary is listed, nothing else"
    base = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert not [r for r in base["resources"] if "canary" in r], (
        "`apply -k deploy/k8s` must not start a canary"
    )


def test_only_canary_objects() -> None:
    objects = canary()
    base_names = {d["metadata"]["name"] for _, d in k8s_docs() if d["kind"] != "Kustomization"}
    assert base_names
    for kind, d in objects.items():
        meta = d["metadata"]
        assert meta["name"].endswith(SUFFIX), f"{kind} {meta['name']}: canary objects are named *{SUFFIX}"
        assert meta["name"] not in base_names, f"{kind} {meta['name']} is a stable object's name"
        assert selects(TRACK, meta.get("labels", {})), f"{kind} {meta['name']}: label it track: canary"
        assert "namespace" not in meta, f"{kind} {meta['name']}: manifests name no namespace"
    deployment = objects["Deployment"]
    assert deployment["spec"]["replicas"] == 1


def test_schemas() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for d in render():
        try:
            kubernetes_validate.validate(d, K8S_SCHEMA_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            name = f"{d['kind']} {d['metadata']['name']}"
            raise AssertionError(f"{name}: {exc.message} at {list(exc.path)}") from exc


def test_kustomize_renders_the_same() -> None:
    command = kustomize_command()
    if command is None:  # not installed by the test setup: render() above is the check that always runs
        pytest.skip("neither kustomize nor kubectl on PATH")
    out = subprocess.run([*command, str(CANARY)], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    built = [d for d in yaml.safe_load_all(out.stdout) if d]

    def key(d: dict[str, Any]) -> tuple[str, str]:
        return d["kind"], d["metadata"]["name"]

    assert sorted(built, key=key) == sorted(render(), key=key)


# -- traffic -----------------------------------------------------------------------------------------------


def test_services_select_the_canary() -> None:
    objects = canary()
    deployment, service = objects["Deployment"], objects["Service"]
    labels = pod_labels(deployment)
    stable_labels = pod_labels(stable("Deployment"))
    assert selects(deployment["spec"]["selector"]["matchLabels"], labels)
    assert set(deployment["spec"]["selector"]) == {"matchLabels"}
    # The canary Deployment must never claim the stable pods.
    assert not selects(deployment["spec"]["selector"]["matchLabels"], stable_labels)
    # The stable Service sends the canary its share of the traffic...
    assert selects(stable("Service")["spec"]["selector"], labels), "the stable Service misses the canary"
    # ...and the canary Service reaches the canary pods and no stable one.
    assert selects(service["spec"]["selector"], labels)
    assert not selects(service["spec"]["selector"], stable_labels), "specserve-canary selects stable pods"
    assert selects(TRACK, labels)


def test_prometheus_scrapes_the_canary() -> None:
    deployment = canary()["Deployment"]
    annotations = deployment["spec"]["template"]["metadata"].get("annotations", {})
    stable_annotations = stable("Deployment")["spec"]["template"]["metadata"].get("annotations", {})
    scrape = {k: v for k, v in stable_annotations.items() if k.startswith("prometheus.io/")}
    assert scrape and scrape.items() <= annotations.items()


# -- volumes -----------------------------------------------------------------------------------------------


def test_own_model_volume() -> None:
    objects = canary()
    deployment, pvc = objects["Deployment"], objects["PersistentVolumeClaim"]
    pod = deployment["spec"]["template"]["spec"]
    stable_claims = {d["metadata"]["name"] for _, d in k8s_docs() if d["kind"] == "PersistentVolumeClaim"}
    claims = {v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
    assert claims == {pvc["metadata"]["name"]}, f"the canary mounts {claims}, not its own PVC only"
    assert not claims & stable_claims, "the stable PVC is ReadWriteOnce and held by the stable pod"
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    models = volume_of(deployment, env["SPECSERVE_MODEL_DIR"])
    assert models["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    for init in pod.get("initContainers", []):
        init_mounts = {m["mountPath"]: m["name"] for m in init["volumeMounts"]}
        assert init_mounts[env["SPECSERVE_MODEL_DIR"]] == models["name"], (
            f"{init['name']} fills another volume"
        )


def test_borrowed_config_and_secret_exist() -> None:
    """The canary reads the stable ConfigMap and Secret; it neither ships nor deletes them."""
    pod = canary()["Deployment"]["spec"]["template"]["spec"]
    config_maps = {v["configMap"]["name"] for v in pod["volumes"] if "configMap" in v}
    secrets = {
        e["valueFrom"]["secretKeyRef"]["name"]
        for c in pod["containers"]
        for e in c.get("env", [])
        if "secretKeyRef" in e.get("valueFrom", {})
    }
    base = {(d["kind"], d["metadata"]["name"]) for _, d in k8s_docs() if "metadata" in d}
    assert config_maps and {("ConfigMap", n) for n in config_maps} <= base
    assert secrets and {("Secret", n) for n in secrets} <= base


# -- a copy of stable --------------------------------------------------------------------------------------


def canarized(d: dict[str, Any]) -> dict[str, Any]:
    """A stable object as its canary copy must read: renamed, labelled track: canary, on the PVC of the same
    name with the suffix, images left out."""
    d = copy.deepcopy(d)
    d["metadata"]["name"] += SUFFIX
    d["metadata"].setdefault("labels", {}).update(TRACK)
    if d["kind"] == "Service":
        d["spec"]["selector"].update(TRACK)
    if d["kind"] == "Deployment":
        d["spec"]["replicas"] = 1
        d["spec"]["selector"]["matchLabels"].update(TRACK)
        pod_labels(d).update(TRACK)
        for v in d["spec"]["template"]["spec"]["volumes"]:
            if "persistentVolumeClaim" in v:
                v["persistentVolumeClaim"]["claimName"] += SUFFIX
    return without_images(d)


def without_images(d: dict[str, Any]) -> dict[str, Any]:
    if d["kind"] == "Deployment":
        d = copy.deepcopy(d)
        for c in containers(d):
            c.pop("image")
    return d


def test_canary_is_a_copy_of_stable() -> None:
    """Everything but name, labels, selectors, replicas, the PVC and the image is as in deploy/k8s."""
    objects = by_kind(raw_docs())
    deployment = stable("Deployment")
    (claim,) = [
        v["persistentVolumeClaim"]["claimName"]
        for v in deployment["spec"]["template"]["spec"]["volumes"]
        if "persistentVolumeClaim" in v
    ]
    pairs = [
        (deployment, objects["Deployment"]),
        (stable("Service"), objects["Service"]),
        (stable("PersistentVolumeClaim", claim), objects["PersistentVolumeClaim"]),
    ]
    for base, copied in pairs:
        assert without_images(copied) == canarized(base), (
            f"deploy/k8s/canary: {copied['kind']} {copied['metadata']['name']} differs from the stable "
            f"{base['kind']} {base['metadata']['name']} in more than the canary changes: copy the change over"
        )


def test_image_is_set_for_both_containers() -> None:
    entries = kustomization().get("images", [])
    assert len(entries) == 1, "one images: entry, the image under test"
    raw = by_kind(raw_docs())["Deployment"]
    assert {split_image(c["image"])[0] for c in containers(raw)} == {entries[0]["name"]}, (
        "the images: entry must name the image of every container, or some keep the stable image"
    )
    images = {c["image"] for c in containers(canary()["Deployment"])}
    assert len(images) == 1, f"init container and server run different images: {images}"
    assert image_pinned(images.pop())


def test_set_image() -> None:
    entry = {"name": "specserve", "newName": "registry.example.com:5000/specserve", "newTag": "0.2.0"}
    assert set_image("specserve:0.1.0", entry) == "registry.example.com:5000/specserve:0.2.0"
    assert set_image("specserve:0.1.0", {"name": "specserve", "newTag": "0.2.0"}) == "specserve:0.2.0"
    assert set_image("specserve:0.1.0", {"name": "specserve", "digest": "sha256:ab"}) == "specserve@sha256:ab"
    assert set_image("other:0.1.0", entry) == "other:0.1.0"
    assert split_image("host:5000/specserve") == ("host:5000/specserve", None, None)


# -- lint --------------------------------------------------------------------------------------------------


def test_yamllint() -> None:
    pytest.importorskip("yamllint")
    from yamllint import linter  # type: ignore[import-untyped]
    from yamllint.config import YamlLintConfig  # type: ignore[import-untyped]

    files = sorted(CANARY.glob("*.y*ml"))
    assert files
    config = YamlLintConfig(YAMLLINT_CONFIG)
    problems = [
        f"{rel(p)}:{e.line}: {e.level} {e.message}" for p in files for e in linter.run(p.read_text(), config)
    ]
    assert not problems, "\n".join(problems)
