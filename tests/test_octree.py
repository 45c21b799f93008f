"""Octree construction, Morton order, boxes, assignment, adjacency and partition against brute force."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from octree import (
    RootCube,
    assign_points,
    build_octree,
    extent_boxes,
    leaves_from_sorted_codes,
    neighbours,
    partition,
    region_weights,
    tight_boxes,
)
from octree import morton
from octree.bounds import EXTENT_SIGMA, extent_box, tight_box
from octree.keys import MAX_DEPTH, BlockKey
from tools.scenes import clustered_points


def reference_leaves(points: np.ndarray, root: RootCube, cap: int, max_depth: int) -> dict:
    """Recursive subdivision by box containment: {(depth, (i, j, k)): sorted point indices}, and
    each leaf's octant path from the root (whose lexicographic order is Morton order)."""
    leaves, paths = {}, {}

    def visit(depth: int, ijk: tuple, path: tuple, idx: np.ndarray) -> None:
        if len(idx) == 0:
            return
        if len(idx) <= cap or depth == max_depth:
            leaves[(depth, ijk)] = np.sort(idx)
            paths[(depth, ijk)] = path
            return
        for octant in range(8):
            child = tuple(2 * k + ((octant >> axis) & 1) for axis, k in enumerate(ijk))
            lo = root.edges(np.array(child), depth + 1)
            hi = root.edges(np.array(child) + 1, depth + 1)
            inside = ((points[idx] >= lo) & (points[idx] < hi)).all(axis=1)
            visit(depth + 1, child, path + (octant,), idx[inside])

    visit(0, (0, 0, 0), (), np.arange(len(points)))
    return leaves, paths


def test_morton_matches_bit_interleaving():
    rng = np.random.default_rng(0)
    ijk = rng.integers(0, 1 << MAX_DEPTH, (300, 3))
    codes = morton.encode(ijk)
    for (i, j, k), code in zip(ijk.tolist(), codes.tolist()):
        bits = [((c >> b) & 1) << (3 * b + axis) for b in range(MAX_DEPTH) for axis, c in enumerate((i, j, k))]
        expected = sum(bits)
        assert code == expected
    assert (morton.decode(codes) == ijk).all()


@pytest.mark.parametrize("cap", [1, 7, 150])
def test_build_matches_recursive_reference(cap):
    points = clustered_points(3000, seed=cap)
    tree = build_octree(points, cap)
    ref, paths = reference_leaves(points.astype(np.float64), tree.root, cap, MAX_DEPTH)
    ijk = morton.decode(tree.codes)
    ours = {(int(d), tuple(c.tolist())): np.sort(tree.members(i)) for i, (d, c) in enumerate(zip(tree.depths, ijk))}
    assert ours.keys() == ref.keys()
    for key, idx in ref.items():
        assert np.array_equal(ours[key], idx), key
    # Morton order is the depth-first order of the octant paths.
    ordered = [(int(d), tuple(c.tolist())) for d, c in zip(tree.depths, ijk)]
    assert ordered == sorted(ordered, key=lambda key: paths[key])


def test_every_point_in_exactly_one_leaf_inside_its_cell():
    points = clustered_points(60_000, seed=1)
    tree = build_octree(points, 500)
    assert np.array_equal(np.sort(tree.order), np.arange(len(points)))  # a permutation: exactly once
    assert tree.counts.sum() == len(points) and (tree.counts > 0).all()
    assert tree.counts.max() <= 500
    cells = tree.cells[tree.labels()]
    p = points.astype(np.float64)
    assert ((p >= cells[:, :3]) & (p < cells[:, 3:])).all()
    assert np.array_equal(np.cumsum(np.r_[0, tree.counts[:-1]]), tree.starts)


def test_cells_are_disjoint_and_tile_the_points_region():
    tree = build_octree(clustered_points(20_000, seed=2), 64)
    cells = tree.cells
    lo, hi = cells[:, :3], cells[:, 3:]
    overlap = ((lo[:, None] < hi[None]) & (lo[None] < hi[:, None])).all(axis=2)
    np.fill_diagonal(overlap, False)
    assert not overlap.any()
    # A leaf's volume is 8**-depth of the root's, with the edges computed from the same dyadic fractions.
    assert np.allclose(np.prod(hi - lo, axis=1), tree.root.size**3 / 8.0**tree.depths, rtol=1e-9)


