"""train.layout, the one ownership / visibility / assignment module, against the code paths it
replaced (the trainer's per-key sums, the bench's own culling loops) and brute force."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from octree import frustum_cull, partition
from octree.keys import parse_key
from storage import Store
from tools.bench import mpi
from tools.scenes import CityConfig, generate_city
from train import layout
from train.assign import assign_cameras
from train.config import TrainConfig
from train.region import Ownership, Region
from train.trainer import assign_step, load_cameras


@pytest.fixture(scope="module")
def wall_scene(wall):
    data, store_path = wall
    store = Store.open(store_path, mode="r")
    cameras = load_cameras(TrainConfig(data=data, store=store_path), store).train
    return store, cameras


def _old_weights(counts, extents, cameras):  # the formula as train/region.py had it
    seen = np.zeros(len(counts))
    for c in cameras:
        seen += frustum_cull(extents, c.viewmat, c.K, c.width, c.height)
    return np.asarray(counts, dtype=np.float64) * seen if seen.any() else np.asarray(counts, dtype=np.float64)


def test_block_table_is_the_store_table_in_morton_order(wall_scene):
    store, _ = wall_scene
    t = layout.BlockTable.from_store(store.table)
    assert t.keys == sorted(store.table, key=lambda k: parse_key(k).morton_rank()) and len(t.keys) == len(store.table)
    for k, n, box in zip(t.keys, t.counts, t.extents):
        assert n == store.table[k].count and tuple(box) == store.table[k].extent
    assert (t.nbytes(store.sh_degree) == t.counts * 724).all()  # the 724 B a Gaussian of SH degree 3
    with pytest.raises(ValueError, match="block table"):
        layout.BlockTable(t.keys, t.counts[:-1], t.extents)


def test_visibility_ownership_and_affinity_equal_the_old_code(wall_scene):
    store, cameras = wall_scene
    t = layout.BlockTable.from_store(store.table)
    for c in cameras[:5]:
        np.testing.assert_array_equal(layout.visible_mask(t.extents, c),
                                      frustum_cull(t.extents, c.viewmat, c.K, c.width, c.height))
    assert layout.visible_mask(np.zeros((0, 6)), cameras[0]).shape == (0,)
    weights = layout.ownership_weights(t.counts, t.extents, cameras)
    np.testing.assert_array_equal(weights, _old_weights(t.counts, t.extents, cameras))
    np.testing.assert_array_equal(layout.ownership_weights(t.counts, t.extents, []), t.counts.astype(np.float64))
    for ranks in (1, 3, 8):
        bounds = layout.balanced_bounds(t.counts, t.extents, cameras, ranks)
        np.testing.assert_array_equal(bounds, partition(_old_weights(t.counts, t.extents, cameras), ranks))
        owner = layout.block_ranks(bounds)
        ownership = Ownership.balanced(store.table, ranks, cameras)
        assert [ownership.owner(k) for k in t.keys] == owner.tolist()  # the trainer's regions are these
        visible = np.array([layout.visible_mask(t.extents, c) for c in cameras[:6]])
        affinity = layout.rank_affinity(t.counts, owner, ranks, visible)
        for i, c in enumerate(cameras[:6]):  # brute force: every block, one by one
            for b, k in enumerate(t.keys):
                seen = frustum_cull(t.extents[b : b + 1], c.viewmat, c.K, c.width, c.height)[0]
                affinity[i, owner[b]] -= t.counts[b] * seen
        assert not affinity.any()


class _Gathered:
    """An exchange of `size` ranks whose gather_rows returns the rows every rank computed."""

    def __init__(self, rows: np.ndarray) -> None:
        self.rows, self.size = rows, len(rows)

    def gather_rows(self, row: np.ndarray) -> np.ndarray:
        assert any(np.array_equal(row, r) for r in self.rows)
        return self.rows


def test_the_trainers_camera_assignment_is_the_shared_one_and_the_old_one(wall_scene):
    store, cameras = wall_scene
    ranks, per_rank = 4, 2
    ownership = Ownership.balanced(store.table, ranks, cameras)
    regions = [Region.from_table(store.table, ownership.keys_of(store.table, r)) for r in range(ranks)]
    for step in range(3):
        cams = cameras[step * ranks * per_rank : (step + 1) * ranks * per_rank]
        # What the trainer computed before: per camera, the sum of the visible owned blocks' counts.
        old_rows = []
        for region in regions:
            counts = dict(zip(region.keys, region.counts))
            old_rows.append([sum(counts[k] for k in region.visible(c)) for c in cams])
        old_rows = np.array(old_rows, dtype=np.float64)
        rows = np.stack([layout.visible_counts(r.counts, r.extents, cams).astype(np.float64) for r in regions])
        np.testing.assert_array_equal(rows, old_rows)
        expected = assign_cameras(old_rows.T, per_rank)
        for r in range(ranks):
            assert assign_step(cams, regions[r], _Gathered(rows), per_rank) == expected
        t = layout.BlockTable.from_store(store.table)
        owner = layout.block_ranks(layout.balanced_bounds(t.counts, t.extents, cameras, ranks))
        visible = np.array([layout.visible_mask(t.extents, c) for c in cams])
        np.testing.assert_array_equal(layout.rank_affinity(t.counts, owner, ranks, visible), old_rows.T)
        assert layout.assign_step(old_rows.T, per_rank).tolist() == expected
    assert layout.assign_step(np.ones((3, 1)), 3).tolist() == [0, 0, 0]


def test_assignment_is_the_balanced_optimum(wall_scene):
    rng = np.random.default_rng(3)
    affinity = rng.integers(0, 100, (6, 3))
    got = layout.assign_step(affinity, 2)
    assert np.bincount(got, minlength=3).tolist() == [2, 2, 2]
    best = max(sum(affinity[c, r] for c, r in enumerate(p)) for p in set(itertools.permutations([0, 0, 1, 1, 2, 2])))
    assert affinity[np.arange(6), got].sum() == best


def test_the_bench_layout_uses_the_shared_module():
    city = generate_city(CityConfig(blocks=1, density=0.5, cameras=12, width=160, height=90))
    lay = mpi.build_layout(city.splats(), ranks=3, max_per_block=40, cameras=city.cameras)
    np.testing.assert_array_equal(lay.bounds, partition(_old_weights(lay.counts, lay.extents, city.cameras), 3))
    np.testing.assert_array_equal(lay.block_rank, np.repeat(np.arange(3), np.diff(lay.bounds)))
    affinity = mpi.block_affinity(lay, city.cameras)
    for i, c in enumerate(city.cameras):
        seen = frustum_cull(lay.extents, c.viewmat, c.K, c.width, c.height)
        assert affinity[i].tolist() == [int(lay.counts[seen & (lay.block_rank == r)].sum()) for r in range(3)]


def test_saved_regions_are_the_ones_a_resume_and_the_viewer_use(wall_scene):
    store, cameras = wall_scene
    keys = sorted(store.table, key=lambda k: parse_key(k).morton_rank())
    balanced = Ownership.balanced(store.table, 3, cameras)
    skewed = Ownership((parse_key(keys[1]).morton_rank(), parse_key(keys[2]).morton_rank()))  # not balanced
    assert skewed != balanced
    state = {"step": 5, "regions": skewed.to_state()}
    assert Ownership.current(state, store.table, 3, cameras) == skewed
    assert [skewed.owner(k) for k in keys[:3]] == [0, 1, 2] and {skewed.owner(k) for k in keys[3:]} == {2}
    # another rank count, or a commit without regions: balanced, as a new run would start
    assert Ownership.current(state, store.table, 2, cameras) == Ownership.balanced(store.table, 2, cameras)
    assert Ownership.current({"step": 5}, store.table, 3, cameras) == balanced


@pytest.mark.parametrize("regions", [
    [1, 2], {"ranks": 3}, {"ranks": 3, "cuts": [5]}, {"ranks": 3, "cuts": [9, 5]}, {"ranks": 0, "cuts": []},
    {"ranks": 2, "cuts": [-1]}, {"ranks": 2, "cuts": [2**64]}, {"ranks": 2, "cuts": [1.5]}, {"ranks": True, "cuts": []},
    {"ranks": 2, "cuts": [1], "extra": 0},
])
def test_malformed_saved_regions_are_refused(wall_scene, regions):
    store, cameras = wall_scene
    with pytest.raises(ValueError, match="commit state: 'regions'"):
        Ownership.current({"regions": regions}, store.table, 3, cameras)
