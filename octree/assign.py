"""Which block a Gaussian belongs to, for migration after its mean moved."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from octree.boxes import point_box_distance
from octree.build import locate, spans
from octree.keys import BlockKey
from octree.root import RootCube

_PAIRS_PER_CHUNK = 1 << 22  # bounds the [points, leaves] distance matrix of the fallback


def leaf_arrays(keys: Sequence[BlockKey]) -> tuple[np.ndarray, np.ndarray]:
    """Depths [B] and codes [B] of leaves given in Morton order; refuses overlapping or unordered keys."""
    depths = np.array([k.depth for k in keys], dtype=np.int64)
    codes = np.array([k.code for k in keys], dtype=np.int64)
    first, last = spans(depths, codes)
    bad = np.flatnonzero(first[1:] <= last[:-1])
    if len(bad):
        i = int(bad[0])
        raise ValueError(f"leaves {keys[i].name} and {keys[i + 1].name} overlap or are not in Morton order")
    return depths, codes


def assign_points(points: np.ndarray, root: RootCube, keys: Sequence[BlockKey]) -> np.ndarray:
    """The leaf of each point [N, 3] -> [N] int64 index into `keys` (Morton order).

    A point belongs to the leaf whose cell holds it. A point in no leaf's cell (outside the root
    cube, or in a region that held no points when the tree was built) goes to the leaf whose cell
    is nearest, ties to the first in Morton order: the caller decides whether to grow the tree.
    """
    if not keys:
        raise ValueError("cannot assign points to an octree without leaves")
    depths, codes = leaf_arrays(keys)
    idx, inside = locate(root.codes(points), depths, codes)
    inside &= root.contains(points)
    stray = np.flatnonzero(~inside)
    if len(stray):
        cells = root.cells(depths, codes)
        step = max(1, _PAIRS_PER_CHUNK // len(cells))
        for s in range(0, len(stray), step):
            rows = stray[s : s + step]
            idx[rows] = np.argmin(point_box_distance(points[rows], cells), axis=1)
    return idx