def test_coincident_points_stop_at_min_cell_size():
    rng = np.random.default_rng(3)
    spread = rng.uniform(0, 1, (400, 3))
    stack = np.repeat(np.array([[0.25, 0.5, 0.75]]), 300, axis=0)  # 300 copies of one point
    points = np.concatenate([spread, stack]).astype(np.float32)
    tree = build_octree(points, 50, min_cell_size=0.01)
    assert tree.max_depth == tree.root.max_depth(0.01)
    assert tree.root.size / 2**tree.max_depth >= 0.01 > tree.root.size / 2 ** (tree.max_depth + 1)
    over = tree.counts > 50
    assert over.sum() == 1 and tree.counts[over][0] >= 300
    assert (tree.depths[over] == tree.max_depth).all()
    # Without a minimum size the pile stops at the finest level instead of recursing forever.
    deep = build_octree(points, 50)
    assert deep.depths[deep.counts > 50].tolist() == [MAX_DEPTH]


def test_single_leaf_and_bad_input():
    tree = build_octree(np.zeros((5, 3), np.float32), 10)
    assert tree.keys == [BlockKey(0, 0)] and tree.counts.tolist() == [5]
    with pytest.raises(ValueError, match="zero points"):
        build_octree(np.zeros((0, 3)), 10)
    with pytest.raises(ValueError, match="1 of 3 points have NaN"):
        build_octree(np.array([[0, 0, 0], [1, np.nan, 0], [2, 2, 2]]), 10)
    with pytest.raises(ValueError, match="shape"):
        build_octree(np.zeros((4, 2)), 10)
    with pytest.raises(ValueError, match="outside the root cube"):
        build_octree(np.array([[0.5, 0.5, 0.5], [3.0, 0, 0]]), 1, root=RootCube((0, 0, 0), 1.0))


def test_order_independent_and_deterministic():
    points = clustered_points(10_000, seed=4)
    perm = np.random.default_rng(0).permutation(len(points))
    a, b = build_octree(points, 100), build_octree(points[perm], 100)
    assert a.keys == b.keys and np.array_equal(a.counts, b.counts)
    assert np.array_equal(a.labels()[perm], b.labels())
    # Within a leaf, points keep their input order.
    for i in range(len(a.counts)):
        assert (np.diff(a.members(i)) > 0).all()


def test_sorted_runs_give_the_same_leaves():
    points = clustered_points(20_000, seed=5)
    root = RootCube.of_points(points)
    codes = root.codes(points)
    one = leaves_from_sorted_codes([np.sort(codes)], 200)
    runs = [np.sort(chunk) for chunk in np.array_split(codes, 7)]
    many = leaves_from_sorted_codes(runs, 200)
    for x, y in zip(one, many):
        assert np.array_equal(x, y)


def test_morton_order_is_spatially_coherent():
    tree = build_octree(clustered_points(50_000, seed=6), 100)
    cells = tree.cells
    centres = (cells[:, :3] + cells[:, 3:]) / 2
    sizes = cells[:, 3] - cells[:, 0]
    # Every subtree's leaves are contiguous in Morton order (checked above against octant paths);
    # so consecutive leaves are close: compare with a random order, in units of the cells' size.
    step = np.linalg.norm(np.diff(centres, axis=0), axis=1) / np.maximum(sizes[1:], sizes[:-1])
    shuffled = centres[np.random.default_rng(0).permutation(len(centres))]
    random_step = np.linalg.norm(np.diff(shuffled, axis=0), axis=1) / np.maximum(sizes[1:], sizes[:-1])
    assert np.median(step) <= 1.5 < 0.1 * np.median(random_step)


def test_block_boxes_match_bounds_module_bit_for_bit():
    rng = np.random.default_rng(7)
    means = clustered_points(5000, seed=7)
    log_scales = rng.uniform(-5, 0, (5000, 3)).astype(np.float32)
    tree = build_octree(means, 80)
    tight = tight_boxes(means[tree.order], tree.starts)
    ext = extent_boxes(means[tree.order], log_scales[tree.order], tree.starts)
    for i in range(len(tree.counts)):
        rows = tree.members(i)
        assert tuple(tight[i]) == tight_box(means[rows])
        assert tuple(ext[i]) == extent_box(means[rows], log_scales[rows])
        # and as the definition reads, in plain numpy over the block's rows
        m = means[rows].astype(np.float64)
        r = EXTENT_SIGMA * np.exp(log_scales[rows].max(axis=1).astype(np.float64))[:, None]
        assert np.array_equal(ext[i], np.concatenate([(m - r).min(axis=0), (m + r).max(axis=0)]))
        assert np.array_equal(tight[i], np.concatenate([m.min(axis=0), m.max(axis=0)]))
        cell = tree.cells[i]
        assert (cell[:3] <= tight[i, :3]).all() and (tight[i, 3:] < cell[3:]).all()


