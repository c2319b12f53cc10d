"""DFlash2 block drafting on the torch runtime: one forward drafts a whole block from the target's hidden
states (``backends/torch/dflash2.py`` has the network, ``dflash2_files.py`` the checkpoints).

Context: the target runtime captures the outputs of the layers the checkpoint names for every row it
evaluates; the engine reports which rows became committed tokens (``committed``: a prompt chunk's rows, a
verify chunk's pending token and accepted drafts). Their features wait here and are projected into the
drafter's own KV cache at the next proposal, once per token; the block's rows never enter that cache, so
rollback costs nothing. A token the target never evaluated (a prompt prefix served from the prefix cache)
has no features: the context then starts after it.

Drafting: one batched forward over ``[anchor, MASK × (B − 1)]`` per sequence, the anchor being the last
committed token (the one the target evaluates first in the next verify). The target's LM head runs only
on the positions asked for (the policy may cut a block short), and the selector walks their top-K
candidates: greedy takes the best path; sampling draws from the softmax of each position's scores with the
request's draft uniforms and hands that distribution (zero outside the K candidates) to the verifier, so
rejection sampling stays lossless.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from specserve.backends.base import BackendError
from specserve.backends.torch.dflash2 import BlockDrafterNet, TargetFeatures
from specserve.backends.torch.kv_cache import KVCache
from specserve.backends.torch.transfer import upload
from specserve.drafters.base import Drafter, DrafterError, DraftOption, Proposal
from specserve.drafters.dflash2_walk import walk
from specserve.drafters.registry import DrafterContext
from specserve.request import DRAFT_STREAM
from specserve.sequence import Sequence

PENDING_ROWS = 512
"""Committed rows whose features may wait for the next proposal; more are projected at once (bounds the
memory a long prompt's features hold when the policy does not draft)."""


@dataclass
class _Context:
    start: int = 0  # the drafter cache holds context keys of positions [start, end) in the slot
    end: int = 0
    pending: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (first position, features)


class BlockDrafter(Drafter):
    """Proposes DFlash2 (or DFlash) blocks for every sequence it is asked to, in one forward."""

    name = "dflash2"
    reads_target_states = True

    def __init__(self, target: Any, net: BlockDrafterNet, block_size: int | None = None,
                 top_k: int | None = None) -> None:  # fmt: skip
        """``target``: the torch runtime the drafter reads (its embedding, LM head and hidden states).
        ``block_size`` / ``top_k``: override the checkpoint's ``block_size`` / ``selector_top_k``."""
        c = net.config
        self.target, self.net = target, net
        self.block_size = block_size or c.block_size
        if self.block_size < 2:
            raise DrafterError(f"draft_block_size {self.block_size}: a block drafts at least one token")
        if net.candidate_selector is not None and top_k is not None:
            if not 1 <= top_k <= c.vocab_size:
                raise DrafterError(f"candidate_topk {top_k} must be in [1, {c.vocab_size}]")
            net.candidate_selector.top_k = top_k
        self.top_k = net.candidate_selector.top_k if net.candidate_selector is not None else 0
        self.features = TargetFeatures(target.model, c.target_layer_ids)
        target.capture_layers = self.features.capture
        info = target.info
        self.cache = KVCache(
            num_layers=c.num_layers,
            num_slots=info.max_sequences,
            positions=info.context_per_sequence,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            dtype=target.dtype,
            device=target.device,
        )
        self._seconds: dict[int, float] = {}  # measured seconds of one proposal per sequence, by length

    # -- context ------------------------------------------------------------------------------------

    def begin(self, seq: Sequence) -> None:
        seq.drafter_state[self.name] = _Context()

    def _context(self, seq: Sequence) -> _Context:
        state = seq.drafter_state.get(self.name)
        if not isinstance(state, _Context):
            state = seq.drafter_state[self.name] = _Context()
        return state

    def committed(self, seq: Sequence, chunk: int, start: int, count: int) -> None:
        hidden = self.target.hidden
        if hidden is None or count <= 0:
            return
        state = self._context(seq)
        waiting = sum(f.shape[0] for _, f in state.pending)
        if start != state.end + waiting or (state.end == state.start and not waiting):
            # A gap (positions the target did not evaluate) or the first rows: the context starts here.
            state.start = state.end = start
            state.pending.clear()
            waiting = 0
        state.pending.append((start, self.features(hidden[chunk][:count])))
        if waiting + count > PENDING_ROWS and seq.slot >= 0:
            with torch.inference_mode():
                self._project(seq.slot, state)

    def _project(self, slot: int, state: _Context) -> None:
        for first, features in state.pending:
            self.net.write_context(self.cache, slot, first, features)
            state.end = first + features.shape[0]
        state.pending.clear()

    # -- drafting -----------------------------------------------------------------------------------

    def available(self, seq: Sequence, limit: int) -> DraftOption:
        state = self._context(seq)
        has_context = state.end > state.start or bool(state.pending)
        return DraftOption(
            min(limit, self.block_size - 1) if has_context else 0, bucket=f"block{self.block_size}"
        )

    def propose(self, seqs: Seq[Sequence], num_tokens: Seq[int]) -> list[Proposal]:
        active = [i for i, k in enumerate(num_tokens) if k > 0]
        proposals = [Proposal([]) for _ in seqs]
        if not active:
            return proposals
        started = time.perf_counter()
        try:
            with torch.inference_mode():
                drafted = self._draft([seqs[i] for i in active], [num_tokens[i] for i in active])
        except (BackendError, RuntimeError, IndexError, ValueError) as exc:
            raise DrafterError(f"dflash2 failed: {exc}") from exc
        for i, proposal in zip(active, drafted, strict=True):
            proposals[i] = proposal
        k = max(num_tokens[i] for i in active)
        per_sequence = (time.perf_counter() - started) / len(active)
        old = self._seconds.get(k)
        self._seconds[k] = per_sequence if old is None else 0.9 * old + 0.1 * per_sequence
        return proposals

    def _draft(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Proposal]:
        spans = []
        for seq in seqs:
            state = self._context(seq)
            self._project(seq.slot, state)
            spans.append((state.start, state.end))
        k = max(num_tokens)
        temperatures = np.array([0.0 if s.params.greedy else s.params.temperature for s in seqs], np.float32)
        uniforms = np.zeros((len(seqs), k), np.float64)
        for row, seq in enumerate(seqs):
            if not seq.params.greedy:
                uniforms[row] = seq.uniforms.take(DRAFT_STREAM, len(seq.output_ids), k)
        anchors = [seq.tokens[-1] for seq in seqs]
        positions = [seq.num_tokens - 1 for seq in seqs]
        tokens, q, candidates = self._block(
            anchors, [s.slot for s in seqs], spans, positions, k, temperatures, uniforms
        )
        # The one wait of a proposal: the drafted ids and whether q is finite, in one transfer.
        finite = (
            torch.isfinite(q).all()
            if q is not None
            else torch.ones((), dtype=torch.bool, device=tokens.device)
        )
        *flat, finite_flag = torch.cat([tokens.reshape(-1), finite.to(tokens.dtype)[None]]).tolist()
        if not finite_flag:
            raise DrafterError("dflash2 produced non-finite draft probabilities")
        host_tokens = [flat[row * k : (row + 1) * k] for row in range(len(seqs))]
        proposals = []
        for row, (seq, n) in enumerate(zip(seqs, num_tokens, strict=True)):
            probs = None
            if not seq.params.greedy and q is not None:
                probs = self._dense(q[row, :n], None if candidates is None else candidates[row, :n])
            proposals.append(Proposal(host_tokens[row][:n], probs))
        return proposals

    def _block(
        self,
        anchors: list[int],
        slots: list[int],
        spans: list[tuple[int, int]],
        positions: list[int],
        k: int,
        temperatures: npt.NDArray[np.float32],  # [S] (0: greedy)
        uniforms: npt.NDArray[np.float64],  # [S, k]
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """One block forward for S sequences, the head on its first ``k`` drafted positions, the walk."""
        c, device = self.net.config, self.target.device
        ids_host = np.full((len(anchors), self.block_size), c.mask_token_id, dtype=np.int64)
        ids_host[:, 0] = anchors
        inputs = upload({"ids": ids_host, "temperatures": temperatures, "uniforms": uniforms}, device)
        ids = inputs["ids"]
        embeddings = self.target.model.embed_tokens(ids) * c.input_embedding_scale
        hidden = self.net(embeddings, self.cache, slots, spans, positions)[:, 1 : 1 + k]
        logits = self.net.logits(hidden, self.target.model.lm_head)
        sampling = bool((temperatures > 0).any())  # on the host: the walk never asks the device
        return walk(self.net, hidden, logits, ids[:, 0], inputs["temperatures"], inputs["uniforms"], sampling)

    def measure(self, context_tokens: int = 32, repeats: int = 3) -> dict[int, float]:
        """Time one proposal (greedy, one sequence, a short context on the cache's scratch slot) for the
        shortest and the longest block cut: the policy's prices before real proposals refine them."""
        slot = self.cache.scratch_slot
        features = torch.zeros(
            context_tokens, len(self.net.config.target_layer_ids) * self.net.config.hidden_size,
            dtype=self.target.dtype, device=self.target.device,
        )  # fmt: skip
        with torch.inference_mode():
            self.net.write_context(self.cache, slot, 0, features)
            for k in sorted({1, self.block_size - 1}):
                times = []
                for _ in range(repeats):
                    started = time.perf_counter()
                    tokens, _, _ = self._block(
                        [0],
                        [slot],
                        [(0, context_tokens)],
                        [context_tokens],
                        k,
                        np.zeros(1, np.float32),
                        np.zeros((1, k)),
                    )
                    tokens.tolist()
                    times.append(time.perf_counter() - started)
                self._seconds[k] = min(times)
        return dict(self._seconds)

    def _dense(self, q: torch.Tensor, candidates: torch.Tensor | None) -> torch.Tensor:
        """The draft distribution ``[n, vocab]`` float64 on the device: q over the candidates, 0 elsewhere,
        normalised as the draw normalised it."""
        q = q.double()
        q = q / q.sum(-1, keepdim=True)
        if candidates is None:
            return q
        dense = torch.zeros(q.shape[0], self.target.info.vocab_size, dtype=torch.float64, device=q.device)
        return dense.scatter_(1, candidates, q)

    def draft_seconds(self, num_sequences: int, num_tokens: int) -> float | None:
        """Measured per-sequence cost of a proposal of this length (the nearest length measured: at load,
        then every proposal), times the sequences."""
        if not self._seconds:
            return None
        nearest = min(self._seconds, key=lambda k: abs(k - num_tokens))
        return self._seconds[nearest] * num_sequences

    def release(self, seq: Sequence) -> None:
        state = seq.drafter_state.pop(self.name, None)
        if isinstance(state, _Context) and seq.slot >= 0:
            self.cache.free(seq.slot)

    def close(self) -> None:
        self.target.capture_layers = ()
        self.cache.release()


def build(context: DrafterContext) -> Drafter:
    from specserve.backends.torch.dflash2_files import load_block_drafter

    target: Any = context.target_runtime
    if context.block_drafter_path is None:
        raise DrafterError("the dflash2 drafter needs a DFlash2 checkpoint (--draft DIR), and none is given")
    if target is None or not hasattr(target, "capture_layers"):
        raise DrafterError(
            "the dflash2 drafter reads the target's hidden states: it needs the torch backend (--backend "
            "torch); llama.cpp does not expose them"
        )
    net = load_block_drafter(context.block_drafter_path, target.config, target.dtype, target.device)
    drafter = BlockDrafter(target, net, context.draft_block_size, context.candidate_topk)
    try:
        drafter.measure()
    except Exception:
        drafter.close()  # the target stops capturing hidden states nobody reads
        raise
    return drafter
