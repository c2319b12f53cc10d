"""The host-overhead harness measures what it says: on the null runtime every draft is accepted, each
phase is booked, and the forward pass is kept out of the host time."""

from __future__ import annotations

import pytest
from bench_env import isolated_env  # noqa: F401  (autouse)

from benchmarks import host_steps
from benchmarks.host_overhead import paired_ratio, runtimes
from support.tiny_models import TinyModels


@pytest.mark.parametrize("draft_tokens", [0, 4])
def test_the_null_runtime_steps_are_all_accepted_and_booked(
    tiny_models: TinyModels, draft_tokens: int
) -> None:
    made, prompt = runtimes(tiny_models.target, 4)
    null = dict(made)["null-numpy"]
    times = host_steps.measure(null, "null", 3, draft_tokens, prompt, steps=10, warmup=5)
    row = times.row()
    assert row["tokens_per_step"] == 3 * (draft_tokens + 1)  # every draft accepted, every sequence emits
    assert row["host_us"] == pytest.approx(row["step_us"] - row["forward_us"], abs=0.2)
    phases = sum(row[f"{p}_us"] for p in host_steps.PHASES)
    assert phases == pytest.approx(row["step_us"], rel=1e-3, abs=0.5)
    assert row["verify_us"] > 0 and row["commit_us"] > 0
    made[-1][1].close()


def test_the_ratio_to_llama_server_pairs_each_round_with_its_own() -> None:
    # The machine is twice as fast in rounds 2 and 4: each round's pair shares it, so every ratio is 0.8;
    # a ratio of the two medians (4,000 / 8,000) would read 0.5.
    ours = [3200.0, 6400.0, 3200.0, 6400.0, 3200.0]
    peer = [4000.0, 8000.0, 4000.0, 8000.0, 8000.0]
    ratio = paired_ratio(ours, peer)
    assert ratio["median"] == pytest.approx(0.8)
    assert ratio["q1"] == pytest.approx(0.6)  # the one round where only the peer ran fast
    assert paired_ratio([], []) == {}
