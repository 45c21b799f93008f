"""Keep the C heap's freed memory for the next step instead of giving it back to the kernel.

A step allocates and frees the same large arrays every time (tile lists, intersection gradients,
SSIM's maps, gradient sums: tens of MB at 50k Gaussians). glibc serves arrays above its mmap
threshold (dynamic, at most 32 MiB) with fresh mappings, and gives the top of the heap back once
more than its trim threshold is free; either way the next step's arrays are fresh pages, faulted
in one by one at first write while every thread of the process waits on the same lock. Raising
both thresholds once, at start-up, keeps that memory mapped: a 50k-Gaussian step went from 53.5
and 52.9 ms to 49.4 and 51.7 (docs/benchmarks.md, ## opensplat), with 2.5 MiB more peak RSS; a
256 MiB trim threshold measured the same as 64.

What this keeps resident is bounded by the trim threshold and is part of what `--memory-mb`'s
ceiling measures (`train.memory`). Cached blocks are separate mappings (`storage.blockio`) and
still leave the process when evicted.
"""
from __future__ import annotations

import ctypes

# mallopt's parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # the largest glibc accepts: arrays up to this size come from the heap
TRIM_THRESHOLD = 64 << 20  # free memory at the heap's top kept for reuse


def retain_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; False where the C library has no
    mallopt or refuses them (nothing changes there). The symbol is looked up in the process itself:
    `ctypes.util.find_library` would run `ldconfig` at every rank's start."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
