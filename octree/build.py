"""Octree construction: leaves of at most `max_per_block` points, found level by level from sorted Morton codes.

Everything is vectorised over nodes of a level (at most MAX_DEPTH + 1 levels), never over points;
the only O(N log N) step is one sort of the points' Morton codes.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from octree.keys import MAX_DEPTH, BlockKey
from octree.root import RootCube

_TABLE_DEPTH = 6  # 8**6 entries: a lookup table of 2 MiB for `locate`


def spans(depths: np.ndarray, codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # [B], [B]
    """First and last (inclusive) finest-level Morton code inside each cell: ([B] int64, [B] int64)."""
    shift = 3 * (MAX_DEPTH - np.asarray(depths, dtype=np.int64))
    first = np.asarray(codes, dtype=np.int64) << shift
    # Inclusive, so the last cell of the cube (2**63 - 1) does not overflow int64.
    return first, first | ((np.int64(1) << shift) - 1)


def _count(runs: Sequence[np.ndarray], first: np.ndarray, last: np.ndarray) -> np.ndarray:  # -> [M] int64
    total = np.zeros(len(first), dtype=np.int64)
    for run in runs:
        total += np.searchsorted(run, last, side="right") - np.searchsorted(run, first, side="left")
    return total


def leaves_from_sorted_codes(
    runs: Sequence[np.ndarray],  # each [n_r] int64, sorted finest-level Morton codes
    max_per_block: int,
    max_depth: int = MAX_DEPTH,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Leaves (depths [B], codes [B], counts [B]) in Morton order; empty cells are not leaves.

    The codes may be split over several sorted runs (an external sort's chunks, possibly memory
    mapped): a cell's count is the sum over runs of two binary searches.
    A cell is split while it holds more than `max_per_block` points and is shallower than `max_depth`.
    """
    if max_per_block < 1:
        raise ValueError(f"max_per_block must be at least 1, got {max_per_block}")
    if not 0 <= max_depth <= MAX_DEPTH:
        raise ValueError(f"max_depth must be in [0, {MAX_DEPTH}], got {max_depth}")
    total = sum(len(run) for run in runs)
    if total == 0:
        raise ValueError("cannot build an octree over zero points")
    out_depths, out_codes, out_counts = [], [], []
    depth, codes, counts = 0, np.zeros(1, dtype=np.int64), np.array([total], dtype=np.int64)
    while len(codes):
        split = counts > max_per_block if depth < max_depth else np.zeros(len(codes), dtype=bool)
        out_depths.append(np.full(int((~split).sum()), depth, dtype=np.int64))
        out_codes.append(codes[~split])
        out_counts.append(counts[~split])
        depth += 1
        children = ((codes[split][:, None] << 3) | np.arange(8, dtype=np.int64)).ravel()
        counts = _count(runs, *spans(np.full(len(children), depth), children))
        codes, counts = children[counts > 0], counts[counts > 0]
    depths, codes, counts = (np.concatenate(a) for a in (out_depths, out_codes, out_counts))
    morton_order = np.argsort(spans(depths, codes)[0], kind="stable")
    return depths[morton_order], codes[morton_order], counts[morton_order]


