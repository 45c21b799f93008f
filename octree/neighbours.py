"""Adjacency between leaves: cells that share a face, an edge or a corner."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy.spatial import cKDTree

from octree import morton
from octree.assign import leaf_arrays
from octree.keys import BlockKey


def neighbours(keys: Sequence[BlockKey]) -> tuple[np.ndarray, np.ndarray]:
    """CSR adjacency of disjoint leaves: leaf i touches leaves indices[indptr[i]:indptr[i+1]] (sorted).

    Works on integer cell coordinates at the deepest leaf level, so touching is decided exactly:
    two cubes touch when the max-norm distance between their centres is at most the sum of their
    half sizes. One k-d tree per depth keeps it near O(B log B) for any mix of leaf sizes.
    """
    depths, codes = leaf_arrays(keys)
    n = len(keys)
    if n == 0:
        return np.zeros(1, dtype=np.int64), np.zeros(0, dtype=np.int64)
    finest = int(depths.max())
    size = np.int64(1) << (finest - depths)  # [B] edge length in finest cells
    # Doubled centres stay integers: 2 * lo + size.
    centres = (2 * morton.decode(codes) * size[:, None] + size[:, None]).astype(np.float64)
    rows, cols = [], []
    levels = np.unique(depths)
    trees = {d: (np.flatnonzero(depths == d), cKDTree(centres[depths == d])) for d in levels}
    for a in levels:
        idx_a, tree_a = trees[a]
        for b in levels[levels >= a]:
            idx_b, tree_b = trees[b]
            reach = float(size[idx_a[0]] + size[idx_b[0]])  # sum of half sizes, doubled
            pairs = tree_a.sparse_distance_matrix(tree_b, reach, p=np.inf, output_type="ndarray")
            i, j = idx_a[pairs["i"]], idx_b[pairs["j"]]
            rows += [i, j]
            cols += [j, i]
    i, j = np.concatenate(rows), np.concatenate(cols)
    pairs = np.unique(np.stack([i[i != j], j[i != j]], axis=1), axis=0)
    indptr = np.concatenate([[0], np.cumsum(np.bincount(pairs[:, 0], minlength=n))]).astype(np.int64)
    return indptr, pairs[:, 1].astype(np.int64)
