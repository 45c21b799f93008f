"""The octree invariants a store keeps after every refinement, checked from its arrays."""
from __future__ import annotations

import numpy as np

from octree.bounds import extent_box, tight_box
from octree.keys import parse_key
from octree.restructure import cell_holds
from octree.root import RootCube
from storage import Store


def check_layout(store: Store, cap: int, *, refined_last: bool = True) -> int:
    """Assert that every Gaussian lies in exactly one block, inside that block's cell (or beyond
    the root cube, in the border cell nearest it), that no block holds more than `cap` (but at
    the deepest level) and that the table's boxes are the arrays' boxes; returns the number of
    Gaussians. Means drift across cell borders between refinements (the next one migrates them),
    so the cell test holds only for a store committed by a refinement (`refined_last`)."""
    octree = store.attrs["octree"]
    root, max_depth = RootCube.from_attrs(octree), int(octree["max_depth"])
    keys = sorted(store.table, key=lambda k: parse_key(k).morton_rank())
    total = 0
    for a, b in zip(keys, keys[1:]):  # disjoint cells: each ends before the next begins
        ka, kb = parse_key(a), parse_key(b)
        assert (ka.code + 1) << 3 * (21 - ka.depth) <= kb.morton_rank(), f"cells {a} and {b} overlap"
    for key in keys:
        info, k = store.table[key], parse_key(key)
        arrays = store.read_block(key)
        means = arrays["means"].astype(np.float64)
        assert len(means) == info.count > 0
        # a mean beyond the root cube belongs to the border cell holding it clamped onto the cube
        assert not refined_last or cell_holds(k, root.codes(means)).all(), f"{key}: a mean outside its cell"
        assert info.count <= cap or k.depth == max_depth, f"{key}: {info.count} Gaussians > {cap}"
        assert info.cell == tuple(root.cells(np.array([k.depth]), np.array([k.code]))[0])
        assert info.tight == tight_box(arrays["means"])
        assert info.extent == extent_box(arrays["means"], arrays["scales"])
        total += info.count
    return total


def assert_same_blocks(a: Store, b: Store, what: str = "") -> None:
    """The same blocks with every array (parameters, Adam state, statistics) equal bit for bit."""
    assert b.table.keys() == a.table.keys(), what
    for k in a.table:
        x, y = a.read_block(k), b.read_block(k)
        for name in x:
            np.testing.assert_array_equal(y[name], x[name], err_msg=f"{what} {k}/{name}")


def rank_free_state(state: dict) -> dict:
    """A commit's training state less its regions, which depend on the rank count by design."""
    return {k: v for k, v in state.items() if k != "regions"}
