"""Changing the octree's leaves during training: where moved Gaussians go, which blocks merge or split.

Pure geometry on finest-level Morton codes (see `RootCube.codes`) and leaf keys in Morton order;
the trainer moves the rows. Every function is vectorised over points; loops run over depth levels.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from octree.assign import leaf_arrays
from octree.build import group_by_label, leaves_from_sorted_codes, locate, spans
from octree.keys import MAX_DEPTH, BlockKey

# 8**k for k = 0 .. MAX_DEPTH - 1: the sizes, in finest codes, of the cells of depth MAX_DEPTH - k.
_CELL_SIZES = np.int64(1) << (3 * np.arange(MAX_DEPTH, dtype=np.int64))


def cell_holds(key: BlockKey, point_codes: np.ndarray) -> np.ndarray:  # point_codes [N] -> [N] bool
    """Whether each finest-level code lies in the key's cell (a cell is one interval of codes)."""
    first, last = spans(np.array([key.depth]), np.array([key.code]))
    codes = np.asarray(point_codes, dtype=np.int64)
    return (codes >= first[0]) & (codes <= last[0])


def home_cells(
    point_codes: np.ndarray,  # [N] int64 finest-level codes of the points (clamped into the root cube)
    depths: np.ndarray,  # [B] int64 depths of the leaves, in Morton order
    codes: np.ndarray,  # [B] int64 codes of the leaves
) -> tuple[np.ndarray, np.ndarray]:  # depths [N] int64, codes [N] int64
    """The cell each moved Gaussian belongs to: the leaf holding it, else a new cell for a new leaf.

    A point in no leaf gets the largest cell that holds it and is disjoint from every leaf, so
    Gaussians that drift into an empty region share one new block instead of one each.
    Points beyond the root cube come as `RootCube.codes` gives them, clamped onto the border
    cells: the border cells own the space outside the cube (the trainer's policy, docs/densify.md).
    """
    point_codes = np.asarray(point_codes, dtype=np.int64)
    depths = np.asarray(depths, dtype=np.int64)
    codes = np.asarray(codes, dtype=np.int64)
    if len(codes) == 0:
        raise ValueError("cannot find home cells in an octree without leaves")
    leaf, inside = locate(point_codes, depths, codes)
    out_depths, out_codes = depths[leaf], codes[leaf]
    stray = np.flatnonzero(~inside)
    if len(stray):
        p = point_codes[stray]
        first = spans(depths, codes)[0]
        # The cells holding p are the code intervals sharing a prefix of octal digits with p; the
        # leaf start with the longest shared prefix is p's neighbour in sorted order, on one side.
        nxt = np.searchsorted(first, p, side="right")
        after = np.where(nxt < len(first), first[np.minimum(nxt, len(first) - 1)] ^ p, np.iinfo(np.int64).max)
        before = np.where(nxt > 0, first[np.maximum(nxt - 1, 0)] ^ p, np.iinfo(np.int64).max)
        diff = np.minimum(after, before)  # never 0: p would be a leaf start, inside that leaf
        # d = the deepest depth whose cell around p holds a leaf start: the cells of depth
        # MAX_DEPTH - k for which the shared prefix is long enough, i.e. diff < 8**k.
        d = MAX_DEPTH - np.searchsorted(_CELL_SIZES, diff, side="right")
        # Why the new cell C (depth d + 1 around p) is a valid, consistent leaf:
        # - C holds no leaf start (d is the deepest with one), and no leaf holds C (it would hold
        #   p); as octree cells are nested or disjoint, C is disjoint from every leaf.
        # - parent(C) holds a leaf start. If two new cells C ⊊ C', then parent(C) ⊆ C' and C' would
        #   hold a leaf start: so any two new cells are equal or disjoint, and every point of C
        #   finds the same d, hence the same C.
        # - d < the leaf's depth (the leaf holds no p), so d + 1 <= MAX_DEPTH.
        out_depths[stray] = d + 1
        out_codes[stray] = p >> (3 * (MAX_DEPTH - d - 1))
    return out_depths, out_codes


