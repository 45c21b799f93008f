"""The out-of-core trainer on one rank: exactness against in-memory, resume, learning, guards."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from storage import Store
from storage.schema import PARAM_NAMES, bytes_per_gaussian
from tools.export import main as export_main
from tools.tile.__main__ import main as tile_main
from train.config import OptimConfig, TrainConfig
from train.trainer import TrainError, run

REPO = Path(__file__).resolve().parents[1]


def _copy(store: Path, tmp_path: Path, name: str) -> Path:
    dst = tmp_path / name
    shutil.copytree(store, dst)
    return dst


def _config(data: Path, store: Path, out: Path, **kw) -> TrainConfig:
    base = dict(data=str(data), store=str(store), out=str(out), steps=12, data_factor=1,
                commit_every=5, log_every=1, progress=False, deterministic=True)
    base.update(kw)
    return TrainConfig(**base)


def _params(store: Path) -> dict[str, dict[str, np.ndarray]]:
    s = Store.open(store, mode="r")
    return {k: s.read_block(k) for k in s.table}


def _assert_same_training(pa: dict, pb: dict) -> None:
    """Every array of every block (parameters, Adam moments and step counts, densification
    statistics) bit for bit: the paging, the process boundary and the schedule are invisible."""
    assert pa.keys() == pb.keys()
    for k in pa:
        assert pa[k].keys() == pb[k].keys()
        for name in pa[k]:
            np.testing.assert_array_equal(pb[k][name], pa[k][name], err_msg=f"{k}/{name}")


def _scene_bytes(store: Path) -> int:
    s = Store.open(store, mode="r")
    return sum(i.count for i in s.table.values()) * bytes_per_gaussian(int(s.attrs["sh_degree"]))


def test_out_of_core_equals_in_memory(wall, tmp_path):
    data, store = wall
    full = _copy(store, tmp_path, "full.zarr")
    small = _copy(store, tmp_path, "small.zarr")
    quarter_mb = _scene_bytes(store) / 4 / 2**20
    a = run(_config(data, full, tmp_path / "a", cache_mb=1024, steps=16))
    b = run(_config(data, small, tmp_path / "b", cache_mb=quarter_mb, steps=16))
    assert b["bytes_read"] > a["bytes_read"], "the small cache must have paged blocks in again"
    pa, pb = _params(full), _params(small)
    _assert_same_training(pa, pb)
    changed = sum(int((a["adam_step"] > 0).sum()) for a in pa.values())
    assert changed > 1000, "training must have stepped many Gaussians"
    assert a["test_psnr"] == pytest.approx(b["test_psnr"], abs=1e-3)


def test_resume_equals_uninterrupted(wall, tmp_path):
    data, store = wall
    straight = _copy(store, tmp_path, "straight.zarr")
    resumed = _copy(store, tmp_path, "resumed.zarr")
    run(_config(data, straight, tmp_path / "s"))
    # one slice of a 12-step run (the learning rates decay over all 12 steps), then the rest
    first = run(_config(data, resumed, tmp_path / "r1", stop_at=5))
    assert first["interrupted"] and Store.open(resumed, mode="r").state["step"] == 5
    with pytest.raises(TrainError, match="--resume"):
        run(_config(data, resumed, tmp_path / "r2"))
    run(_config(data, resumed, tmp_path / "r2", resume=True))
    _assert_same_training(_params(straight), _params(resumed))


def test_training_raises_held_out_psnr(shared_data, lund_store, tmp_path):
    store = _copy(lund_store, tmp_path, "learn.zarr")
    out = tmp_path / "learn"
    lund = shared_data / "lund_door"
    summary = run(_config(lund, store, out, steps=300, data_factor=8, commit_every=100,
                          log_every=10, eval_every=150, deterministic=False))
    evals = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if '"eval"' in l]
    # held-out PSNR of the untrained initialisation, measured the same way
    base = run(_config(lund, _copy(lund_store, tmp_path, "base.zarr"), tmp_path / "base", steps=0, data_factor=8))
    assert summary["test_psnr"] > base["test_psnr"] + 3.0, (summary, base)
    assert evals and (out / "metrics.png").stat().st_size > 0
    assert sorted(p.name for p in (out / "renders").glob("*/*.png"))


def test_nan_image_skips_the_step_and_never_reaches_the_store(wall, tmp_path, monkeypatch):
    import torch

    from train.data.scene import SceneData

    data, tiled = wall
    store = _copy(tiled, tmp_path, "nan.zarr")
    real = SceneData.load_image
    calls = {"n": 0}

    def poisoned(self, camera):
        calls["n"] += 1
        img = real(self, camera)
        return torch.full_like(img, float("nan")) if calls["n"] == 2 else img

    monkeypatch.setattr(SceneData, "load_image", poisoned)
    out = tmp_path / "nan"
    run(_config(data, store, out, steps=4))
    lines = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines if l["kind"] == "skipped"] == [2]
    for arrays in _params(store).values():
        for name, a in arrays.items():
            assert np.isfinite(a).all(), name


def test_budget_too_small_and_wrong_scene_are_clear_errors(wall, lund_store, tmp_path):
    data, tiled = wall
    store = _copy(tiled, tmp_path, "tiny.zarr")
    with pytest.raises(TrainError, match="too small"):
        run(_config(data, store, tmp_path / "t", cache_mb=0.01))
    assert Store.open(store, mode="r").state.get("step", 0) == 0
    # the wall's photos against lund_door's store
    proc = subprocess.run(
        [sys.executable, "-m", "train", "--data", str(data), "--store", str(lund_store),
         "--out", str(tmp_path / "w"), "--steps", "2", "--no-progress"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.startswith("error:") and "do not belong together" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_export_then_tile_round_trips_bit_for_bit(wall, tmp_path):
    data, tiled = wall
    store = _copy(tiled, tmp_path, "trained.zarr")
    run(_config(data, store, tmp_path / "o", steps=3))
    first, second = tmp_path / "first.ply", tmp_path / "second.ply"
    assert export_main([str(store), "--out", str(first)]) == 0
    assert tile_main([str(first), "--out", str(tmp_path / "again.zarr"), "--max-per-block", "300"]) == 0
    assert export_main([str(tmp_path / "again.zarr"), "--out", str(second)]) == 0
    a = np.fromfile(first, dtype=np.uint8)
    b = np.fromfile(second, dtype=np.uint8)
    assert len(a) == len(b)
    # same Gaussians, possibly in another block order: compare rows as sets
    from tools.ply import open_ply

    ra, rb = open_ply(first).read(0, 10**9), open_ply(second).read(0, 10**9)
    order_a = np.lexsort(ra["means"].T)
    order_b = np.lexsort(rb["means"].T)
    for name in ra:
        np.testing.assert_array_equal(ra[name][order_a], rb[name][order_b], err_msg=name)


def test_regions_cover_every_block_once_and_balance_viewed_work(wall):
    """Ownership: R contiguous Morton ranges that together hold every block exactly once, balanced
    by what owning costs (Gaussians x training cameras that see them) better than by count."""
    from octree.partition import partition, region_weights
    from train.region import Region, ownership_weights
    from train.trainer import load_cameras, owned_blocks

    data, store_path = wall
    store = Store.open(store_path, mode="r")
    cameras = load_cameras(_config(data, store_path, Path("unused")), store).train
    everything = Region.from_table(store.table)
    work = ownership_weights(everything.counts, everything.extents, cameras)
    assert (work <= everything.counts * len(cameras)).all() and work.sum() > 0
    for ranks in (2, 4, 8):
        regions = [owned_blocks(store.table, r, ranks, cameras) for r in range(ranks)]
        assert sum(regions, []) == everything.keys  # contiguous, in Morton order, each block once
        bounds = np.cumsum([0] + [len(r) for r in regions])
        by_work = region_weights(work, bounds)
        by_count = region_weights(work, partition(everything.counts.astype(np.float64), ranks))
        assert by_work.max() / by_work.mean() <= by_count.max() / by_count.mean() + 1e-9


def test_a_nan_storm_stops_the_run_with_a_clear_error_and_a_clean_store(wall, tmp_path):
    """An exploding learning rate: after the first step every loss is non-finite. The steps are
    skipped and counted, the run stops after --max-skipped of them, and no NaN reaches the store."""
    data, tiled = wall
    store = _copy(tiled, tmp_path, "storm.zarr")
    out = tmp_path / "storm"
    with pytest.raises(TrainError, match=r"steps 2 to 4: 3 steps in a row had a non-finite loss") as e:
        run(_config(data, store, out, steps=50, commit_every=3, max_skipped=3, optim=OptimConfig(sh0_lr=1e30)))
    assert "the store keeps its last commit, step 3" in str(e.value)
    lines = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines if l["kind"] == "skipped"] == [2, 3, 4]
    s = Store.open(store, mode="r")
    assert s.state["step"] == 3
    for arrays in _params(store).values():
        for name, a in arrays.items():
            assert np.isfinite(a).all(), name


def test_scales_that_overflow_still_commit_finite_boxes(wall, tmp_path):
    """An exploding scales learning rate gives log-scales of 1e30: exp() overflows, so their
    blocks' extent boxes reach everywhere. The commit (JSON, no inf) must still be written."""
    data, tiled = wall
    store = _copy(tiled, tmp_path, "huge.zarr")
    run(_config(data, store, tmp_path / "huge", steps=3, commit_every=1, optim=OptimConfig(scales_lr=1e30)))
    s = Store.open(store, mode="r")
    assert s.state["step"] == 3
    boxes = np.array([info.extent for info in s.table.values()])
    assert np.isfinite(boxes).all()
    assert (boxes[:, 3:] - boxes[:, :3]).max() > 1e300, "a block with an overflowing scale reaches everywhere"


