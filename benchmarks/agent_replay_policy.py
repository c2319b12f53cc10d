"""The agent traces replayed (benchmarks/agent_replay.py) under a variant of the cost policy, or with every
draft of one trace kind listed: how a change to the budget's rules would have drafted on a run already
recorded, free of the VM's noise.

    .venv/bin/python -m benchmarks.agent_replay_policy --report docs/bench/<dir>/agent-c1/report.json \
        --costs docs/bench/<dir>/costs-target-exact.json [--proof-ramp R] [--trace KIND] ...

``--proof-ramp R`` (an experiment, not the engine's rule): a trusted estimate (cost_policy.py) may risk a
draft of ``k`` tokens only once the request's own drafts with that drafter have had ``k / R`` tokens
accepted (its record as the policy keeps it, decayed per draft); above that the draft must fit the
request's headroom, as an untrusted one does. The two-draft proof still applies. ``--trace KIND`` adds
``"trace"`` to the output: each draft of that kind's requests, with its position in the answer, tokens
drafted and accepted, bucket, the calibrated per-token estimates it was priced with and their scale.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from benchmarks.agent_replay import (
    arguments,
    key_ms_argument,
    load_costs,
    print_result,
    recorded_turns,
    run,
)
from specserve.drafters.base import Drafter, DraftOption
from specserve.engine.cost_model import CostModel
from specserve.engine.cost_policy import SURE_BUCKETS, CostAwarePolicy, _Offer
from specserve.engine.draft_policy import AcceptanceTracker, DraftPlan, calibrated
from specserve.sequence import Sequence


@dataclasses.dataclass(frozen=True)
class _RampOffer(_Offer):
    own_accepted: float = 0.0
    """The request's own accepted draft tokens with this drafter (decayed as its record is)."""


class RampProofPolicy(CostAwarePolicy):
    """The engine's policy with ``--proof-ramp``: a trusted draft grows with the request's own accepted
    tokens."""

    def __init__(self, costs: CostModel, ramp: float) -> None:
        super().__init__(costs)
        self.ramp = ramp

    def _offer(self, seq: Sequence, drafter: Drafter, option: DraftOption) -> _Offer:
        offer = super()._offer(seq, drafter, option)
        own = AcceptanceTracker._seq_counts(seq).get(drafter.name)
        fields = {f.name: getattr(offer, f.name) for f in dataclasses.fields(_Offer)}
        return _RampOffer(**fields, own_accepted=0.0 if own is None else own.accepted)

    def _candidate(self, offer: _Offer, k: int, headroom: float, plain: bool) -> DraftPlan | None:
        assert isinstance(offer, _RampOffer)
        if offer.trusted and offer.option.bucket not in SURE_BUCKETS and k > self.ramp * offer.own_accepted:
            offer = dataclasses.replace(offer, trusted=False)
        return super()._candidate(offer, k, headroom, plain)


def traced(policy: CostAwarePolicy, trace: list[dict[str, Any]]) -> None:
    """Append each draft whose outcome ``policy`` is told to ``trace``."""
    observe = policy.observe

    def observed(seq: Sequence, plan: DraftPlan, num_accepted: int) -> None:
        trace.append({
            "request": seq.request_id, "position": len(seq.output_ids), "drafted": plan.num_tokens,
            "accepted": num_accepted, "bucket": plan.bucket, "scale": round(plan.scale, 3),
            "estimates": [round(p, 3) for p in calibrated(plan.token_probs, plan.scale)],
        })  # fmt: skip
        observe(seq, plan, num_accepted)

    policy.observe = observed  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> int:
    parser = arguments("python -m benchmarks.agent_replay_policy", __doc__.split("\n\n")[0])
    key_ms_argument(parser)
    parser.add_argument("--proof-ramp", type=float, default=0.0, help="0: the engine's own policy")
    parser.add_argument("--trace", default=None, help="list every draft of this trace kind")
    args = parser.parse_args(argv)
    costs = CostModel(load_costs(args.costs))
    policy = RampProofPolicy(costs, args.proof_ramp) if args.proof_ramp > 0 else CostAwarePolicy(costs)
    trace: list[dict[str, Any]] = []
    traced(policy, trace)
    turns = recorded_turns(parser, args)
    by_kind = run(args, policy, turns)
    extra = {}
    if args.trace:
        extra["trace"] = [d for d in trace if turns[int(d["request"])].kind == args.trace]
    print_result(args, by_kind, **extra)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
