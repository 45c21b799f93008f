"""Initial Gaussians from points, as gsplat's trainer makes them, with an exact block-wise k-NN.

scale = log(sqrt(mean of the squared distances to the 3 nearest other points)), isotropic;
rotation identity; opacity logit(0.1); SH DC from the colour, higher bands zero.

The k-NN runs leaf by leaf so it needs only a few leaves in memory: a leaf's points are first
matched among themselves, then against other leaves in order of the distance between the tight
boxes, skipping a leaf once it lies beyond every point's current k-th distance. Leaves that are
skipped cannot hold a closer point, so the result equals a global k-d tree's.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import numpy as np
from scipy.spatial import cKDTree

from octree import box_box_distance, point_box_distance
from octree.semantics import SH_C0
from storage.schema import num_sh_rest

NEIGHBOURS = 3  # gsplat averages over the 3 nearest neighbours


class LeafNeighbours:
    """k-NN distances of every leaf's points among all points, with an LRU cache of leaf k-d trees.

    means_of(leaf) -> [n, 3] the leaf's points; tight [B, 6] the leaves' tight boxes of them.
    """

    def __init__(self, means_of: Callable[[int], np.ndarray], tight: np.ndarray, total: int, cache_bytes: int) -> None:
        self._means_of = means_of
        self._tight = tight
        self.k = min(NEIGHBOURS, total - 1)
        self._cache: OrderedDict[int, tuple[np.ndarray, cKDTree]] = OrderedDict()
        self._cache_bytes, self._held = cache_bytes, 0

    def _tree(self, leaf: int) -> tuple[np.ndarray, cKDTree]:
        if leaf in self._cache:
            self._cache.move_to_end(leaf)
            return self._cache[leaf]
        points = np.asarray(self._means_of(leaf), dtype=np.float64)
        entry = (points, cKDTree(points))
        self._cache[leaf] = entry
        self._held += points.nbytes * 4  # the tree holds a copy and its index besides the points
        while self._held > self._cache_bytes and len(self._cache) > 1:
            _, (old, _) = self._cache.popitem(last=False)
            self._held -= old.nbytes * 4
        return entry

    def distances(self, leaf: int) -> np.ndarray:  # [n, k] distances to the k nearest other points, sorted
        points, tree = self._tree(leaf)
        if self.k == 0:
            return np.zeros((len(points), 0))
        # k + 1 with the point itself, which comes first at distance 0 (or a duplicate does: same values).
        dist, _ = tree.query(points, k=self.k + 1, workers=-1)
        dist = dist[:, 1:]
        gaps = box_box_distance(self._tight[leaf], self._tight)
        gaps[leaf] = np.inf
        for other in np.argsort(gaps, kind="stable"):
            reach = dist[:, -1]
            if gaps[other] > reach.max():
                break
            rows = np.flatnonzero(point_box_distance(points, self._tight[other : other + 1])[:, 0] <= reach)
            if len(rows) == 0:
                continue
            other_points, other_tree = self._tree(other)
            k = min(self.k, len(other_points))
            found, _ = other_tree.query(points[rows], k=k, distance_upper_bound=float(reach[rows].max()), workers=-1)
            merged = np.concatenate([dist[rows], found.reshape(len(rows), k)], axis=1)
            dist[rows] = np.sort(merged, axis=1)[:, : self.k]
        return dist


def gaussians_from_points(
    means: np.ndarray,  # [n, 3] float32
    colors: np.ndarray,  # [n, 3] uint8
    neighbour_dist: np.ndarray,  # [n, k] distances to the nearest other points
    sh_degree: int,
    opacity: float,
    min_scale: float,
    init_scale: float = 1.0,  # gsplat's init_scale: a factor on the neighbour distance
) -> dict[str, np.ndarray]:
    """gsplat's initial parameters; scales are floored at `min_scale` so coincident points (and a
    lone point) get a finite size instead of log(0)."""
    n = len(means)
    if neighbour_dist.shape[1]:
        rms = np.sqrt((neighbour_dist.astype(np.float64) ** 2).mean(axis=1))
    else:
        rms = np.zeros(n)
    log_scale = np.log(np.maximum(rms * init_scale, min_scale)).astype(np.float32)
    rgb = colors.astype(np.float32) / np.float32(255.0)
    return {
        "means": np.ascontiguousarray(means, dtype=np.float32),
        "scales": np.repeat(log_scale[:, None], 3, axis=1),
        "quats": np.tile(np.float32([1.0, 0.0, 0.0, 0.0]), (n, 1)),
        "opacities": np.full(n, np.log(opacity / (1.0 - opacity)), dtype=np.float32),
        "sh0": ((rgb - np.float32(0.5)) / np.float32(SH_C0)).reshape(n, 1, 3),
        "shN": np.zeros((n, num_sh_rest(sh_degree), 3), dtype=np.float32),
    }
