"""Who may call what: API keys for ``/v1/*``, the admin key for ``/admin/*``, a per-key rate limit.

Keys come from ``SPECSERVE_API_KEYS`` (comma-separated) and ``api_key_file`` (one per line); with none
configured the API is open. ``Authorization: Bearer <key>`` is compared in constant time against every key
(no early exit, so timing does not tell which key matched or how much of one). ``/health``, ``/ready`` and,
unless ``metrics_require_key``, ``/metrics`` stay public.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import time
from dataclasses import dataclass
from pathlib import Path

from specserve.config import Settings, SettingsError
from specserve.server.errors import APIError

MAX_BUCKETS = 10_000


def load_api_keys(settings: Settings) -> tuple[bytes, ...]:
    """The configured API keys; an unreadable key file fails at start, naming the setting."""
    keys = [k.strip() for k in (settings.api_keys or "").split(",")]
    if settings.api_key_file:
        try:
            lines = Path(settings.api_key_file).read_text().splitlines()
        except OSError as exc:
            raise SettingsError(
                f"api_key_file: cannot read {settings.api_key_file}: {exc.strerror}"
            ) from None
        keys += [line.split("#", 1)[0].strip() for line in lines]
    return tuple(dict.fromkeys(k.encode() for k in keys if k))


def bearer_token(authorization: str | None) -> bytes | None:
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    return token.strip().encode() if scheme.lower() == "bearer" and token.strip() else None


def matches(token: bytes | None, keys: tuple[bytes, ...]) -> bytes | None:
    """The key equal to ``token``, checking every key in constant time each."""
    found = None
    for key in keys:
        if hmac.compare_digest(token or b"", key):
            found = key
    return found if token else None


KEYED_PATHS = frozenset({"/tokenize", "/detokenize", "/tokenizer_info"})
"""vLLM's tokenizer endpoints sit outside ``/v1`` but read the model: the API keys guard them too."""


@dataclass
class _Bucket:
    tokens: float
    updated: float


class RateLimiter:
    """Token bucket per client: ``per_minute`` requests of burst, refilled at per_minute / 60 per second."""

    def __init__(self, per_minute: int) -> None:
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self._buckets: dict[bytes, _Bucket] = {}

    def take(self, client: bytes, now: float | None = None) -> float | None:
        """None if the request may go; else the seconds until it could."""
        now = time.monotonic() if now is None else now
        bucket = self._buckets.get(client)
        if bucket is None:
            if len(self._buckets) >= MAX_BUCKETS:  # forget clients that are back to a full bucket
                self._buckets = {
                    k: b for k, b in self._buckets.items() if self._level(b, now) < self.capacity
                }
            bucket = self._buckets[client] = _Bucket(self.capacity, now)
        bucket.tokens, bucket.updated = self._level(bucket, now), now
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return None
        return (1.0 - bucket.tokens) / self.rate

    def _level(self, bucket: _Bucket, now: float) -> float:
        return min(self.capacity, bucket.tokens + (now - bucket.updated) * self.rate)


def unauthorized(message: str) -> APIError:
    return APIError(
        401, message, code="invalid_api_key", headers={"WWW-Authenticate": 'Bearer realm="specserve"'}
    )


class AccessControl:
    """Decides, before routing, whether a request may proceed; returns the error to send if not."""

    def __init__(self, settings: Settings) -> None:
        self.keys = load_api_keys(settings)
        self.admin_key = settings.admin_key.encode() if settings.admin_key else None
        self.metrics_require_key = settings.metrics_require_key
        self.limiter = RateLimiter(settings.rate_limit_per_minute) if settings.rate_limit_per_minute else None

    def check(self, path: str, authorization: str | None, client: str) -> APIError | None:
        token = bearer_token(authorization)
        if path.startswith("/admin/"):
            return self._check_admin(token)
        keyed = path.startswith("/v1/") or path in KEYED_PATHS
        if not (keyed or (path == "/metrics" and self.metrics_require_key)):
            return None
        key = None
        if self.keys:
            if token is None:
                return unauthorized(
                    "You didn't provide an API key: send it in an 'Authorization: Bearer <key>' header."
                )
            key = matches(token, self.keys)
            if key is None:
                return unauthorized("Incorrect API key provided.")
        if self.limiter is not None and path.startswith("/v1/"):
            wait = self.limiter.take(key or client.encode())
            if wait is not None:
                retry = max(1, math.ceil(wait))
                return APIError(
                    429,
                    f"Rate limit reached: {self.limiter.capacity:g} requests per minute; retry in {retry} s.",
                    "rate_limit_error",
                    code="rate_limit_exceeded",
                    headers={"Retry-After": str(retry)},
                )
        return None

    def cache_salt(self, authorization: str | None, requested: str | None) -> str:
        """The prefix-cache namespace of a request: its API key's (tenants never share cached KV, so one
        cannot time another's prompts) and the request's own ``cache_salt`` within it."""
        key = matches(bearer_token(authorization), self.keys) if self.keys else None
        tenant = hashlib.sha256(key).hexdigest()[:32] if key is not None else ""
        return f"{tenant}\x00{requested}" if requested is not None else tenant

    def _check_admin(self, token: bytes | None) -> APIError | None:
        if self.admin_key is None:
            return APIError(
                403, "The admin endpoints are disabled: set SPECSERVE_ADMIN_KEY.", "permission_error",
                code="admin_disabled",
            )  # fmt: skip
        if token is None:
            return unauthorized("The admin endpoints need 'Authorization: Bearer <admin key>'.")
        if matches(token, (self.admin_key,)) is None:
            if matches(token, self.keys) is not None:
                return APIError(
                    403, "An API key cannot call admin endpoints.", "permission_error", code="forbidden"
                )
            return unauthorized("Incorrect admin key provided.")
        return None
