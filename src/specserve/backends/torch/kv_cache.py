"""The KV cache of the torch runtime: preallocated at load, indexed by (slot, position).

One tensor each for K and V, ``[layers, slots + 1, positions, kv_heads, head_dim]``. A sequence owns one slot;
its token at position ``p`` lives at ``[:, slot, p]``, so a rejected draft is simply overwritten by the next
write there and rollback is a length change (gpt-fast). The extra last slot is scratch: the rows a
fixed-shape call pads with write there, never into a sequence.

Lengths are host integers; nothing here waits on the device.
"""

from __future__ import annotations

import io
from typing import Any

import torch


class KVCache:
    """K and V for ``num_slots`` sequences of up to ``positions`` tokens each, plus one scratch slot."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_slots: int,
        positions: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_layers, num_slots + 1, positions, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_slots = num_slots
        self.positions = positions
        self.scratch_slot = num_slots
        self.lengths = [0] * num_slots
        """Positions each slot holds (host-side bookkeeping: what ``truncate`` and ``free`` leave)."""

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    @property
    def bytes_per_token(self) -> int:
        """K and V of every layer for one position of one sequence."""
        layers, _, _, heads, head_dim = self.k.shape
        return 2 * layers * heads * head_dim * self.k.element_size()

    def wrote(self, slot: int, end: int) -> None:
        """A decode appended positions up to ``end`` of ``slot`` (it started at the slot's length)."""
        self.lengths[slot] = end

    def truncate(self, slot: int, length: int) -> None:
        self.lengths[slot] = min(self.lengths[slot], max(0, length))

    def free(self, slot: int) -> None:
        self.lengths[slot] = 0

    def copy(self, src: int, dst: int, length: int) -> None:
        """``dst`` holds the first ``length`` positions of ``src``."""
        length = min(length, self.lengths[src])
        self.k[:, dst, :length] = self.k[:, src, :length]
        self.v[:, dst, :length] = self.v[:, src, :length]
        self.lengths[dst] = length

    def save(self, slot: int) -> bytes:
        """The slot's K and V up to its length, serialized (for the prefix cache's host tier)."""
        n = self.lengths[slot]
        buffer = io.BytesIO()
        # A compact copy: torch.save of a view writes its whole storage (the entire cache, on a CPU).
        k, v = (t[:, slot, :n].to("cpu", copy=True).contiguous() for t in (self.k, self.v))
        torch.save({"k": k, "v": v}, buffer)
        return buffer.getvalue()

    def release(self) -> None:
        """Give the memory back; the bookkeeping stays readable (a closed runtime holds nothing)."""
        self.k = self.v = torch.empty(0)
        self.lengths = [0] * self.num_slots

    def load(self, slot: int, blob: bytes) -> int:
        """Restore a saved slot; 0 if the blob does not fit this cache (another model or dtype)."""
        try:
            saved: dict[str, Any] = torch.load(io.BytesIO(blob), weights_only=True)
            k, v = saved["k"], saved["v"]
        except Exception:
            return 0
        n = int(k.shape[1])
        expected = (self.k.shape[0], n, *self.k.shape[3:])
        if tuple(k.shape) != expected or tuple(v.shape) != expected or n > self.positions or n == 0:
            return 0
        if k.dtype != self.k.dtype:
            return 0
        self.k[:, slot, :n] = k.to(self.k.device)
        self.v[:, slot, :n] = v.to(self.v.device)
        self.lengths[slot] = n
        return n
