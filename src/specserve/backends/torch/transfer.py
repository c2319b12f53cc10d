"""Host→device copies that never make the host wait.

On CUDA a copy from pageable host memory waits for the stream first (the driver stages it through pinned
memory), so an index or knob array uploaded while the forward pass runs stalls the host until the pass is
over: the host can no longer prepare the next work while the device computes. Here arrays are packed per
dtype into one flat host array, pinned, and copied with ``non_blocking``: one copy per dtype, queued behind
the pass, and the host goes on. torch's caching host allocator keeps a pinned block until the copies that
read it are done, so the host array may be dropped at once. On a CPU the copies are views of the host
arrays. The step's one wait is then the verifier's read of its results (verify/device.py).

Example: ``upload({"rows": rows_i64, "ids": ids_i64, "counts": counts_f32}, device)`` makes two copies
(int64 and float32) and returns three tensors of the arrays' shapes and dtypes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt
import torch


def upload(arrays: Mapping[str, npt.ArrayLike], device: torch.device) -> dict[str, torch.Tensor]:
    """Each array on ``device`` (its own shape and dtype), in one non-blocking copy per dtype."""
    host = {name: np.asarray(a) for name, a in arrays.items()}
    by_dtype: dict[np.dtype[Any], list[str]] = {}
    for name, array in host.items():
        by_dtype.setdefault(array.dtype, []).append(name)
    out: dict[str, torch.Tensor] = {}
    for names in by_dtype.values():
        flat = upload_array(np.concatenate([host[n].ravel() for n in names]), device)
        parts = torch.split(flat, [host[n].size for n in names])
        out |= {n: part.view(host[n].shape) for n, part in zip(names, parts, strict=True)}
    return {name: out[name] for name in host}


def upload_array(array: npt.ArrayLike, device: torch.device) -> torch.Tensor:
    """One array on ``device``: pinned and copied non-blocking on CUDA, a view of it on a CPU."""
    staged = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cuda":
        staged = staged.pin_memory()
    return staged.to(device, non_blocking=True)
