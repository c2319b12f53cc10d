"""The torch verifier: the same tokens as the host verifier on random steps (greedy and sampled sequences
mixed, one-hot drafts and draft_probs, ties and banned tokens, bf16 and fp16 logits), hand-built greedy
cases, the pure tensor functions against their numpy counterparts, and losslessness on the torch path.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from specserve.request import SamplingParams  # noqa: E402
from specserve.verify import PLACEHOLDER_TOKEN_ID, VerifyRequest, filter_logits_to_probs, verifier_for  # noqa: E402
from specserve.verify import device_sampling as ds  # noqa: E402
from specserve.verify.device import TorchVerifier  # noqa: E402
from specserve.verify.host import HostVerifier  # noqa: E402
from specserve.verify.sampling import sample_inverse_cdf  # noqa: E402

from .test_rejection_statistics import Filters, assert_follows  # noqa: E402

P = PLACEHOLDER_TOKEN_ID
GREEDY = SamplingParams()
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
VOCABS = [2, 3, 5, 12, 50, 1000]


def random_knobs(rng: np.random.Generator, vocab: int) -> SamplingParams:
    """Greedy a third of the time, else a mix of temperature, top-k, top-p and min-p (often disabled)."""
    if rng.random() < 0.33:
        return GREEDY
    return SamplingParams(
        temperature=float(rng.choice([0.05, 0.7, 1.0, 1.6])),
        top_k=int(rng.choice([0, 1, 2, 4, vocab - 1, vocab, vocab + 3])),
        top_p=float(rng.choice([1.0, 1.0, 0.3, 0.8, 0.95])),
        min_p=float(rng.choice([0.0, 0.0, 0.05, 0.3])),
        seed=1,
    )


def random_step(
    rng: np.random.Generator, vocab: int, torch_draft_probs: bool = False
) -> tuple[np.ndarray, list[VerifyRequest]]:
    """Logits of a step (float32, each request's k + 1 rows back to back; integer-valued for small
    vocabularies, so ties are common; some -inf) and its requests: 0..6 drafts, often the argmax."""
    logits_blocks, requests = [], []
    for _ in range(int(rng.integers(1, 9))):
        k = int(rng.integers(0, 7))
        logits = rng.normal(size=(k + 1, vocab)) * 2.0
        if vocab <= 12:
            logits = np.round(logits)
        logits[rng.random(logits.shape) < 0.15] = -np.inf
        logits[np.arange(k + 1), rng.integers(0, vocab, k + 1)] = 0.5  # a finite logit in every row
        logits_blocks.append(logits.astype(np.float32))
        choices = logits[:k].argmax(axis=1)
        drafts = [int(c) if rng.random() < 0.6 else int(rng.integers(vocab)) for c in choices]
        draft_probs: Any = rng.dirichlet(np.full(vocab, 0.5), size=k) if rng.random() < 0.5 else None
        if draft_probs is not None and torch_draft_probs:
            draft_probs = torch.from_numpy(draft_probs)
        accept = rng.random(k) if draft_probs is not None else None
        requests.append(
            VerifyRequest(drafts, random_knobs(rng, vocab), draft_probs, accept, rng.random(k + 1))
        )
    return np.concatenate(logits_blocks), requests


def host_requests(requests: list[VerifyRequest]) -> list[VerifyRequest]:
    """The same requests with draft_probs as float64 numpy arrays, for the host verifier."""
    return [
        r if r.draft_probs is None else replace(r, draft_probs=r.draft_probs.double().cpu().numpy())
        for r in requests
    ]


# --- the torch verifier equals the host verifier ------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(36))
def test_a_random_step_equals_the_host_verifier(seed: int, device: str) -> None:
    rng = np.random.default_rng(seed)
    logits, requests = random_step(rng, VOCABS[seed % len(VOCABS)])
    expected = HostVerifier().verify(logits, requests)
    assert TorchVerifier().verify(torch.from_numpy(logits).to(device), requests) == expected


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("seed", range(12))
def test_half_precision_logits_equal_the_host_verifier_on_their_float32_values(seed: int, dtype: str) -> None:
    rng = np.random.default_rng(100 + seed)
    logits, requests = random_step(rng, VOCABS[seed % len(VOCABS)])
    half = torch.from_numpy(logits).to(getattr(torch, dtype))
    expected = HostVerifier().verify(half.float().numpy(), requests)
    assert TorchVerifier().verify(half, requests) == expected


@pytest.mark.parametrize("seed", range(8))
def test_draft_probs_as_tensors(seed: int) -> None:
    rng = np.random.default_rng(200 + seed)
    logits, requests = random_step(rng, VOCABS[seed % len(VOCABS)], torch_draft_probs=True)
    if seed % 2:  # float32 draft probabilities are read as float64: the host sees the same values
        requests = [
            r if r.draft_probs is None else replace(r, draft_probs=r.draft_probs.float()) for r in requests
        ]
    expected = HostVerifier().verify(logits, host_requests(requests))
    assert TorchVerifier().verify(torch.from_numpy(logits), requests) == expected


def test_a_step_of_only_sampled_or_only_greedy_requests_and_an_empty_step() -> None:
    rng = np.random.default_rng(5)
    for params in (SamplingParams(temperature=0.9, top_k=3), GREEDY):
        logits = rng.normal(size=(7, 9)).astype(np.float32)
        requests = [VerifyRequest([1, 2], params, None, None, rng.random(3)) for _ in range(2)]
        requests.append(VerifyRequest([], params, None, None, rng.random(1)))
        expected = HostVerifier().verify(logits, requests)
        assert TorchVerifier().verify(torch.from_numpy(logits), requests) == expected
    assert TorchVerifier().verify(torch.zeros((0, 9)), []) == []


# --- greedy, by hand ---------------------------------------------------------------------------------------


def logits_choosing(choices: list[int], vocab: int = 10) -> Any:
    """[len(choices), vocab] float32 logits whose argmax at row i is choices[i]; the others tie below."""
    logits = torch.zeros((len(choices), vocab))
    logits[torch.arange(len(choices)), torch.tensor(choices)] = 3.0
    logits[:, -1] = -torch.inf
    return logits


def test_greedy_requests_emit_the_accepted_prefix_and_the_bonus_or_recovered_token() -> None:
    drafts_and_choices = [  # the drafts, and the argmax of each of the request's rows
        ([4, 7, 2], [4, 7, 2, 8]),  # all accepted, then the bonus token 8
        ([4, 7, 2], [4, 7, 5, 1]),  # draft 2 rejected: the recovered token 5
        ([], [6]),  # a plain step
        ([3, 3], [1, 3, 6]),  # rejected at once, though the second draft agrees
        ([6], [6, 0]),  # accepted, then the bonus token 0
    ]
    requests = [VerifyRequest(drafts, GREEDY) for drafts, _ in drafts_and_choices]
    choices = [choice for _, row_choices in drafts_and_choices for choice in row_choices]
    emitted = TorchVerifier().verify(logits_choosing(choices), requests)
    assert emitted == [[4, 7, 2, 8], [4, 7, 5], [6], [1], [6, 0]]


def test_greedy_ties_go_to_the_lowest_id() -> None:
    logits = torch.zeros((3, 100_000), dtype=torch.bfloat16)
    logits[0, [7, 50_000, 99_999]] = 1.0
    logits[1, 99_998:] = 1.0
    logits[2, :] = -torch.inf
    logits[2, [3, 4]] = -1.0
    assert ds.greedy_argmax(logits).tolist() == [7, 99_998, 3]
    requests = [VerifyRequest([7], GREEDY), VerifyRequest([], GREEDY)]
    assert TorchVerifier().verify(logits, requests) == [[7, 99_998], [3]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_cpu_argmax_through_numpy_is_torchs(dtype: Any) -> None:
    """On the CPU the argmax goes through numpy (torch's is 10-30x slower there): same ids, ties and NaN
    included, on a strided view as on contiguous rows."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randint(-3, 4, (9, 1_000), generator=generator).to(dtype)  # many ties
    logits[4, 17] = torch.nan
    wide = torch.cat([logits, logits], dim=1)[:, ::2]  # a strided view
    for rows in (logits, wide, logits[2:5]):
        assert ds.greedy_argmax(rows).tolist() == torch.argmax(rows, dim=-1).tolist()
    assert ds.greedy_argmax(logits).dtype == torch.int64


# --- the pure tensor functions against numpy ----------------------------------------------------------------


@pytest.mark.parametrize("vocab", [2, 5, 12, 300])
def test_filtering_with_per_row_knobs_equals_numpy_row_by_row(vocab: int) -> None:
    rng = np.random.default_rng(vocab)
    logits = np.round(rng.normal(size=(40, vocab)) * 2).astype(np.float32)
    logits[rng.random(logits.shape) < 0.1] = -np.inf
    logits[:, 0] = 0.0
    knobs = [random_knobs(rng, vocab) for _ in range(40)]
    knobs = [k if not k.greedy else SamplingParams(temperature=1.0) for k in knobs]
    out = ds.filter_logits_to_probs(
        torch.from_numpy(logits),
        torch.tensor([k.temperature for k in knobs], dtype=torch.float64),
        torch.tensor([k.top_k for k in knobs]),
        torch.tensor([k.top_p for k in knobs], dtype=torch.float64),
        torch.tensor([k.min_p for k in knobs], dtype=torch.float64),
    )
    assert out.dtype == torch.float64
    expected = np.concatenate(
        [
            filter_logits_to_probs(logits[i : i + 1], k.temperature, k.top_k, k.top_p, k.min_p)
            for i, k in enumerate(knobs)
        ]
    )
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-12, atol=1e-300)
    assert np.array_equal(out.numpy() == 0, expected == 0), "the same tokens must be filtered out"


