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

glibc caps the mmap threshold at 32 MiB, and larger arrays (at 1M splats the records, tile lists
and intersection gradients, 64 MB and more each) were still fresh mappings every step, faulted in
page by page. While a training step runs, `step_memory_from_heap` has glibc serve every
allocation from the heap (no mapping at all), so a step mostly reuses the last one's memory:
1M-Gaussian steps, alternated with and without, went from 519 / 537 / 550 to 495 / 520 / 503 ms
(minor faults a step 16-26k -> 4-20k; what still faults is the heap's top, trimmed past the trim
threshold), with 31-81 MiB more peak RSS. At 200k and fewer no array is that large. Only the
step's own buffers are made meanwhile (blocks read by the prefetch are their own mappings
whatever the setting), and what the step frees stays in the heap for the next one.
"""
from __future__ import annotations

import ctypes
import functools
from collections.abc import Iterator
from contextlib import contextmanager

# mallopt's parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4
_DEFAULT_MMAP_MAX = 65536  # glibc's: mappings it may hold at once for malloc
MMAP_THRESHOLD = 32 << 20  # the largest glibc accepts: arrays up to this size come from the heap
TRIM_THRESHOLD = 64 << 20  # free memory at the heap's top kept for reuse


@functools.cache
def _mallopt():
    """glibc's mallopt, or None. Looked up in the process itself (`ctypes.util.find_library` would
    run `ldconfig` at every rank's start), once: every step sets it twice."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt


def retain_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; False where the C library has no
    mallopt or refuses them (nothing changes there)."""
    mallopt = _mallopt()
    return (mallopt is not None and bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
            and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)))


@contextmanager
def step_memory_from_heap() -> Iterator[bool]:
    """Within: glibc maps no memory for malloc, serving even the largest arrays from the heap;
    yields whether that holds (False where there is no mallopt, nothing changed). Afterwards
    glibc's default again."""
    mallopt = _mallopt()
    held = mallopt is not None and bool(mallopt(_M_MMAP_MAX, 0))
    try:
        yield held
    finally:
        if held:
            mallopt(_M_MMAP_MAX, _DEFAULT_MMAP_MAX)
