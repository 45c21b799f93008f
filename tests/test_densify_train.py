"""Densification in the trainer, one rank: conservation, the octree kept valid, the opacity reset
on schedule, paging and resuming invisible in the result, and clear errors."""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from octree.root import RootCube
from storage import Store
from storage.schema import bytes_per_gaussian
from tests.helpers.layout import assert_same_blocks, check_layout
from train.config import TrainConfig
from train.densify import DensifyConfig
from train.trainer import TrainError, run

REPO = Path(__file__).resolve().parents[1]


def _copy(store: Path, tmp_path: Path, name: str) -> Path:
    shutil.copytree(store, tmp_path / name)
    return tmp_path / name


def _config(data: Path, store: Path, out: Path, densify: dict, **kw) -> TrainConfig:
    base = dict(data=str(data), store=str(store), out=str(out), steps=40, data_factor=1, commit_every=15,
                log_every=1, progress=False, deterministic=True)
    base.update(kw)
    return TrainConfig(**base, densify=DensifyConfig(**densify))


def _records(out: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def _same_blocks(a: Path, b: Path) -> None:
    assert_same_blocks(Store.open(a, mode="r"), Store.open(b, mode="r"))


SCHEDULE = {"refine_start_iter": 10, "refine_every": 10, "reset_every": 30}


def test_refinements_conserve_gaussians_keep_the_octree_valid_and_reset_on_schedule(shared_data, lund_store, tmp_path):
    store = _copy(lund_store, tmp_path, "lund.zarr")
    initial = sum(i.count for i in Store.open(store, mode="r").table.values())
    out = tmp_path / "out"
    # stops right after the refinement and opacity reset of step 30
    summary = run(_config(shared_data / "lund_door", store, out, SCHEDULE, data_factor=16, steps=50, stop_at=31))
    refines = _records(out, "refine")
    assert [r["step"] for r in refines] == [21, 31]
    count = initial
    for r in refines:
        # conservation, exactly: every Gaussian added or removed is counted
        assert count + r["cloned"] + r["split"] - r["pruned"] == r["gaussians"]
        assert r["migrated_out"] == r["migrated_in"]  # one rank: every move is in and out of its blocks
        count = r["gaussians"]
    assert refines[0]["cloned"] > 100 and refines[0]["split"] > 100 and refines[0]["blocks_split"] > 0
    assert refines[0]["migrated_out"] > 0
    s = Store.open(store, mode="r")
    # split children beyond the root cube were kept, filed under border cells (check_layout)
    root = RootCube.from_attrs(s.attrs["octree"])
    assert sum(int((~root.contains(s.read_block(k)["means"].astype(np.float64))).sum()) for k in s.table) > 0
    assert summary["gaussians"] == count == check_layout(s, 600) > 2 * initial
    assert s.state["step"] == 31 and s.state["refine_pending"] == []
    # the reset of step 30 clamped every opacity to 2 x prune_opa and zeroed its moments
    for k in s.table:
        b = s.read_block(k)
        assert float(torch.sigmoid(torch.from_numpy(b["opacities"])).max()) <= 0.01 + 1e-6
        assert not b["exp_avg_opacities"].any() and not b["grad2d"].any() and not b["count"].any()
    assert (out / "metrics.png").stat().st_size > 0


def test_paging_and_resuming_are_invisible_with_densification(wall, tmp_path):
    """A cache of a quarter of the grown scene and a resume from
    the commit just before a refinement give the in-memory run's blocks bit for bit; the
    refinement after the resume refines the blocks the first slice touched (kept in the commit)."""
    data, tiled = wall
    schedule = {**SCHEDULE, "reset_every": 1000}  # refinements at 20, 30: the one at 30 covers touched blocks only
    full, small, resumed = (_copy(tiled, tmp_path, n) for n in ("full.zarr", "small.zarr", "resumed.zarr"))
    a = run(_config(data, full, tmp_path / "a", schedule, cache_mb=1024))
    quarter = a["gaussians"] * bytes_per_gaussian(3) / 4 / 2**20
    b = run(_config(data, small, tmp_path / "b", schedule, cache_mb=quarter))
    assert b["bytes_read"] > 3 * a["bytes_read"], "the small cache must have paged"
    first = run(_config(data, resumed, tmp_path / "c1", schedule, cache_mb=1024, stop_at=30))
    pending = Store.open(resumed, mode="r").state["refine_pending"]
    assert first["interrupted"] and 0 < len(pending) < len(Store.open(resumed, mode="r").table)
    run(_config(data, resumed, tmp_path / "c2", schedule, cache_mb=1024, resume=True))
    refines = _records(tmp_path / "a", "refine")
    assert len(refines) == 2 and refines[1]["refined"] < refines[1]["blocks"]
    assert a["gaussians"] > 1.3 * sum(i.count for i in Store.open(tiled, mode="r").table.values())
    _same_blocks(full, small)
    _same_blocks(full, resumed)
    check_layout(Store.open(full, mode="r"), 400, refined_last=False)  # 10 Adam steps after the last refinement


def test_dense_adam_is_invisible_to_paging_and_resuming_and_brings_every_row_up_to_date(wall, tmp_path):
    """`--adam dense`: steps put off while a block is not used are taken when it is, so a quarter
    cache and a resume just before a refinement give the in-memory run's blocks bit for bit, and
    at the end every row has taken every step (the default optimizer counts each row's own)."""
    data, tiled = wall
    schedule = {**SCHEDULE, "reset_every": 1000}
    full, small, resumed = (_copy(tiled, tmp_path, n) for n in ("full.zarr", "small.zarr", "resumed.zarr"))
    a = run(_config(data, full, tmp_path / "a", schedule, cache_mb=1024, adam="dense"))
    quarter = a["gaussians"] * bytes_per_gaussian(3) / 4 / 2**20
    b = run(_config(data, small, tmp_path / "b", schedule, cache_mb=quarter, adam="dense"))
    assert b["bytes_read"] > 3 * a["bytes_read"], "the small cache must have paged"
    run(_config(data, resumed, tmp_path / "c1", schedule, cache_mb=1024, stop_at=30, adam="dense"))
    run(_config(data, resumed, tmp_path / "c2", schedule, cache_mb=1024, resume=True, adam="dense"))
    _same_blocks(full, small)
    _same_blocks(full, resumed)
    s = Store.open(full, mode="r")
    assert {int(x) for k in s.table for x in s.read_block(k)["adam_step"]} == {40}


def test_a_refinement_the_cache_cannot_hold_fails_clearly_and_keeps_the_commit(wall, tmp_path):
    data, tiled = wall
    store = _copy(tiled, tmp_path, "tight.zarr")
    # a cap this high merges the whole facade into a few blocks larger than the budget
    with pytest.raises(TrainError, match=r"--cache-mb 2\.00 is too small to refine at step 20: .*block .* needs"):
        run(_config(data, store, tmp_path / "t", {**SCHEDULE, "max_per_block": 10**6}, cache_mb=2.0))
    s = Store.open(store, mode="r", verify="data")
    assert s.state["step"] == 15 and s.table.keys() == Store.open(tiled, mode="r").table.keys()


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(path)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


@pytest.mark.parametrize("flags,message", [
    (["--adam", "lazy"], "--adam 'lazy': choose from contributed, visible, dense"),
    (["--strategy", "adc"], "--strategy 'adc': choose from default, mcmc, none"),
    (["--grow-grad2d", "nan"], "--grow-grad2d nan: must be a finite number >= 0"),
    (["--prune-opa", "-0.1"], "--prune-opa -0.1: must be a finite number >= 0"),
    (["--refine-every", "0"], "--refine-every 0: must be at least 1"),
    (["--strategy", "mcmc", "--cap-max", "100"], "--cap-max 100 is below the 12000 Gaussians"),
])
def test_bad_densification_flags_exit_1_and_leave_the_store_alone(wall, tmp_path, flags, message):
    data, tiled = wall
    store = _copy(tiled, tmp_path, "bad.zarr")
    before = _digest(store)
    proc = subprocess.run([sys.executable, "-m", "train", "--data", str(data), "--store", str(store), "--out",
                           str(tmp_path / "o"), "--steps", "2", "--no-progress", *flags],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and proc.stderr.startswith(f"error: {message}"), proc.stderr
    assert proc.stderr.count("\n") == 1  # one line, no traceback
    assert _digest(store) == before