def test_filtering_without_rank_filters_skips_the_sort_with_the_same_result() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, -torch.inf], [3.0, 3.0, 0.0, 1.0]])
    knobs = (torch.tensor([1.0, 0.5], dtype=torch.float64), torch.tensor([0, 0]))
    off = (torch.ones(2, dtype=torch.float64), torch.tensor([0.0, 0.2], dtype=torch.float64))
    with_sort = ds.filter_logits_to_probs(logits, *knobs, *off)
    without = ds.filter_logits_to_probs(logits, *knobs, *off, rank_filters=False)
    assert torch.equal(with_sort, without)


def test_inverse_cdf_equals_numpy_and_marks_rows_without_mass() -> None:
    rng = np.random.default_rng(3)
    probs = rng.random((200, 7)) * (rng.random((200, 7)) < 0.6)
    probs[0] = [0, 0.5, 0, 0.5, 0, 0, 0]
    uniforms = rng.random(200)
    uniforms[0] = 1.0  # outside the contract: the guard returns the last nonzero token
    usable = probs.sum(axis=1) > 0
    tokens = ds.sample_inverse_cdf(torch.from_numpy(probs), torch.from_numpy(uniforms)).numpy()
    assert tokens[0] == 3
    assert np.array_equal(tokens[usable], sample_inverse_cdf(probs[usable], uniforms[usable]))
    assert np.all(tokens[~usable] == P)
    nan_row = ds.sample_inverse_cdf(torch.full((1, 4), torch.nan, dtype=torch.float64), torch.zeros(1))
    assert nan_row.tolist() == [P]


