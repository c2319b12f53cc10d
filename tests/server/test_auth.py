"""Access control without a server: key sources, bearer parsing, the decisions per path, the token bucket."""

from __future__ import annotations

from pathlib import Path

import pytest

from specserve.config import Settings, SettingsError
from specserve.server.auth import AccessControl, RateLimiter, bearer_token, load_api_keys, matches


def access(**overrides: object) -> AccessControl:
    return AccessControl(Settings(**overrides))  # type: ignore[arg-type]


def test_keys_from_environment_list_and_file(tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("# team keys\nfile-key-1\n\n  file-key-2  # ci\nk1\n")
    keys = load_api_keys(Settings(api_keys=" k1, k2 ,,", api_key_file=str(key_file)))
    assert keys == (b"k1", b"k2", b"file-key-1", b"file-key-2")
    with pytest.raises(SettingsError, match="api_key_file"):
        load_api_keys(Settings(api_key_file=str(tmp_path / "missing")))


def test_bearer_and_matching() -> None:
    assert bearer_token("Bearer abc") == b"abc"
    assert bearer_token("bearer   abc ") == b"abc"
    assert (
        bearer_token("Basic abc") is None and bearer_token("Bearer ") is None and bearer_token(None) is None
    )
    assert matches(b"k2", (b"k1", b"k2")) == b"k2"
    assert matches(b"k", (b"k1", b"k2")) is None and matches(None, (b"k1",)) is None


def test_open_api_without_keys_and_public_endpoints() -> None:
    control = access()
    assert control.check("/v1/completions", None, "1.2.3.4") is None
    keyed = access(api_keys="k1")
    for path in ("/health", "/ready", "/metrics"):
        assert keyed.check(path, None, "1.2.3.4") is None
    metrics = access(api_keys="k1", metrics_require_key=True).check("/metrics", None, "c")
    assert metrics is not None and metrics.status == 401


@pytest.mark.parametrize(
    ("authorization", "status", "message"),
    [(None, 401, "didn't provide"), ("Bearer nope", 401, "Incorrect"), ("Token k1", 401, "didn't provide"),
     ("Bearer k1", None, None)],
)  # fmt: skip
def test_v1_needs_a_valid_key(authorization: str | None, status: int | None, message: str | None) -> None:
    error = access(api_keys="k1,k2").check("/v1/models", authorization, "c")
    if status is None:
        assert error is None
        return
    assert error is not None and error.status == status and message is not None
    assert message in error.message
    assert error.body()["error"]["code"] == "invalid_api_key"
    assert error.headers["WWW-Authenticate"].startswith("Bearer")


def test_admin_key() -> None:
    disabled = access(api_keys="k1").check("/admin/speculation", "Bearer k1", "c")
    assert disabled is not None and disabled.status == 403 and "SPECSERVE_ADMIN_KEY" in disabled.message
    control = access(api_keys="k1", admin_key="adm")
    assert control.check("/admin/speculation", "Bearer adm", "c") is None
    statuses = [control.check("/admin/speculation", h, "c") for h in (None, "Bearer nope", "Bearer k1")]
    assert [e.status if e else None for e in statuses] == [401, 401, 403]


def test_token_bucket_refills_at_the_configured_rate() -> None:
    limiter = RateLimiter(per_minute=6)  # burst 6, one more every 10 s
    assert all(limiter.take(b"a", now=0.0) is None for _ in range(6))
    assert limiter.take(b"a", now=0.0) == pytest.approx(10.0)
    assert limiter.take(b"b", now=0.0) is None  # per client
    assert limiter.take(b"a", now=5.0) == pytest.approx(5.0)
    assert limiter.take(b"a", now=10.0) is None
    assert limiter.take(b"a", now=10.0) is not None


def test_rate_limit_is_a_429_with_retry_after() -> None:
    control = access(api_keys="k1", rate_limit_per_minute=1)
    assert control.check("/v1/completions", "Bearer k1", "c") is None
    error = control.check("/v1/completions", "Bearer k1", "c")
    assert error is not None and error.status == 429 and int(error.headers["Retry-After"]) >= 1
    assert error.body()["error"]["type"] == "rate_limit_error"
    assert control.check("/health", "Bearer k1", "c") is None  # only /v1/* is limited


def test_cache_salt_separates_api_keys_and_requests() -> None:
    keyed = access(api_keys="k1,k2")
    k1, k2 = keyed.cache_salt("Bearer k1", None), keyed.cache_salt("Bearer k2", None)
    assert k1 and k2 and k1 != k2 and "k1" not in k1  # a tenant's salt, not its key
    assert keyed.cache_salt("Bearer k1", "s") not in (k1, keyed.cache_salt("Bearer k2", "s"))
    assert access().cache_salt(None, None) == "" and access().cache_salt(None, "s") != ""
