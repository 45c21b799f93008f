"""Tile lists: which splats each 16x16 tile evaluates, front to back.

Candidates are the tiles of gsplat's radius box (`isect_tiles`), kept only if the splat's support
ellipse reaches one of the tile's pixel centres; that drops about a fifth of the box's tiles and
changes no pixel. Lists are ordered by depth, as gsplat's sort of (tile, depth) keys does, but
with ties broken by the splats' contents instead of their row (see `_tie_key`).

The splats are first sorted by depth (from their inputs) and their records written in that
order (`ellipse.write_record`), and everything after works on them: the tile sort then reads its
candidates as one stream (in row order it missed the cache once per splat: 12 of the binning's
16 ms at 50k splats), and each tile's list reads records at rising addresses.
"""
from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
from numba import njit, prange

from train.render.cpu.ellipse import (
    CA, CB, CC, DEGENERATE, HALF_Y, INV_A, INV_C, LEVEL, MX, MY, RECORD, band_span, write_record,
)
from train.render.semantics import TILE_SIZE


@dataclass
class Bins:
    offsets: np.ndarray  # [tiles_x * tiles_y + 1] int64, tile t's list is gids[offsets[t]:offsets[t + 1]]
    gids: np.ndarray  # [n_isects] int32 rows of `records`, ascending (front to back) within a tile
    tiles_x: int
    tiles_y: int
    order: np.ndarray  # [M] int32: records[i] is the input's row order[i]
    records: np.ndarray  # [M, RECORD] float32 the input's records in depth order
    hit_starts: np.ndarray  # [M + 1] int64: records[i]'s intersections are
    hit_slots: np.ndarray  # [n_isects] int64   gids[hit_slots[hit_starts[i]:hit_starts[i + 1]]]

    @property
    def n_isects(self) -> int:
        return len(self.gids)

    def rows(self) -> np.ndarray:  # [n_isects] int64 the tile lists as rows of the input
        return self.order[self.gids].astype(np.int64)


@njit(parallel=True, fastmath=True, cache=True, nogil=True)
def _records_and_boxes(means2d, conics, opacities, colors, depths, radii, order, tiles_x, tiles_y):
    """The records (`ellipse.write_record`) of the input rows in `order` (depth order), and gsplat's candidate
    tiles of each record from the integer radii [M, 2] of the input rows: boxes [M, 4] int64 tx0,
    tx1, ty0, ty1 (end exclusive; empty for dead splats) and sizes [M]. One pass, as both read the
    input rows at random: at 1M splats a second pass for the boxes missed the cache once more a
    splat (22 ms a step)."""
    m = order.size
    rec = np.empty((m, RECORD), np.float32)  # every element written below, each row by its own thread
    boxes = np.empty((m, 4), np.int64)
    sizes = np.empty(m, np.int64)
    for i in prange(m):
        g = order[i]
        write_record(rec, i, means2d, conics, opacities, colors, depths, g)
        boxes[i, 0], boxes[i, 1], boxes[i, 2], boxes[i, 3] = 0, 0, 0, 0
        sizes[i] = 0
        rx, ry = radii[g, 0], radii[g, 1]
        if rx <= 0 or ry <= 0 or rec[i, LEVEL] < 0.0:
            continue
        mx, my = float(rec[i, MX]), float(rec[i, MY])
        # (TILE_SIZE is a power of two: a division by it is exact under fast-math's reciprocals too)
        tx0 = min(max(0, int(np.floor((mx - rx) / TILE_SIZE))), tiles_x)
        tx1 = min(max(0, int(np.ceil((mx + rx) / TILE_SIZE))), tiles_x)
        ty0 = min(max(0, int(np.floor((my - ry) / TILE_SIZE))), tiles_y)
        ty1 = min(max(0, int(np.ceil((my + ry) / TILE_SIZE))), tiles_y)
        boxes[i, 0], boxes[i, 1], boxes[i, 2], boxes[i, 3] = tx0, tx1, ty0, ty1
        sizes[i] = (tx1 - tx0) * (ty1 - ty0)
    return rec, boxes, sizes


# Ties in depth are broken by the splats' contents, not by row: the order then does not depend on
# how splats were concatenated (by rank, by block), so a split render equals a single-process one.
_TIE_KEYS = 9


@njit(inline="always")
def _tie_key(means2d, conics, opacities, colors, row, k):  # -> key k < _TIE_KEYS of a row
    """The keys, most significant first: mean x, mean y, opacity, conic a, b, c, red, green, blue
    (read from the inputs, of which the records hold copies)."""
    if k < 2:
        return means2d[row, k]
    if k == 2:
        return opacities[row]
    if k < 6:
        return conics[row, k - 3]
    return colors[row, k - 6]


@njit(cache=True, nogil=True)
def _tie_before(means2d, conics, opacities, colors, a, b):  # whether row a sorts strictly before row b
    for k in range(_TIE_KEYS):
        va, vb = _tie_key(means2d, conics, opacities, colors, a, k), _tie_key(means2d, conics, opacities, colors, b, k)
        if va != vb:
            return va < vb
    return False


