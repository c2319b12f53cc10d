"""Speculative-decoding verification: pure functions over padded arrays.

Terms used throughout: *accepted tokens* are the draft tokens the target keeps (a prefix of the drafts); the
*recovered token* is the token the target emits at the first rejected position; the *bonus token* is the extra
token sampled from the target after the last draft position when every draft was accepted. Each verified row
emits its accepted tokens plus exactly one recovered or bonus token.
"""

from specserve.verify.greedy import verify_greedy
from specserve.verify.rejection import verify_rejection
from specserve.verify.sampling import (
    filter_logits_to_probs,
    greedy_argmax,
    probs_from_params,
    sample_inverse_cdf,
)
from specserve.verify.types import PLACEHOLDER_TOKEN_ID, VerifyResult

__all__ = [
    "PLACEHOLDER_TOKEN_ID",
    "VerifyResult",
    "filter_logits_to_probs",
    "greedy_argmax",
    "probs_from_params",
    "sample_inverse_cdf",
    "verify_greedy",
    "verify_rejection",
]
