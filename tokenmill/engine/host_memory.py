"""Host memory reuse: freed tensors' pages stay in the process for the next step's tensors.

glibc's malloc serves each allocation above its mmap threshold (128 KiB, raised on the fly up to
32 MiB) from fresh pages of its own mapping and unmaps them on free, and hands the heap's free
top back to the OS past its trim threshold. A long prefill chunk allocates activations of
megabytes per layer, so every step faulted its whole working set in again, page by page. With
both thresholds raised, malloc keeps the pages and hands them out again, the effect vLLM's CPU
backend gets by preloading tcmalloc (docs/benchmarks.md has the measured difference).

The price: the process's resident memory stays at its peak instead of shrinking after a burst.
"""

from __future__ import annotations

import ctypes

# mallopt's parameter numbers (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD_BYTES = 256 * 2**20
"""Allocations up to this size come from the heap: every activation and logits tensor of a step
(Gemma 3's 64 rows of 262,144 logits are 64 MiB), not only those under glibc's 32 MiB."""

TRIM_THRESHOLD_BYTES = 2**31 - 1
"""The most mallopt's int takes: free heap memory is kept unless over 2 GiB sits at its top."""

_applied = False


def reuse_freed_memory() -> bool:
    """Sets both thresholds, for the whole process and for good (there is no undoing it for one
    engine). False where the C library has no mallopt (not glibc): nothing changes there."""
    global _applied
    if _applied:
        return True
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    _applied = bool(
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
    return _applied
