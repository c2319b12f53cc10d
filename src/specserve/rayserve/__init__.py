"""Scale-out on Ray Serve: ``specserve serve --replicas N`` (the optional extra ``specserve[ray]``).

One front deployment takes the HTTP traffic (auth, body limits, validation with the server's own protocol
code) and hands each request to one of N engine replicas through a ``DeploymentHandle``; every replica runs
the whole single-process specserve application in-process. The router sends a request to the replica whose
prefix cache holds the longest prefix of its prompt (the cache's own block hashes, reported by each replica),
unless that replica is busier than the others by more than a threshold.

Modules: ``asgi_bridge`` (one HTTP exchange through an ASGI app, as messages), ``replica`` (the engine
deployment), ``router`` (prefix-affinity routing), ``front`` (the ingress), ``relay`` (a response back from
a replica, failures included), ``metrics_merge`` (every replica's metrics in one scrape, labelled by
replica), ``app`` (building and running the application). Ray is imported only here; the single-process
server never needs it.
"""

from __future__ import annotations

import weakref
from typing import Any

ROUTERS: weakref.WeakSet[Any] = weakref.WeakSet()
"""This process's engine routers (``router.PrefixAffinityRouter``): the front reads the running replicas from
them. Kept here, not in the router's module, because Serve ships the router class by value."""

REPLICA_HEADER = "x-specserve-replica"
"""Names the engine replica that answered, on every relayed response."""

RAY_EXTRA_HINT = "Ray Serve is not installed: pip install 'specserve[ray]'"


def require_ray() -> None:
    """Fail with one line naming the extra when Ray Serve is missing."""
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(RAY_EXTRA_HINT) from exc
