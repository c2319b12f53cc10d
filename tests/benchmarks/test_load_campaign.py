"""The misbehaving-clients load campaign (``benchmarks.load``), short, on the tiny pair.

The full campaign (64 clients, 10 minutes, the real pair) is ``scripts/reliability.sh``; its figures are in
docs/RELIABILITY.md. Here: 24 clients for 15 s with bursts past the queue, dropped and abandoned streams —
and afterwards nothing stuck, every request accounted for on both sides, greedy probes equal to solo runs.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from bench_env import isolated_env  # noqa: F401  (autouse)

from benchmarks.load import CampaignOptions, campaign
from server.process import start_server, stop_server
from support.tiny_models import TinyModels


def test_misbehaving_clients_lose_nothing(
    tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory
) -> None:
    server = start_server(
        tiny_models, tmp_path_factory.mktemp("load"), "--max-running", "2", "--max-waiting", "8",
        "--request-timeout", "20", "--ctx-size", "4096",
    )  # fmt: skip
    try:
        options = CampaignOptions(
            server.url, clients=24, duration=15.0, burst=30, burst_every=5.0, max_probes=20, seed=1
        )
        report = asyncio.run(campaign(options))
    finally:
        code = stop_server(server)
    audit = {k: v for k, v in report.items() if k not in ("client_outcomes", "duration_s", "clients")}
    assert report["passed"], json.dumps(audit)
    outcomes = report["client_outcomes"]
    assert outcomes.get("success", 0) > 20 and outcomes.get("rejected_429", 0) > 0
    assert outcomes.get("client_dropped", 0) + outcomes.get("client_abandoned", 0) > 0
    assert report["probes_checked"] > 0
    assert code == 0 and "Traceback" not in server.log()