_SHORT_RUN = 16  # runs of equal depth up to this long are sorted in place by insertion


@njit(cache=True, nogil=True)
def _insertion_sort_ties(means2d, conics, opacities, colors, order, start, end):
    """Stable insertion sort of order[start:end] by `_tie_key`: the same order as `_sort_ties`
    for the short runs float32 depths collide in (mostly pairs), without its nine sorts' arrays."""
    for i in range(start + 1, end):
        row = order[i]
        j = i
        while j > start and _tie_before(means2d, conics, opacities, colors, row, order[j - 1]):
            order[j] = order[j - 1]
            j -= 1
        order[j] = row


@njit(cache=True, nogil=True)
def _sort_ties(means2d, conics, opacities, colors, run):  # [L] int32 rows of equal depth -> sorted by `_tie_key`
    values = np.empty(run.size, np.float32)
    for k in range(_TIE_KEYS - 1, -1, -1):  # least significant first, each sort stable
        for i in range(run.size):
            values[i] = _tie_key(means2d, conics, opacities, colors, run[i], k)
        run = run[np.argsort(values, kind="mergesort")]
    return run


_DIGIT_BITS = 8
_DIGITS = 1 << _DIGIT_BITS


@njit(cache=True, nogil=True)
def _chunk(i, chunks, m):  # -> [start, end) of chunk i of range(m) in `chunks` near-equal parts
    return i * m // chunks, (i + 1) * m // chunks


@njit(parallel=True, cache=True, nogil=True)
def _radix_pass(keys, order, shift, chunks, out_keys, out_order):  # -> False if every key had one digit
    """One stable counting pass on the digit at `shift`: every chunk counts its digits, then
    scatters them from where all earlier digits, and this digit in earlier chunks, end. The
    permutation is the serial pass's whatever the number of chunks."""
    m = keys.size
    counts = np.zeros((chunks, _DIGITS), np.int64)
    for c in prange(chunks):
        a, b = _chunk(c, chunks, m)
        for i in range(a, b):
            counts[c, (keys[i] >> np.uint32(shift)) & np.uint32(_DIGITS - 1)] += 1
    totals = counts.sum(axis=0)
    if totals.max() == m:
        return False
    cursor = np.empty((chunks, _DIGITS), np.int64)
    at = 0
    for d in range(_DIGITS):
        for c in range(chunks):
            cursor[c, d] = at
            at += counts[c, d]
    for c in prange(chunks):
        a, b = _chunk(c, chunks, m)
        for i in range(a, b):
            d = (keys[i] >> np.uint32(shift)) & np.uint32(_DIGITS - 1)
            out_keys[cursor[c, d]] = keys[i]
            out_order[cursor[c, d]] = order[i]
            cursor[c, d] += 1
    return True


@njit(parallel=True, cache=True, nogil=True)
def _depth_keys(depths, chunks):  # -> [M] uint32 keys in the depths' float order, [M] int32 0..M-1
    """Flipped so unsigned order is float order: all bits of negatives, the sign bit of the rest."""
    m = depths.size
    bits = depths.view(np.uint32)
    keys, order = np.empty(m, np.uint32), np.empty(m, np.int32)
    for c in prange(chunks):
        a, b = _chunk(c, chunks, m)
        for i in range(a, b):
            keys[i] = ~bits[i] if bits[i] >> np.uint32(31) == np.uint32(1) else bits[i] | np.uint32(0x80000000)
            order[i] = i
    return keys, order


@njit(parallel=True, cache=True, nogil=True)
def _sort_runs(means2d, conics, opacities, colors, keys, order, chunks):
    """Each run of equal keys in order (sorted by key) sorted by `_tie_key`, in place. A chunk
    takes the runs that start in it, to their ends: runs are disjoint, so the result is the serial
    pass's whatever the number of chunks."""
    m = keys.size
    for c in prange(chunks):
        a, b = _chunk(c, chunks, m)
        start = a
        while 0 < start < b and keys[start] == keys[start - 1]:
            start += 1  # a run that began in the chunk before
        while start < b:
            end = start + 1
            while end < m and keys[end] == keys[start]:
                end += 1
            if 1 < end - start <= _SHORT_RUN:
                _insertion_sort_ties(means2d, conics, opacities, colors, order, start, end)
            elif end - start > _SHORT_RUN:
                order[start:end] = _sort_ties(means2d, conics, opacities, colors, order[start:end].copy())
            start = end


@njit(cache=True, nogil=True)
def _argsort_depth(means2d, conics, opacities, colors, depths, chunks):  # -> [M] int32: by depth, then by `_tie_key`
    """LSD radix sort on the depth's float bits, 4 passes of 8 bits (numpy's stable float sort is
    a merge sort, ~10x slower here), each split over `chunks` threads, and skipped where all keys
    share the digit (the exponent's, mostly); then each run of equal depth is sorted by
    `_tie_key`, runs split over the threads too (at 1M splats, some 40k in 20k runs, this pass and
    the keys took a third of the sort on one thread)."""
    keys, order = _depth_keys(depths, chunks)
    keys2, order2 = np.empty_like(keys), np.empty_like(order)
    for shift in range(0, 32, _DIGIT_BITS):
        if _radix_pass(keys, order, shift, chunks, keys2, order2):
            keys, keys2 = keys2, keys
            order, order2 = order2, order
    _sort_runs(means2d, conics, opacities, colors, keys, order, chunks)
    return order