# --- checks, registration, lazy import ----------------------------------------------------------------------


def test_bad_requests_raise_like_the_host_verifier() -> None:
    logits = torch.zeros((3, 12))
    hot = SamplingParams(temperature=1.0)
    u = np.full(3, 0.5)
    cases = [
        ([VerifyRequest([1, 2, 3], GREEDY)], "3 rows"),
        ([VerifyRequest([1, 2], hot)], "sample uniforms"),
        ([VerifyRequest([1, 12], GREEDY)], "draft token ids"),
        ([VerifyRequest([1, 2], hot, np.full((2, 12), 1 / 12), None, u)], "accept_uniforms"),
        ([VerifyRequest([1, 2], hot, np.full((2, 11), 1 / 11), u[:2], u)], "draft_probs must have shape"),
        ([VerifyRequest([1, 2], hot, None, None, u[:2])], "sample_uniforms must have shape"),
    ]
    for requests, message in cases:
        with pytest.raises(ValueError, match=message):
            TorchVerifier().verify(logits, requests)
    banned = torch.full((1, 12), -torch.inf)  # no finite logit: nothing to sample from
    with pytest.raises(ValueError, match="request 0: every row of probs needs a positive sum"):
        TorchVerifier().verify(banned, [VerifyRequest([], hot, None, None, u[:1])])


@pytest.mark.parametrize("device", ["torch", "torch:cpu", "torch:cuda"])
def test_the_torch_verifier_is_registered(device: str) -> None:
    assert isinstance(verifier_for(device), TorchVerifier)


