"""Home cells of moved points, merge plans and block splits against brute-force references."""
from __future__ import annotations

import re

import numpy as np
import pytest

from octree.assign import leaf_arrays
from octree.build import build_octree
from octree.keys import MAX_DEPTH, BlockKey
from octree.restructure import cell_holds, home_cells, plan_merges, split_rows
from octree.root import RootCube
from tools.scenes import clustered_points


def within(inner: BlockKey, outer: BlockKey) -> bool:
    """Whether cell `inner` lies in cell `outer`, by their digit paths."""
    return inner.depth >= outer.depth and inner.code >> (3 * (inner.depth - outer.depth)) == outer.code


def disjoint(a: BlockKey, b: BlockKey) -> bool:
    return not within(a, b) and not within(b, a)


def ancestor(code: int, depth: int) -> BlockKey:
    """The depth-`depth` cell holding a finest-level code."""
    return BlockKey(depth, code >> (3 * (MAX_DEPTH - depth)))


def reference_home(code: int, leaves: set[BlockKey], holding_leaves: set[BlockKey]) -> BlockKey:
    """Walk down from the root: stop at a leaf, or at the first cell holding no leaf
    (`holding_leaves`: every leaf and every ancestor of one)."""
    for depth in range(MAX_DEPTH + 1):
        cell = ancestor(code, depth)
        if cell in leaves or cell not in holding_leaves:
            return cell
    raise AssertionError("the walk reached the finest level without stopping")


def box_contains(boxes: np.ndarray, points: np.ndarray) -> np.ndarray:  # [N, 6], [N, 3] -> [N]
    return ((points >= boxes[:, :3]) & (points < boxes[:, 3:])).all(axis=1)