def plan_merges(keys: Sequence[BlockKey], counts: Sequence[int], limit: int) -> dict[BlockKey, BlockKey]:
    """For each leaf that merges, the ancestor leaf it becomes part of; leaves that stay are absent.

    A parent absorbs its children when they are all leaves (no deeper descendants), at least two,
    together holding fewer than `limit` Gaussians; the merged parent may then merge upwards too.
    A merge only enables merges of the parent's ancestors and never disables one, so the result
    does not depend on the order of merges, and one bottom-up pass over depths finds them all.
    """
    depths, codes = leaf_arrays(keys)  # checks Morton order and disjointness
    n = np.asarray(counts, dtype=np.int64)
    if n.shape != depths.shape:
        raise ValueError(f"{len(n)} counts for {len(depths)} leaves")
    if len(depths) == 0:
        return {}
    owner = np.arange(len(depths))  # [B] index of the current leaf holding each given leaf
    cur_d, cur_c = depths, codes  # [M] the current leaves, still in Morton order
    for depth in range(int(depths.max()), 0, -1):
        below = np.flatnonzero(cur_d >= depth)
        # Ancestors at depth - 1; the leaves below one parent are contiguous in Morton order.
        parent = cur_c[below] >> (3 * (cur_d[below] - depth + 1))
        start = np.flatnonzero(np.r_[True, parent[1:] != parent[:-1]])
        size = np.diff(np.r_[start, len(below)])
        direct = np.add.reduceat((cur_d[below] == depth).astype(np.int64), start)
        total = np.add.reduceat(n[below], start)
        merge = (direct == size) & (size >= 2) & (total < limit)
        if not merge.any():
            continue
        # A merged group collapses onto its first child's slot, which keeps Morton order.
        head = below[start[merge]]
        absorbed = np.zeros(len(cur_d), dtype=bool)
        absorbed[below] = np.repeat(merge, size)
        absorbed[head] = False
        cur_d, cur_c, n = cur_d.copy(), cur_c.copy(), n.copy()
        cur_d[head], cur_c[head], n[head] = depth - 1, parent[start[merge]], total[merge]
        owner = (np.cumsum(~absorbed) - 1)[owner]  # the new index of each current leaf's group
        cur_d, cur_c, n = cur_d[~absorbed], cur_c[~absorbed], n[~absorbed]
    moved = np.flatnonzero(cur_d[owner] != depths)  # merging always makes a leaf shallower
    return {keys[i]: BlockKey(int(cur_d[owner[i]]), int(cur_c[owner[i]])) for i in moved}


def split_rows(
    point_codes: np.ndarray,  # [N] int64 finest-level codes of one block's rows
    key: BlockKey,
    max_per_block: int,
    max_depth: int,
) -> list[tuple[BlockKey, np.ndarray]]:  # [(leaf, ascending row indices [n_i] int64)] in Morton order
    """The block's cell split, as `build_octree` would, into leaves of at most `max_per_block` rows.

    Cells split while they hold more than `max_per_block` rows and are shallower than `max_depth`;
    empty cells are dropped. Rows keep their relative order inside each part, so the parts can be
    gathered from the block's arrays without reordering within a leaf. A block within the cap
    (even an empty one) comes back whole: dropping empty blocks is the caller's decision.
    """
    point_codes = np.asarray(point_codes, dtype=np.int64)
    outside = int((~cell_holds(key, point_codes)).sum())
    if outside:
        raise ValueError(f"{outside} of {len(point_codes)} codes lie outside block {key.name}'s cell")
    if len(point_codes) <= max_per_block or key.depth >= max_depth:
        return [(key, np.arange(len(point_codes), dtype=np.int64))]
    # Building from the root gives exactly the leaves below `key`: every ancestor of `key` holds
    # all N > max_per_block rows and is shallower than max_depth, so each splits, and its other
    # children are empty. That costs key.depth levels of 8 binary searches each: nothing.
    depths, codes, _ = leaves_from_sorted_codes([np.sort(point_codes)], max_per_block, max_depth)
    labels, _ = locate(point_codes, depths, codes)
    order, starts, counts = group_by_label(labels, len(codes))
    return [
        (BlockKey(int(d), int(c)), order[s : s + k])
        for d, c, s, k in zip(depths, codes, starts, counts)
    ]