@njit(parallel=True, cache=True, nogil=True)
def _test_boxes(records, boxes, starts, width, height, tiles_x, tiles):
    """Write each candidate tile's id, or -1 where the support ellipse misses every pixel centre of
    the tile, into record g's slots from starts[g] (memory is written as one stream). Per row of
    tiles: the span of the ellipse within the row's pixel centres, then which tiles' centres it
    overlaps."""
    for g in prange(records.shape[0]):
        mx, my, level = float(records[g, MX]), float(records[g, MY]), float(records[g, LEVEL])
        a, b, c = float(records[g, CA]), float(records[g, CB]), float(records[g, CC])
        inv_a, inv_c = float(records[g, INV_A]), float(records[g, INV_C])
        bounded = records[g, HALF_Y] < DEGENERATE
        j = starts[g]
        for ty in range(boxes[g, 2], boxes[g, 3]):
            y0 = ty * TILE_SIZE
            if bounded:
                x_lo, x_hi = band_span(mx, my, a, b, c, inv_a, inv_c, level, y0 + 0.5,
                                       min(y0 + TILE_SIZE, height) - 0.5)
            else:
                x_lo, x_hi = -np.inf, np.inf
            for tx in range(boxes[g, 0], boxes[g, 1]):
                x0 = tx * TILE_SIZE
                hit = x0 + 0.5 <= x_hi and min(x0 + TILE_SIZE, width) - 0.5 >= x_lo
                tiles[j] = ty * tiles_x + tx if hit else -1
                j += 1


@njit(parallel=True, cache=True, nogil=True)
def _sort_by_tile(candidates, starts, n_tiles, chunks):
    """Stable counting sort of the hits by tile; record i's candidates are candidates[starts[i]:
    starts[i + 1]] and records are in depth order, so each list comes out front to back. Also
    returns where each record's hits landed (hit_starts, hit_slots), which is how the backward
    pass sums a splat's gradient rows. Records are split into `chunks` runs counted and scattered
    in parallel, each from where the runs before it end in every tile: the same lists as one pass."""
    m = starts.size - 1
    counts = np.zeros((chunks, n_tiles), np.int64)
    hits = np.zeros(m + 1, np.int64)
    for c in prange(chunks):
        a, b = _chunk(c, chunks, m)
        for i in range(a, b):
            for j in range(starts[i], starts[i + 1]):
                t = candidates[j]
                if t >= 0:
                    counts[c, t] += 1
                    hits[i + 1] += 1
    hit_starts = np.cumsum(hits)
    offsets = np.zeros(n_tiles + 1, np.int64)
    cursor = np.empty((chunks, n_tiles), np.int64)
    for t in range(n_tiles):
        at = offsets[t]
        for c in range(chunks):
            cursor[c, t] = at
            at += counts[c, t]
        offsets[t + 1] = at
    gids = np.empty(offsets[-1], np.int32)
    hit_slots = np.empty(offsets[-1], np.int64)
    for c in prange(chunks):
        a, b = _chunk(c, chunks, m)
        for i in range(a, b):
            n = hit_starts[i]
            for j in range(starts[i], starts[i + 1]):
                t = candidates[j]
                if t >= 0:
                    gids[cursor[c, t]] = i
                    hit_slots[n] = cursor[c, t]
                    cursor[c, t] += 1
                    n += 1
    return offsets, gids, hit_starts, hit_slots


def bin_tiles(means2d: np.ndarray, conics: np.ndarray, opacities: np.ndarray, colors: np.ndarray,
              depths: np.ndarray, radii: np.ndarray, width: int, height: int) -> Bins:
    """The splats ([M, 2], [M, 3], [M], [M, 3], [M] float32 contiguous, radii [M, 2] int32)
    sorted, recorded (`ellipse.write_record`) and binned."""
    tiles_x = -(-width // TILE_SIZE)
    tiles_y = -(-height // TILE_SIZE)
    chunks = numba.get_num_threads()
    order = _argsort_depth(means2d, conics, opacities, colors, depths, chunks)
    records, boxes, sizes = _records_and_boxes(means2d, conics, opacities, colors, depths, radii, order, tiles_x,
                                               tiles_y)
    starts = np.zeros(len(records) + 1, np.int64)
    np.cumsum(sizes, out=starts[1:])
    candidates = np.empty(starts[-1], np.int32)
    _test_boxes(records, boxes, starts, width, height, tiles_x, candidates)
    offsets, gids, hit_starts, hit_slots = _sort_by_tile(candidates, starts, tiles_x * tiles_y, chunks)
    return Bins(offsets, gids, tiles_x, tiles_y, order, records, hit_starts, hit_slots)
