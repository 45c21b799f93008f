"""--memory-mb: a ceiling on a rank's resident memory, kept by lowering its cache's budget by the
excess the kernel measures; the results stay those of the run without it."""
from __future__ import annotations

import json
import mmap
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
from tests.helpers.store_data import random_block
from train.config import ConfigError, TrainConfig
from train.memory import FLOOR, MARGIN, MemoryCeiling, check_supported, read_hwm, reset_hwm
from train.region import Region
from train.trainer import load_cameras, run

MiB = 2**20
REPO = Path(__file__).resolve().parents[1]
MPIRUN = shutil.which("mpirun", path=str(Path(sys.executable).parent)) or shutil.which("mpirun")


class _Kernel:
    """A scripted high-water mark: each phase's peak comes from `peaks`."""

    def __init__(self, peaks: list[int]) -> None:
        self.peaks, self.resets = list(peaks), 0

    def hwm(self) -> int:
        return self.peaks[0]

    def reset(self) -> None:  # a phase begins: the next peak
        self.resets += 1
        self.peaks.pop(0)


def _ceiling(ceiling_mib: float, budget_mib: float, peaks_mib: list[float]):
    kernel = _Kernel([0] + [int(p * MiB) for p in peaks_mib])
    budgets: list[int] = []
    c = MemoryCeiling(int(ceiling_mib * MiB), int(budget_mib * MiB), budgets.append,
                      hwm=kernel.hwm, reset=kernel.reset)
    return c, budgets


def test_the_budget_is_the_ceiling_less_the_largest_excess_and_a_margin():
    c, budgets = _ceiling(2524, 1500, [900, 2700, 2500, 2600])
    margin = int(MARGIN * 2524 * MiB)
    with c.phase():  # peaks at 900: under the budget, which stays
        pass
    assert (c.budget, budgets, c.excess) == (1500 * MiB, [], 0)
    with c.phase():  # 1,200 MiB over the budget in force: the next runs in less
        pass
    assert c.excess == 1200 * MiB and budgets == [2524 * MiB - 1200 * MiB - margin] and c.budget == budgets[-1]
    with c.phase():  # under the lowered budget the excess is 2500 - budget: larger, so it lowers again
        pass
    assert c.excess == 2500 * MiB - budgets[0] > 1200 * MiB
    assert c.budget == 2524 * MiB - c.excess - margin < budgets[0]
    lowered = c.budget
    with c.phase():
        pass
    assert c.excess == max(2500 * MiB - budgets[0], 2600 * MiB - lowered)
    assert c.peak_bytes == 2700 * MiB and not c.floored  # the peak is the largest phase's, not the last one's


def test_the_budget_never_rises_over_the_configured_one_nor_falls_under_the_floor():
    c, budgets = _ceiling(10_000, 1500, [100])
    with c.phase():
        pass
    assert c.budget == 1500 * MiB and budgets == []  # a generous ceiling never raises the budget
    c, budgets = _ceiling(600, 1500, [2000])
    with c.phase():
        pass
    assert c.floored and c.budget == int(FLOOR * 1500 * MiB) and budgets == [c.budget]


def test_an_error_inside_a_phase_is_still_measured():
    c, _ = _ceiling(2000, 1500, [3000])
    with pytest.raises(RuntimeError), c.phase():
        raise RuntimeError("a step failed")
    assert c.peak_bytes == 3000 * MiB and c.excess == 1500 * MiB


def test_the_kernel_high_water_mark_resets_and_rises():
    reset_hwm()
    before = read_hwm()
    # a fresh anonymous mapping, every page written: 64 MiB more resident, whatever the heap holds free
    fresh = mmap.mmap(-1, 64 * MiB)
    fresh.write(b"\1" * (64 * MiB))
    assert read_hwm() >= before + 60 * MiB
    fresh.close()
    assert check_supported() >= before + 60 * MiB  # the peak it read before resetting the mark
    assert read_hwm() < before + 60 * MiB


