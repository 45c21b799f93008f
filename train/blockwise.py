"""Per-block work of a step on every core: threads that draw the blocks one at a time.

A step's Adam and extent boxes go block by block, and a block's compiled Adam step splits its rows
over the cores only from `optim.PARALLEL_ROWS` stepped rows: a 200k-Gaussian view of lund_door is
some twenty blocks of ~10k rows, a street view of a city hundreds of small ones, and their Adam
phase ran on one core. A block's work reads and writes that block's arrays alone and releases the
GIL (numba's nogil kernels, torch's and numpy's array operations), so threads take blocks side by
side, each computed exactly as it would be alone: results depend neither on which thread took a
block nor on the threads' timing. Blocks are drawn from one queue rather than split up front:
their costs differ (stepped rows, cache misses) more than their row counts show.
"""
from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import numpy as np

T = TypeVar("T")

# Threads are worth it only while no block holds most of the rows: one block larger than that is
# better taken alone, its rows split over the cores by the compiled kernel.
MAX_SHARE = 0.5
# Nor with small blocks: a block's compiled work is then as short as the interpreter's around it,
# which holds the GIL, and two threads handing it to each other were slower than one. Adam's phase
# of a 50k-Gaussian step on one thread against two (ms): blocks of 145 rows on average 8.9-9.7
# against 10.5-10.7, 290 rows 7.0-7.1 against 7.2, 660 rows 5.7 against 5.1-5.2; a street view of
# the bench's city (~90) 9.5-9.8 against 13.5-14.2.
MIN_MEAN_ROWS = 256


def block_threads(offsets: Sequence[int], threads: int) -> int:
    """How many threads should share the blocks (block b holds rows offsets[b]:offsets[b + 1]):
    `threads`, or 1 with fewer than two blocks, a block of more than MAX_SHARE of the rows, or
    fewer than MIN_MEAN_ROWS rows a block."""
    blocks = len(offsets) - 1
    if threads < 2 or blocks < 2 or offsets[-1] - offsets[0] < MIN_MEAN_ROWS * blocks:
        return 1
    largest = max(offsets[b + 1] - offsets[b] for b in range(blocks))
    return 1 if largest > MAX_SHARE * (offsets[-1] - offsets[0]) else min(threads, blocks)


class _Queue:
    """Block indices 0..n-1, each handed to one taker (itertools.count's next is atomic)."""

    def __init__(self, n: int) -> None:
        self._next, self._n = itertools.count(), n

    def __iter__(self) -> Iterator[int]:
        return self

    def __next__(self) -> int:
        b = next(self._next)
        if b >= self._n:
            raise StopIteration
        return b


def share_blocks(n_blocks: int, threads: int, work: Callable[[Iterator[int]], T]) -> list[T]:
    """work(blocks) on `threads` threads at once (the caller's and threads - 1 new ones), each
    iterating over its share of the blocks 0..n_blocks-1 as it draws them from one queue; every
    block goes to exactly one. Returns each thread's result (the caller's first). An exception in
    any is raised here once all have ended."""
    queue = _Queue(n_blocks)
    results: list = [None] * threads
    errors: list[BaseException | None] = [None] * threads

    def run(i: int) -> None:
        try:
            results[i] = work(queue)
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            errors[i] = e

    helpers = [threading.Thread(target=run, args=(i,), name=f"blockwise-{i}") for i in range(1, threads)]
    for t in helpers:
        t.start()
    try:
        run(0)
    finally:
        for t in helpers:
            t.join()
    for e in errors:
        if e is not None:
            raise e
    return results


def row_groups(offsets: Sequence[int], groups: int) -> np.ndarray:  # -> [G + 1] int64, G <= groups
    """Block indices that cut the blocks (block b holds rows offsets[b]:offsets[b + 1]) into at
    most `groups` runs of consecutive blocks holding about equal rows: a compiled loop over the
    runs splits them among its threads in equal numbers, whatever the blocks' sizes."""
    offsets = np.asarray(offsets, dtype=np.int64)
    blocks = len(offsets) - 1
    targets = offsets[0] + (offsets[-1] - offsets[0]) * np.arange(1, groups) // max(groups, 1)
    cuts = np.searchsorted(offsets[1:-1], targets, side="left") + 1 if blocks > 1 else np.zeros(0, np.int64)
    return np.unique(np.concatenate([[0], cuts, [blocks]])).astype(np.int64)
