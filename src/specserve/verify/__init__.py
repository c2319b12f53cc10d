"""Speculative-decoding verification: pure functions over padded arrays, and the verifiers built on them.

Terms used throughout: *accepted tokens* are the draft tokens the target keeps (a prefix of the drafts); the
*recovered token* is the token the target emits at the first rejected position; the *bonus token* is the extra
token sampled from the target after the last draft position when every draft was accepted. Each verified row
emits its accepted tokens plus exactly one recovered or bonus token.

A :class:`Verifier` works where the logits are: :class:`~specserve.verify.host.HostVerifier` on numpy arrays
(llama.cpp); :class:`~specserve.verify.device.TorchVerifier` on torch tensors on any device (its tensor
functions in verify/device.py and verify/device_sampling.py), with the same tokens, returning only the emitted
ids. ``verifier_for`` picks one by the runtime's ``logits_device`` (``cpu``, or ``torch``, ``torch:cuda``, …),
importing it only then: importing this package never loads torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from specserve.verify.greedy import verify_greedy, verify_greedy_choices
from specserve.verify.rejection import verify_rejection
from specserve.verify.sampling import (
    filter_logits_to_probs,
    greedy_argmax,
    probs_from_params,
    sample_inverse_cdf,
)
from specserve.verify.types import PLACEHOLDER_TOKEN_ID, Verifier, VerifyRequest, VerifyResult

VERIFIERS: dict[str, str] = {
    "cpu": "specserve.verify.host:HostVerifier",
    "torch": "specserve.verify.device:TorchVerifier",
}
"""``RuntimeInfo.logits_device`` before any ``:`` → ``module:class`` of the verifier that works there."""


def verifier_for(device: str) -> Verifier[Any]:
    """The verifier for logits on ``device``: ``cpu``, numpy arrays on the host; ``torch`` or
    ``torch:<device>`` (``torch:cuda``, ``torch:cpu``), torch tensors wherever they are."""
    target = VERIFIERS.get(device.split(":")[0])
    if target is None:
        raise ValueError(f"no verifier for logits on {device!r}; known: {', '.join(VERIFIERS)}")
    module, name = target.split(":")
    verifier: Verifier[Any] = getattr(importlib.import_module(module), name)()
    return verifier


__all__ = [
    "PLACEHOLDER_TOKEN_ID",
    "VERIFIERS",
    "Verifier",
    "VerifyRequest",
    "VerifyResult",
    "filter_logits_to_probs",
    "greedy_argmax",
    "probs_from_params",
    "sample_inverse_cdf",
    "verifier_for",
    "verify_greedy",
    "verify_greedy_choices",
    "verify_rejection",
]