def test_a_lower_host_budget_evicts_the_least_recently_used_unpinned_blocks_and_writes_them_back(tmp_path):
    rng = np.random.default_rng(0)
    store = Store.create(tmp_path / "s.zarr", {"sh_degree": 1}, durable=False)
    data = {f"2-{i:x}": random_block(rng, 100, 1) for i in range(4)}
    store.commit({k: store.write_block(k, a, (0.0, 0.0, 0.0, 1.0, 1.0, 1.0)) for k, a in data.items()})
    block = 100 * bytes_per_gaussian(1)
    with BlockCache(store, 4 * block) as cache:
        for key in data:
            cache.get(key)
        cache.pin(["2-0"])
        cache.get("2-0").tensors["means"] += 1.0  # dirty, and least recently used of all, but pinned
        cache.mark_dirty("2-0")
        cache.get("2-1").tensors["means"] += 1.0  # dirty, the least recently used unpinned block
        cache.mark_dirty("2-1")
        cache.get("2-3")  # 2-2 is next
        cache.set_host_budget(2 * block)
        assert cache.host_budget == cache.budget == 2 * block
        assert [b.key for b in cache.resident()] == ["2-0", "2-3"]
        # (the evicted dirty block's bytes stay counted, in flight, until its write-back lands)
        assert sum(b.nbytes for b in cache.resident()) <= 2 * block and cache.stats.evictions == 2
        cache.unpin(["2-0"])
        assert np.array_equal(cache.get("2-1").tensors["means"].numpy(), data["2-1"]["means"] + 1.0)  # written back
        with pytest.raises(ValueError):
            cache.set_host_budget(0)
        cache.flush()


def test_config_refuses_a_ceiling_that_is_not_a_positive_number():
    for bad in (0.0, -5.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="--memory-mb"):
            TrainConfig(memory_mb=bad)


def _lines(path: Path) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["kind"] == "train"]


def test_a_ceiling_below_the_process_lowers_the_budget_and_changes_no_result(wall, tmp_path, capsys):
    """A ceiling under what the interpreter alone holds cannot be kept: from the second step the
    cache runs at its floor, half of --cache-mb, which pages this view in waves; every block ends
    as in the run without a ceiling."""
    data, tiled = wall
    s = Store.open(tiled, mode="r")
    region = Region.from_table(s.table)
    base = dict(data=str(data), steps=6, data_factor=1, log_every=1, progress=False, deterministic=True)
    cameras = load_cameras(TrainConfig(store=str(tiled), out=str(tmp_path / "unused"), **base), s).train
    view = max(sum(s.table[k].count for k in region.visible(c)) for c in cameras) * bytes_per_gaussian(s.sh_degree)
    cache_mb = 3 * view / MiB
    results = {}
    for name, memory_mb in (("free", None), ("ceiling", 1.0)):
        store = tmp_path / f"{name}.zarr"
        shutil.copytree(tiled, store)
        results[name] = run(TrainConfig(store=str(store), out=str(tmp_path / name), cache_mb=cache_mb,
                                        memory_mb=memory_mb, **base))
    lines = _lines(tmp_path / "ceiling" / "metrics.jsonl")
    floor = round(FLOOR * int(cache_mb * MiB) / MiB, 1)
    assert [r["budget_mib"] for r in lines] == [round(int(cache_mb * MiB) / MiB, 1)] + [floor] * 5
    assert all("budget_mib" not in r for r in _lines(tmp_path / "free" / "metrics.jsonl"))
    assert max(r["waves"] for r in lines[1:]) >= 2  # the floor pages the larger views in waves
    assert max(r["waves"] for r in _lines(tmp_path / "free" / "metrics.jsonl")) == 0
    peaks = [r["peak_rss_mib"] for r in lines]
    assert peaks == sorted(peaks) and results["ceiling"]["peak_rss_mib"] >= peaks[-1] > 100  # the true peak, kept
    assert "the ceiling is not kept" in capsys.readouterr().err
    assert_same_blocks(Store.open(tmp_path / "free.zarr", mode="r"), Store.open(tmp_path / "ceiling.zarr", mode="r"))
    assert results["ceiling"]["test_psnr"] == results["free"]["test_psnr"]


@pytest.mark.skipif(MPIRUN is None, reason="mpirun not found (pip install mpich)")
def test_under_mpirun_each_rank_keeps_its_own_ceiling_and_the_blocks_are_the_same(wall, tmp_path):
    data, tiled = wall
    flags = ["--data", str(data), "--steps", "5", "--data-factor", "1", "--log-every", "1", "--no-progress",
             "--deterministic", "--cache-mb", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    for name, extra in (("free", []), ("ceiling", ["--memory-mb", "1"])):
        store = tmp_path / f"{name}.zarr"
        shutil.copytree(tiled, store)
        proc = subprocess.run([MPIRUN, "-n", "2", sys.executable, "-m", "train", *flags, *extra, "--store", str(store),
                               "--out", str(tmp_path / name)], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stderr
    for rank in (0, 1):
        lines = _lines(tmp_path / "ceiling" / f"metrics.rank{rank}.jsonl")
        assert [r["budget_mib"] for r in lines] == [2.0] + [1.0] * 4, (rank, lines)
    assert_same_blocks(Store.open(tmp_path / "free.zarr", mode="r"), Store.open(tmp_path / "ceiling.zarr", mode="r"))