def test_narrow_gathers_and_blocks_on_threads_train_as_the_whole_batch_does(wall, tmp_path, monkeypatch):
    """A step gathers only the SH coefficients its degree reads, and shares its blocks' Adam among
    threads. Against a run that gathers every coefficient and steps the blocks one by one on this
    thread, over SH degrees 0, 1 and 2 (degree 1's coefficients are a strided view of each
    block): every array of every block bit for bit."""
    import numba

    import train.blockwise as blockwise
    import train.step as step_module

    data, tiled = wall
    seen = {"threads": [], "shN": set()}
    real_share, real_gather = step_module.share_blocks, step_module.gather

    def share(n, threads, work):
        seen["threads"].append(threads)
        return real_share(n, threads, work)

    def gather(blocks, keys, requires_grad, **kwargs):
        batch = real_gather(blocks, keys, requires_grad, **kwargs)
        if requires_grad:  # a training step's batch (evaluations render at their own degree)
            seen["shN"].add(batch.params["shN"].shape[1])
        return batch

    monkeypatch.setattr(step_module, "share_blocks", share)
    monkeypatch.setattr(step_module, "gather", gather)
    monkeypatch.setattr(blockwise, "MIN_MEAN_ROWS", 0)  # this scene's blocks are small: share them anyway
    narrow = _copy(tiled, tmp_path, "narrow.zarr")
    run(_config(data, narrow, tmp_path / "narrow", steps=11, sh_degree_interval=4))
    assert numba.get_num_threads() < 2 or max(seen["threads"]) > 1, "the blocks must have been shared by threads"
    assert seen["shN"] == {0, 3, 8}, "each degree gathers its coefficients only"

    monkeypatch.setattr(step_module, "sh_coeffs_gathered", lambda degree, backend: None)
    monkeypatch.setattr(step_module, "block_threads", lambda offsets, threads: 1)
    seen["shN"].clear()
    whole = _copy(tiled, tmp_path, "whole.zarr")
    run(_config(data, whole, tmp_path / "whole", steps=11, sh_degree_interval=4))
    assert seen["shN"] == {15}
    _assert_same_training(_params(whole), _params(narrow))
