"""Host-tier blobs and glibc's heap: large blocks get their own mappings, so freed KV goes back to the OS.

The prefix cache's host tier keeps KV blobs of 3-30 MB each in an LRU and replaces them all the time.
glibc serves an allocation from the heap unless it is above the mmap threshold, and raises that threshold
(up to 32 MB) whenever a mapped block is freed — so after the first evictions every blob lands in the heap,
and blobs of changing sizes fragment it. The hour-long soak showed it: once the 1 GiB tier was full, resident
memory rose another 385 MiB over nine minutes before levelling off, with the Python heap flat. The same churn
in a bare process (tests/engine/test_host_memory.py, a 128 MiB tier) holds 94 MiB over the tier with the
default policy and 38 MiB with a fixed threshold.
A fixed threshold (which also turns glibc's adjustment off) keeps every blob in a mapping of its own. 4 MiB
sits above the engine's per-step arrays (a row of logits is 0.6 MB), which stay in the heap as before.
"""

from __future__ import annotations

import ctypes
import logging
import platform

log = logging.getLogger("specserve.prefix_cache")

M_MMAP_THRESHOLD = -3  # malloc.h
BLOB_MMAP_THRESHOLD = 4 << 20


def map_large_blocks(threshold: int = BLOB_MMAP_THRESHOLD) -> bool:
    """Make glibc serve allocations of ``threshold`` bytes or more from their own mappings; False where the
    C library is not glibc (others have their own policies) or refuses."""
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        done = bool(ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):
        return False
    if not done:
        log.warning(
            "glibc refused mallopt(M_MMAP_THRESHOLD, %d): host-tier churn may fragment the heap", threshold
        )
    return done