def locate(point_codes: np.ndarray, depths: np.ndarray, codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For finest-level codes [N]: the leaf at or before each in Morton order [N], and whether it holds it [N]."""
    first, last = spans(depths, codes)
    # A table over the cells of a coarse level answers most points with one gather; points in
    # cells that are split further (or empty) fall back to a binary search over the leaves.
    # The table costs 8**depth binary searches, so it never outgrows the points.
    table_depth = min(int(depths.max()), _TABLE_DEPTH, max(0, (len(point_codes).bit_length() - 1) // 3))
    shift = 3 * (MAX_DEPTH - table_depth)
    cells = np.arange(8**table_depth, dtype=np.int64) << shift
    table = np.searchsorted(first, cells, side="right") - 1
    whole = (table >= 0) & (depths[np.maximum(table, 0)] <= table_depth) & (cells <= last[np.maximum(table, 0)])
    table[~whole] = -1
    idx = table[point_codes >> shift]
    rest = np.flatnonzero(idx < 0)
    idx[rest] = np.searchsorted(first, point_codes[rest], side="right") - 1
    safe = np.maximum(idx, 0)
    return safe, (idx >= 0) & (point_codes <= last[safe])


def group_by_label(labels: np.ndarray, n_labels: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Stable grouping of [N] labels in [0, n_labels): (order [N], starts [n_labels], counts [n_labels])."""
    n = len(labels)
    counts = np.bincount(labels, minlength=n_labels).astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    index_bits = max(1, int(n - 1).bit_length())
    if index_bits + max(1, int(n_labels - 1).bit_length()) <= 63:
        # Sorting (label, index) packed in one int64 is several times faster than an argsort.
        packed = (labels.astype(np.int64) << index_bits) | np.arange(n, dtype=np.int64)
        order = np.sort(packed) & ((np.int64(1) << index_bits) - 1)
    else:
        order = np.argsort(labels, kind="stable")
    return order, starts, counts


@dataclass(frozen=True, eq=False)
class Octree:
    """The leaves (blocks) of an octree in Morton order, and the points grouped by leaf."""

    root: RootCube
    max_per_block: int  # leaf capacity, exceeded only by leaves at max_depth
    max_depth: int  # deepest level allowed (from the minimum cell size)
    depths: np.ndarray  # [B] int64 depth of each leaf
    codes: np.ndarray  # [B] int64 Morton code of each leaf at its depth
    order: np.ndarray  # [N] int64 point indices; leaf i holds order[starts[i] : starts[i] + counts[i]]
    starts: np.ndarray  # [B] int64
    counts: np.ndarray  # [B] int64

    @property
    def keys(self) -> list[BlockKey]:
        return [BlockKey(int(d), int(c)) for d, c in zip(self.depths, self.codes)]

    @property
    def cells(self) -> np.ndarray:  # [B, 6]
        return self.root.cells(self.depths, self.codes)

    @property
    def depth(self) -> int:
        return int(self.depths.max())

    def members(self, leaf: int) -> np.ndarray:  # [counts[leaf]] point indices of one leaf
        return self.order[self.starts[leaf] : self.starts[leaf] + self.counts[leaf]]

    def labels(self) -> np.ndarray:  # [N] the leaf of every point
        out = np.empty(len(self.order), dtype=np.int64)
        out[self.order] = np.repeat(np.arange(len(self.counts)), self.counts)
        return out


def check_points(points: np.ndarray) -> np.ndarray:  # [N, 3] -> [N, 3]
    points = np.asarray(points)
    if points.ndim != 2 or points.shape[1] != 3:
        raise ValueError(f"points must have shape [N, 3], got {points.shape}")
    if len(points) == 0:
        raise ValueError("cannot build an octree over zero points")
    bad = int((~np.isfinite(points).all(axis=1)).sum())
    if bad:
        raise ValueError(f"{bad} of {len(points)} points have NaN or infinite coordinates")
    return points


def build_octree(
    points: np.ndarray,  # [N, 3]
    max_per_block: int,
    min_cell_size: float | None = None,
    root: RootCube | None = None,
) -> Octree:
    """Split the root cube (by default the cube around the points) until no leaf holds more than
    `max_per_block` points or its cells would be narrower than `min_cell_size`."""
    points = check_points(points)
    if root is None:
        root = RootCube.of_points(points)
    else:
        outside = int((~root.contains(points)).sum())
        if outside:
            raise ValueError(f"{outside} of {len(points)} points lie outside the root cube {root}")
    max_depth = root.max_depth(min_cell_size)
    point_codes = root.codes(points)
    depths, codes, _ = leaves_from_sorted_codes([np.sort(point_codes)], max_per_block, max_depth)
    labels, _ = locate(point_codes, depths, codes)
    order, starts, counts = group_by_label(labels, len(codes))
    return Octree(root, max_per_block, max_depth, depths, codes, order, starts, counts)
