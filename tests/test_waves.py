"""Views larger than the cache: a step pages its blocks in waves and equals the in-memory step,
on one rank and under mpirun; only a view whose 2D splats alone exceed the budget is refused."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from storage import Store
from storage.cache import BlockCache
from storage.schema import bytes_per_gaussian
from tests.helpers.layout import assert_same_blocks
from tools.tile.__main__ import main as tile_main
from train import step as step_module
from train.config import TrainConfig
from train.region import Region
from train.trainer import load_cameras, run
from train.waves import SPLAT_STEP_BYTES, raster_bytes, split_waves

REPO = Path(__file__).resolve().parents[1]
MPIRUN = shutil.which("mpirun", path=str(Path(sys.executable).parent)) or shutil.which("mpirun")


def test_waves_are_consecutive_runs_within_half_the_budget():
    sizes = [5, 3, 7, 2, 2, 9, 1, 4]
    for budget in (9, 10, 18, 40, 100):
        runs = split_waves(sizes, budget)
        assert [i for a, b in runs for i in range(a, b)] == list(range(len(sizes)))
        cap = budget // 2 if max(sizes) <= budget // 2 else budget
        assert all(sum(sizes[a:b]) <= cap or b - a == 1 for a, b in runs)
        assert all(sum(sizes[a:b]) + sizes[b] > cap for a, b in runs[:-1])  # each wave as full as it can be
    assert split_waves([20, 2, 2], 18) == [(0, 1), (1, 3)]  # too large a block goes alone: the cache refuses it
    assert split_waves([4, 4, 4, 4], 16) == [(0, 2), (2, 4)]
    assert split_waves([], 10) == []


@pytest.fixture(scope="module")
def fine_wall(wall, tmp_path_factory) -> tuple[Path, Path]:
    """The wall tiled into blocks of at most 100 Gaussians: a third of a view's blocks then holds
    a wave and the step's working memory beside it (one of the wall's 400-Gaussian blocks does not)."""
    data, _ = wall
    store = tmp_path_factory.mktemp("fine_wall") / "wall.zarr"
    assert tile_main([str(data), "--out", str(store), "--max-per-block", "100"]) == 0
    return data, store


def _config(data: Path, store: Path, out: Path, **kw) -> TrainConfig:
    base = dict(data=str(data), store=str(store), out=str(out), steps=16, data_factor=1, commit_every=5,
                log_every=1, progress=False, deterministic=True)
    base.update(kw)
    return TrainConfig(**base)


def _view_rows(data: Path, store: Path, pick=max) -> tuple[int, int]:
    """Gaussians and cache bytes of the blocks the most-seeing (or with `min`, least-seeing)
    training camera sees."""
    s = Store.open(store, mode="r")
    region = Region.from_table(s.table)
    cameras = load_cameras(_config(data, store, store.parent / "unused"), s).train
    rows = pick(sum(s.table[k].count for k in region.visible(c)) for c in cameras)
    return rows, rows * bytes_per_gaussian(s.sh_degree)


def _train_lines(path: Path) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["kind"] == "train"]


def _copy(store: Path, tmp_path: Path, name: str) -> Path:
    shutil.copytree(store, tmp_path / name)
    return tmp_path / name


def test_a_cache_a_third_of_a_view_trains_bit_for_bit_as_in_memory(fine_wall, tmp_path):
    data, tiled = fine_wall
    _, view_bytes = _view_rows(data, tiled)
    results = {}
    # dense Adam: every row a wave pages first takes the steps it missed (the other modes: below)
    for name, cache_mb in (("memory", 1024), ("waves", view_bytes / 3 / 2**20)):
        store = _copy(tiled, tmp_path, f"{name}.zarr")
        results[name] = run(_config(data, store, tmp_path / name, cache_mb=cache_mb, adam="dense"))
    waves = [r["waves"] for r in _train_lines(tmp_path / "waves" / "metrics.jsonl")]
    assert [r["waves"] for r in _train_lines(tmp_path / "memory" / "metrics.jsonl")] == [0] * 16
    assert len(waves) == 16 and min(waves) >= 3, waves  # every step's view was paged in three waves or more
    assert_same_blocks(Store.open(tmp_path / "memory.zarr", mode="r"), Store.open(tmp_path / "waves.zarr", mode="r"))
    # the held-out views, larger than the cache too, are rendered in waves: the same images
    assert results["waves"]["test_psnr"] == results["memory"]["test_psnr"]
    assert results["waves"]["bytes_read"] > 2 * results["memory"]["bytes_read"]  # each step read its view twice


def test_a_step_counts_its_working_memory_in_the_budget(wall, tmp_path, monkeypatch):
    """The gathered copy of a step's rows and their gradients are reserved in the cache while
    they live; a view whose blocks fit the cache but not beside that memory is paged in waves."""
    data, tiled = wall
    _, view_bytes = _view_rows(data, tiled)
    caches, seen, rastered = [], [], []
    working = BlockCache.working

    def recording_working(cache, nbytes, what, strict=True):
        if cache not in caches:
            caches.append(cache)
        if what.startswith("rasterizing"):
            rastered.append(("reserved", nbytes, strict))
        return working(cache, nbytes, what, strict)

    backprop = step_module.backprop_owned

    def checked_backprop(projected, back, mode):
        out = backprop(projected, back, mode)
        cache = caches[-1]
        params = projected.gathered.params.values()
        live = sum(p.numel() * p.element_size() * (1 + (p.grad is not None)) for p in params)
        seen.append((live, cache.working_bytes))
        assert cache.nbytes() <= cache.budget
        return out

    raster = step_module.rasterize

    def checked_raster(splats, camera, *args, **kwargs):
        rastered.append(("needed", raster_bytes(len(splats), 0, camera.width, camera.height), False))
        return raster(splats, camera, *args, **kwargs)

    monkeypatch.setattr(BlockCache, "working", recording_working)
    monkeypatch.setattr(step_module, "backprop_owned", checked_backprop)
    monkeypatch.setattr(step_module, "rasterize", checked_raster)
    for name, cache_mb in (("memory", 1024), ("tight", 1.2 * view_bytes / 2**20)):
        store = _copy(tiled, tmp_path, f"{name}.zarr")
        run(_config(data, store, tmp_path / name, cache_mb=cache_mb, steps=6))
    assert len(seen) >= 12 and all(0 < live <= reserved for live, reserved in seen), seen
    # the rendered camera's rasterizer memory is counted beside the step's while it renders
    # (reserved just before the rasterizer runs, as much as it needs, without refusing it)
    assert len(rastered) >= 24 and rastered[0::2] == [("reserved", *r[1:]) for r in rastered[1::2]], rastered
    assert [r["waves"] for r in _train_lines(tmp_path / "memory" / "metrics.jsonl")] == [0] * 6
    # the blocks of the largest view alone would fit this cache
    assert max(r["waves"] for r in _train_lines(tmp_path / "tight" / "metrics.jsonl")) >= 2
    assert_same_blocks(Store.open(tmp_path / "memory.zarr", mode="r"), Store.open(tmp_path / "tight.zarr", mode="r"))


@pytest.mark.skipif(MPIRUN is None, reason="mpirun not found (pip install mpich)")
def test_waves_under_mpirun_equal_one_process_in_memory(fine_wall, tmp_path):
    data, tiled = fine_wall
    _, view_bytes = _view_rows(data, tiled)
    flags = ["--data", str(data), "--steps", "12", "--data-factor", "1", "--commit-every", "5", "--log-every", "1",
             "--no-progress", "--deterministic", "--strategy", "mcmc", "--cap-max", "14000",
             "--refine-start-iter", "4", "--refine-every", "4"]
    one = _copy(tiled, tmp_path, "one.zarr")
    proc = subprocess.run([sys.executable, "-m", "train", *flags, "--store", str(one), "--out", str(tmp_path / "one"),
                           "--batch-size", "2", "--cache-mb", "1024"], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    two = _copy(tiled, tmp_path, "two.zarr")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([MPIRUN, "-n", "2", sys.executable, "-m", "train", *flags, "--store", str(two),
                           "--out", str(tmp_path / "two"), "--batch-size", "1", "--cache-mb", str(view_bytes / 3 / 2**20)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    for rank in (0, 1):
        waves = [r["waves"] for r in _train_lines(tmp_path / "two" / f"metrics.rank{rank}.jsonl")]
        assert max(waves) >= 3, (rank, waves)
    assert_same_blocks(Store.open(one, mode="r"), Store.open(two, mode="r"))
    s1, s2 = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("one", "two"))
    assert s2["gaussians"] == s1["gaussians"] > 12_000  # MCMC grew
    # the held-out images are the same; their PSNRs are averaged over the ranks in another order
    assert s2["test_psnr"] == pytest.approx(s1["test_psnr"], abs=1e-5)


def test_a_view_whose_splats_exceed_the_budget_is_refused_before_anything_is_stepped(wall, tmp_path):
    data, _ = wall
    store = tmp_path / "fine.zarr"  # blocks of at most 10 Gaussians: each fits where a view's splats do not
    assert tile_main([str(data), "--out", str(store), "--max-per-block", "10"]) == 0
    fewest, _ = _view_rows(data, store, min)
    # most of a view's Gaussians give it a splat, so any view's splats alone need about 4x this
    cache_mb = fewest * SPLAT_STEP_BYTES / 4 / 2**20
    proc = subprocess.run([sys.executable, "-m", "train", "--data", str(data), "--store", str(store), "--out",
                           str(tmp_path / "out"), "--steps", "40", "--no-progress", "--cache-mb", str(cache_mb)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.startswith("error: --cache-mb") and "is too small for one step" in proc.stderr
    assert "does not fit even in waves" in proc.stderr and "Traceback" not in proc.stderr
    assert Store.open(store, mode="r").state.get("step", 0) == 0
