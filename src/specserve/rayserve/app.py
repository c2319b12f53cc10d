"""Build the Ray Serve application and run it: ``specserve serve --replicas N`` or a Serve config file.

Two deployments: ``SpecserveFront`` (one replica, no CPU reserved: it relays and tokenizes) and
``SpecserveEngine`` (N replicas, each reserving ``num_cpus`` = its llama.cpp threads, so Ray never packs more
engines onto a node than it has cores for). The engine's router is :class:`PrefixAffinityRouter`; requests
beyond ``max_waiting`` per replica wait at the front, and past that get 429.

From a config file (``serve run deploy/ray/serve-config.yaml``), ``app_builder`` reads ``args``: ``settings``
(the YAML settings mapping ``--config`` takes; secrets such as API keys come from the environment of the
Ray nodes), ``replicas`` or ``autoscaling_config``, ``imbalanced_threshold``, and ``front_resources`` (Ray
custom resources that place the front on a node holding the model file, e.g. a KubeRay worker group's).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from specserve.config import Settings
from specserve.config_sources import load_settings, with_secrets_from_env, without_secrets
from specserve.rayserve.front import Front, create_front_app
from specserve.rayserve.replica import EngineReplica
from specserve.rayserve.router import PrefixAffinityRouter

log = logging.getLogger("specserve.rayserve")

APP_NAME = "specserve"
ENGINE = "SpecserveEngine"
FRONT = "SpecserveFront"
ROUTING_STATS_PERIOD_S = 2.0
"""How often replicas report their cached block hashes (between reports the router remembers its choices)."""
HEALTH_CHECK_PERIOD_S = 5.0
STOP_POLL_S = 0.2


@serve.ingress()
class FrontDeployment:
    """The ingress: builds its FastAPI app on the replica, after ``__init__`` (Serve's late-bound ingress)."""

    def __init__(self, settings: dict[str, Any], replicas: Any, desired: int) -> None:
        self.front = Front(with_secrets_from_env(settings), replicas, ENGINE, desired)

    def __serve_build_asgi_app__(self) -> Any:
        return create_front_app(self.front)


def build_application(
    settings: Settings,
    *,
    replicas: int = 2,
    autoscaling_config: dict[str, Any] | None = None,
    imbalanced_threshold: int = 4,
    front_resources: dict[str, float] | None = None,
) -> Any:
    """The bound application (``serve.run`` takes it). ``front_resources``: Ray custom resources the front
    needs, to place it on a node that holds the model file (it tokenizes with the target's vocabulary; on
    a node without the file it routes without prefix affinity)."""
    threads = settings.threads or 1
    settings = dataclasses.replace(settings, threads=threads)
    values = without_secrets(settings)  # replicas read API and admin keys from their own environment
    scaling: dict[str, Any] = (
        {"autoscaling_config": autoscaling_config} if autoscaling_config else {"num_replicas": replicas}
    )
    most = int(autoscaling_config.get("max_replicas", replicas)) if autoscaling_config else replicas
    deployment: Any = serve.deployment  # its overloads do not type the class-and-options form
    router: Any = RequestRouterConfig  # a pydantic model that mypy sees with the wrong field types
    engines = deployment(
        EngineReplica,
        name=ENGINE,
        ray_actor_options={"num_cpus": threads},
        # Running plus a short queue on the replica: beyond that, requests wait at the front, where the
        # router can still choose for them.
        max_ongoing_requests=settings.max_running * 2,
        max_queued_requests=settings.max_waiting * max(most, 1),
        graceful_shutdown_timeout_s=settings.shutdown_grace_seconds,
        graceful_shutdown_wait_loop_s=1.0,
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        request_router_config=router(
            request_router_class=PrefixAffinityRouter,
            request_router_kwargs={"imbalanced_threshold": imbalanced_threshold},
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
        ),
        **scaling,
    )
    desired = int(autoscaling_config.get("min_replicas", 1)) if autoscaling_config else replicas
    front = deployment(
        FrontDeployment,
        name=FRONT,
        num_replicas=1,
        ray_actor_options={"num_cpus": 0, "resources": dict(front_resources or {})},
        max_ongoing_requests=settings.max_connections,
        graceful_shutdown_timeout_s=settings.shutdown_grace_seconds,
    )
    return front.bind(values, engines.bind(values), desired)


def app_builder(args: dict[str, Any]) -> Any:
    """For Serve config files: ``import_path: specserve.rayserve.app:app_builder``."""
    settings = load_settings(overrides=args.get("settings") or {})
    return build_application(
        settings,
        replicas=int(args.get("replicas", 2)),
        autoscaling_config=args.get("autoscaling_config"),
        imbalanced_threshold=int(args.get("imbalanced_threshold", 4)),
        front_resources=args.get("front_resources"),
    )


def run(settings: Settings) -> int:
    """``specserve serve --replicas N``: start (or join) Ray, run the application until SIGTERM or SIGINT."""
    import ray

    ray.init(address=settings.ray_address or None, include_dashboard=False, log_to_driver=True)
    serve.start(http_options={"host": settings.host, "port": settings.port})
    stop: list[int] = []  # a plain flag: Event.set from a signal handler can deadlock the waiting thread
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _: stop.append(signum))
    try:
        serve.run(build_application(settings, replicas=settings.replicas), name=APP_NAME, route_prefix="/")
        log.info(
            "serving %d replicas on http://%s:%d (pid %d)", settings.replicas, settings.host, settings.port,
            os.getpid(),
        )  # fmt: skip
        while not stop:
            time.sleep(STOP_POLL_S)
        # Graceful: Serve stops routing new requests to the replicas, waits for the ones in flight (up to
        # shutdown_grace_seconds), then stops them.
        log.info("stopping: draining in-flight requests")
        serve.delete(APP_NAME)
    finally:
        serve.shutdown()  # type: ignore[no-untyped-call]
        ray.shutdown()
    return 0