def test_assign_points_moved_and_stray():
    rng = np.random.default_rng(8)
    points = clustered_points(8000, seed=8)
    tree = build_octree(points, 60)
    keys, cells = tree.keys, tree.cells
    assert np.array_equal(assign_points(points, tree.root, keys), tree.labels())
    moved = points + rng.normal(0, 0.3, points.shape).astype(np.float32)
    outside = rng.uniform(-40, 40, (200, 3)).astype(np.float32)
    queries = np.concatenate([moved, outside]).astype(np.float64)
    got = assign_points(queries, tree.root, keys)
    lo, hi = cells[:, :3], cells[:, 3:]
    for p, leaf in zip(queries, got):
        holder = np.flatnonzero(((p >= lo) & (p < hi)).all(axis=1))
        if len(holder):
            assert leaf == holder[0]
        else:  # nearest cell by Euclidean distance, first in Morton order on ties
            dist = np.linalg.norm(np.maximum(np.maximum(lo - p, p - hi), 0), axis=1)
            assert leaf == np.flatnonzero(dist == dist.min())[0]


def test_assign_points_refuses_overlapping_keys():
    root = RootCube((0, 0, 0), 1.0)
    with pytest.raises(ValueError, match="1-0 and 2-3 overlap"):
        assign_points(np.zeros((1, 3)), root, [BlockKey(1, 0), BlockKey(2, 3)])


def test_neighbours_match_brute_force_touching():
    tree = build_octree(clustered_points(15_000, seed=9), 40)
    indptr, indices = neighbours(tree.keys)
    cells = tree.cells  # faces of adjacent cells are bit-identical floats (dyadic fractions)
    lo, hi = cells[:, :3], cells[:, 3:]
    touch = ((lo[:, None] <= hi[None]) & (lo[None] <= hi[:, None])).all(axis=2)
    np.fill_diagonal(touch, False)
    ours = np.zeros_like(touch)
    for i in range(len(cells)):
        row = indices[indptr[i] : indptr[i + 1]]
        assert (np.diff(row) > 0).all()
        ours[i, row] = True
    assert np.array_equal(ours, touch)
    assert touch.sum() > 10 * len(cells)  # face, edge and corner contacts all occur


def optimal_bottleneck(weights: list[float], parts: int) -> float:
    """Exhaustive minimum over all placements of the region bounds."""
    n = len(weights)
    prefix = np.r_[0.0, np.cumsum(weights)]
    best = np.inf
    for cuts in itertools.combinations(range(1, n), parts - 1):
        b = (0, *cuts, n)
        best = min(best, max(prefix[b[i + 1]] - prefix[b[i]] for i in range(parts)))
    return best


def test_partition_is_optimal_on_small_cases():
    rng = np.random.default_rng(10)
    for trial in range(60):
        n = int(rng.integers(3, 11))
        parts = int(rng.integers(2, n + 1))
        w = rng.integers(0, 20, n).astype(float) if trial % 2 else rng.exponential(1.0, n)
        bounds = partition(w, parts)
        assert bounds[0] == 0 and bounds[-1] == n and (np.diff(bounds) >= 1).all()
        assert region_weights(w, bounds).max() == pytest.approx(optimal_bottleneck(list(w), parts), rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("parts", [2, 3, 5, 8, 16])
def test_partition_balance_bound_on_octree_blocks(parts):
    tree = build_octree(clustered_points(200_000, seed=11), 1000)
    bounds = partition(tree.counts, parts)
    weights = region_weights(tree.counts, bounds)
    assert weights.sum() == tree.counts.sum()
    assert weights.max() / weights.mean() <= 1.05


def test_partition_edge_cases():
    assert partition(np.array([5.0, 1.0]), 4).tolist() == [0, 1, 2, 2, 2]  # fewer blocks than regions
    assert partition(np.array([]), 3).tolist() == [0, 0, 0, 0]
    b = partition(np.array([100.0, 1, 1, 1, 1]), 2)  # one block outweighs the rest: granularity limit
    assert b.tolist() == [0, 1, 5]
    with pytest.raises(ValueError, match="non-negative"):
        partition(np.array([1.0, -1.0]), 2)