def test_importing_the_verifiers_loads_no_torch() -> None:
    code = (
        "import sys, specserve.verify as v; v.verifier_for('cpu'); "
        "assert 'torch' not in sys.modules and 'specserve.verify.device' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --- losslessness on the torch path -------------------------------------------------------------------------

CONTEXT_TOKEN = 0


def torch_speculative_step(
    chain_logits: np.ndarray,  # [vocab, vocab] float32: the target's logits after each token
    filters: Filters,
    draft_chain: np.ndarray
    | None,  # [vocab, vocab] float64: the drafter's distributions; None: one-hot drafts
    max_k: int,
    context: np.ndarray,  # [n] int64: each trial's previous token
    rng: np.random.Generator,
) -> list[list[int]]:
    """Draft 0..max_k tokens after each context token (a Markov chain stands in for the models) and verify
    all trials in one TorchVerifier call."""
    n, vocab = context.size, chain_logits.shape[0]
    prefix = np.empty((n, max_k + 1), dtype=np.int64)  # prefix[:, j]: the token before output position j
    prefix[:, 0] = context
    for j in range(max_k):
        if draft_chain is not None:
            prefix[:, j + 1] = sample_inverse_cdf(draft_chain[prefix[:, j]], rng.random(n))
        else:  # a model-free drafter: half the time the target's argmax, otherwise any token
            guess = chain_logits[prefix[:, j]].argmax(axis=1)
            prefix[:, j + 1] = np.where(rng.random(n) < 0.5, guess, rng.integers(0, vocab, n))
    num_draft = rng.integers(0, max_k + 1, n)
    params = SamplingParams(filters.temperature, filters.top_k, filters.top_p, filters.min_p, seed=0)
    requests = [
        VerifyRequest(
            prefix[b, 1 : k + 1].tolist(),
            params,
            None if draft_chain is None else torch.from_numpy(draft_chain[prefix[b, :k]]),
            None if draft_chain is None else rng.random(k),
            rng.random(k + 1),
        )
        for b, k in enumerate(num_draft)
    ]
    rows = np.concatenate([prefix[b, : k + 1] for b, k in enumerate(num_draft)])
    return TorchVerifier().verify(torch.from_numpy(chain_logits[rows]), requests)


def check_lossless(vocab: int, max_k: int, mode: str, filters: Filters, trials: int, max_tv: float) -> None:
    """The first emitted token, and the pair of the first two, follow the exact filtered target chain."""
    rng = np.random.default_rng(1)
    chain_logits = (rng.standard_normal((vocab, vocab)) * 1.2).astype(np.float32)
    settings = (filters.temperature, filters.top_k, filters.top_p, filters.min_p)
    target_chain = filter_logits_to_probs(chain_logits, *settings)
    assert np.count_nonzero(target_chain[CONTEXT_TOKEN]) >= 5, "the filters should leave several tokens"
    draft_logits = chain_logits + 0.8 * rng.standard_normal((vocab, vocab)).astype(np.float32)
    draft_chain = {"draft_model": filter_logits_to_probs(draft_logits, *settings), "one_hot": None}[mode]
    step = (chain_logits, filters, draft_chain, max_k)
    emitted = torch_speculative_step(*step, np.full(trials, CONTEXT_TOKEN), rng)
    first = np.array([tokens[0] for tokens in emitted])
    one_token = np.array([len(tokens) == 1 for tokens in emitted])
    second = np.array([tokens[1] if len(tokens) > 1 else 0 for tokens in emitted])
    second[one_token] = [tokens[0] for tokens in torch_speculative_step(*step, first[one_token], rng)]
    assert_follows(first, target_chain[CONTEXT_TOKEN], max_tv)
    pair_probs = target_chain[CONTEXT_TOKEN][:, None] * target_chain
    assert_follows(first * vocab + second, pair_probs.ravel(), max_tv)


@pytest.mark.parametrize("mode", ["draft_model", "one_hot"])
def test_the_torch_path_is_lossless(mode: str) -> None:
    check_lossless(8, 3, mode, Filters(temperature=0.8, top_k=6, top_p=0.9, min_p=0.02), 12_000, max_tv=0.04)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["draft_model", "one_hot"])
def test_the_torch_path_is_lossless_long(mode: str) -> None:
    check_lossless(12, 6, mode, Filters(temperature=1.1, top_k=10, top_p=0.95, min_p=0.02), 200_000, 0.01)