@pytest.mark.parametrize("cap,seed", [(1, 0), (5, 1), (40, 2), (300, 3)])
def test_home_cells_against_walk(cap: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    tree = build_octree(clustered_points(600, seed, clusters=4, background=0.0), cap)
    root, leaves = tree.root, tree.keys
    volume = sum(8.0 ** -k.depth for k in leaves)
    assert volume < 1.0  # the tree has holes, so the fallback is exercised
    new = np.asarray(root.lo) + rng.uniform(0, 1, (400, 3)) * root.size
    new = np.concatenate([new, clustered_points(200, seed + 10, clusters=4, background=0.0)])
    new = new[root.contains(new)]
    codes = root.codes(new)
    depths, cells = home_cells(codes, tree.depths, tree.codes)
    assert depths.dtype == np.int64 and cells.dtype == np.int64
    assert box_contains(root.cells(depths, cells), new).all()
    leaf_boxes = tree.cells
    leaf_set = set(leaves)
    holding_leaves = {ancestor(k.morton_rank(), d) for k in leaves for d in range(k.depth + 1)}
    result = [BlockKey(int(d), int(c)) for d, c in zip(depths, cells)]
    n_stray = 0
    for code, point, got in zip(codes.tolist(), new, result):
        holding = np.flatnonzero(box_contains(leaf_boxes, np.broadcast_to(point, (len(leaves), 3))))
        if len(holding):
            assert got == leaves[int(holding[0])]
        else:
            n_stray += 1
            box = np.array(root.cell(got))
            lo, hi = np.maximum(box[:3], leaf_boxes[:, :3]), np.minimum(box[3:], leaf_boxes[:, 3:])
            assert not (lo < hi).all(axis=1).any()  # no leaf box overlaps the new cell's box
            assert got.depth > 0 and any(within(leaf, got.parent()) for leaf in leaves)
        assert got == reference_home(code, leaf_set, holding_leaves)
    assert n_stray > 0
    distinct = sorted(set(result))
    for i, a in enumerate(distinct):
        for b in distinct[i + 1 :]:
            assert disjoint(a, b)


def test_home_cells_hand_made() -> None:
    # One leaf deep in octant 0: a point elsewhere in octant 0 gets a depth-2 cell, a point in
    # octant 5 gets the whole octant, and a finest-level neighbour of the leaf a depth-21 cell.
    leaf = BlockKey(MAX_DEPTH, 0)
    depths, codes = leaf_arrays([leaf])
    points = np.array([0, 1, 3 << 57, 5 << 60, (1 << 60) - 1], dtype=np.int64)
    d, c = home_cells(points, depths, codes)
    got = [BlockKey(int(a), int(b)) for a, b in zip(d, c)]
    assert got == [leaf, BlockKey(MAX_DEPTH, 1), BlockKey(2, 3), BlockKey(1, 5), BlockKey(2, 7)]
    with pytest.raises(ValueError):
        home_cells(points, np.zeros(0, np.int64), np.zeros(0, np.int64))


def reference_merges(keys: list[BlockKey], counts: list[int], limit: int) -> dict[BlockKey, BlockKey]:
    """Merge any mergeable parent, one at a time, in a random order, until none is left."""
    rng = np.random.default_rng(len(keys))
    leaves = dict(zip(keys, counts))
    owner = {k: k for k in keys}
    while True:
        parents = sorted({k.parent() for k in leaves if k.depth > 0})
        rng.shuffle(parents)
        for p in parents:
            inside = [k for k in leaves if within(k, p) and k != p]
            if len(inside) >= 2 and all(k.depth == p.depth + 1 for k in inside):
                if sum(leaves[k] for k in inside) < limit:
                    leaves[p] = sum(leaves.pop(k) for k in inside)
                    owner = {o: (p if within(cur, p) else cur) for o, cur in owner.items()}
                    break
        else:
            return {o: cur for o, cur in owner.items() if cur != o}


def K(depth: int, *octants: int) -> BlockKey:
    """The cell reached from the root by a path of octants (the last `depth` given)."""
    assert len(octants) == depth
    code = 0
    for o in octants:
        code = (code << 3) | o
    return BlockKey(depth, code)


def test_plan_merges_hand_made() -> None:
    three = [K(2, 1, 0), K(2, 1, 3), K(2, 1, 5)]
    assert plan_merges(three, [1, 1, 1], 10) == {k: K(1, 1) for k in three}  # K(1,1) is then alone
    with_grandchild = three + [K(3, 1, 6, 0)]
    assert plan_merges(with_grandchild, [1, 1, 1, 1], 10) == {}
    chain = [K(2, 0, 0), K(2, 0, 1), K(1, 1)]
    assert plan_merges(chain, [1, 1, 1], 4) == {k: K(0) for k in chain}
    assert plan_merges(chain, [1, 1, 1], 3) == {k: K(1, 0) for k in chain[:2]}  # 3 is not < 3
    assert plan_merges([K(2, 3, 5)], [1], 100) == {}  # a lone child never merges
    assert plan_merges([K(1, 0), K(1, 1)], [2, 3], 5) == {}  # equal to the limit: no merge
    assert plan_merges([K(1, 0), K(1, 1)], [2, 3], 6) == {K(1, 0): K(0), K(1, 1): K(0)}
    assert plan_merges([K(0)], [0], 10) == {} and plan_merges([], [], 10) == {}
    with pytest.raises(ValueError):
        plan_merges([K(1, 1), K(1, 0)], [1, 1], 10)  # not in Morton order
    with pytest.raises(ValueError):
        plan_merges([K(1, 0)], [1, 1], 10)


def random_leaves(rng: np.random.Generator, n_splits: int) -> list[BlockKey]:
    """Random subdivisions of the root with some empty cells dropped, in Morton order."""
    leaves = [K(0)]
    for _ in range(n_splits):
        k = leaves.pop(int(rng.integers(len(leaves))))
        if k.depth == 6:
            leaves.append(k)
            continue
        kids = [k.child(o) for o in range(8) if rng.random() < 0.5]
        leaves += kids or [k.child(int(rng.integers(8)))]
    return sorted(leaves, key=BlockKey.morton_rank)


@pytest.mark.parametrize("seed", range(30))
def test_plan_merges_random(seed: int) -> None:
    rng = np.random.default_rng(seed)
    keys = random_leaves(rng, int(rng.integers(1, 25)))
    counts = rng.integers(0, 6, len(keys)).tolist()
    limit = int(rng.integers(1, 40))
    plan = plan_merges(keys, counts, limit)
    assert plan == reference_merges(keys, counts, limit)
    assert all(within(k, p) and k != p for k, p in plan.items())


def test_plan_merges_many_blocks_is_fast() -> None:
    tree = build_octree(clustered_points(200_000, 5), 2)
    plan = plan_merges(tree.keys, tree.counts.tolist(), 6)
    assert 0 < len(plan) < len(tree.keys)


def check_split(codes: np.ndarray, key: BlockKey, cap: int, max_depth: int) -> list[tuple[BlockKey, np.ndarray]]:
    parts = split_rows(codes, key, cap, max_depth)
    rows = np.concatenate([r for _, r in parts])
    assert np.array_equal(np.sort(rows), np.arange(len(codes)))  # every row exactly once
    ranks = [k.morton_rank() for k, _ in parts]
    assert ranks == sorted(ranks) and len(set(ranks)) == len(ranks)
    for k, r in parts:
        assert r.dtype == np.int64 and len(r) > 0 and (np.diff(r) > 0).all()
        assert within(k, key) and k.depth <= max(max_depth, key.depth)
        assert ((codes[r] >> (3 * (MAX_DEPTH - k.depth))) == k.code).all()
        assert len(r) <= cap or k.depth == max_depth
        if k != key:  # its parent needed splitting
            assert ((codes >> (3 * (MAX_DEPTH - k.depth + 1))) == k.parent().code).sum() > cap
    return parts


@pytest.mark.parametrize("cap", [1, 9, 64, 1000])
def test_split_rows_of_root_matches_build(cap: int) -> None:
    points = clustered_points(2000, cap)
    tree = build_octree(points, cap, min_cell_size=0.05)
    codes = tree.root.codes(points)
    parts = check_split(codes, BlockKey(0, 0), cap, tree.max_depth)
    assert [k for k, _ in parts] == tree.keys
    for i, (_, r) in enumerate(parts):
        assert np.array_equal(r, np.sort(tree.members(i)))


@pytest.mark.parametrize("seed", range(8))
def test_split_rows_of_inner_block(seed: int) -> None:
    rng = np.random.default_rng(seed)
    depth = int(rng.integers(1, 8))
    key = BlockKey(depth, int(rng.integers(8**depth)))
    span = 8 ** (MAX_DEPTH - key.depth)
    centres = rng.integers(0, span, 3)
    offsets = rng.integers(0, max(1, span >> int(rng.integers(0, 30))), 300)
    codes = key.morton_rank() + (centres[rng.integers(0, 3, 300)] + offsets) % span
    codes[:10] = codes[10]  # coincident rows: a cell only max_depth can stop
    cap = int(rng.integers(1, 50))
    max_depth = min(MAX_DEPTH, key.depth + int(rng.integers(1, 12)))
    parts = check_split(codes, key, cap, max_depth)
    if cap < 11:
        assert any(k.depth == max_depth and len(r) > cap for k, r in parts)


def test_split_rows_within_cap_and_stray_code() -> None:
    key = K(2, 3, 6)
    codes = key.morton_rank() + np.array([5, 1, 9, 1], dtype=np.int64)
    whole = split_rows(codes, key, 4, MAX_DEPTH)
    assert len(whole) == 1 and whole[0][0] == key and np.array_equal(whole[0][1], np.arange(4))
    at_depth = split_rows(codes, key, 1, key.depth)  # already at max_depth: nothing splits
    assert [k for k, _ in at_depth] == [key]
    empty = split_rows(np.zeros(0, np.int64), key, 4, MAX_DEPTH)
    assert empty[0][0] == key and len(empty[0][1]) == 0
    stray = np.append(codes, key.morton_rank() - 1)
    with pytest.raises(ValueError, match=re.escape(key.name)):
        split_rows(stray, key, 100, MAX_DEPTH)


def test_cell_holds_against_boxes_and_digits() -> None:
    rng = np.random.default_rng(0)
    root = RootCube((-1.0, 2.0, 0.5), 3.0)
    points = np.asarray(root.lo) + rng.uniform(0, 1, (2000, 3)) * root.size
    codes = root.codes(points)
    for _ in range(40):
        depth = int(rng.integers(0, 5))
        key = ancestor(int(codes[rng.integers(len(codes))]), depth) if rng.random() < 0.8 else BlockKey(depth, 0)
        box = np.array(root.cell(key))
        assert np.array_equal(cell_holds(key, codes), box_contains(np.broadcast_to(box, (len(points), 6)), points))
        # The cell's first and last codes and their neighbours, by digit paths.
        first = key.morton_rank()
        size = 8 ** (MAX_DEPTH - depth)
        edge = [c for c in (first - 1, first, first + size - 1, first + size) if 0 <= c < 2**63]
        expect = [ancestor(c, depth) == key for c in edge]
        assert cell_holds(key, np.array(edge, dtype=np.int64)).tolist() == expect
    assert cell_holds(BlockKey(0, 0), np.array([0, 2**63 - 1], dtype=np.int64)).all()
