"""python -m tools.plan: the planner against the exchange-volume bench's exact counting (the
same layout code, and a sampled city against the full one), a store's plan against the bytes a real
`mpirun` run of it sends, its accounting against brute force, and its refusal of bad input before
any work."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from octree import frustum_cull
from storage import Store
from tests.conftest import REPO
from tools.bench import mpi
from tools.plan import __main__ as cli
from tools.plan.city import sample_city
from tools.plan.core import plan_run
from tools.scenes import CityConfig, generate_city
from train.schedule import step_cameras

RANKS, PER_RANK, STEPS, SEED = 3, 2, 4, 5
MPIRUN = shutil.which("mpirun", path=str(Path(sys.executable).parent)) or shutil.which("mpirun")


def _bench(city_splats, cameras, max_per_block):
    """What `tools.bench mpi volume` counts: exact splats by projection, the trainer's assignment."""
    layout = mpi.build_layout(city_splats, RANKS, max_per_block, cameras)
    ours, round_robin = mpi.count_splats(layout, cameras)
    steps = mpi.plan_steps(mpi.block_affinity(layout, cameras), PER_RANK, STEPS, SEED, "balanced-blocks")
    return layout, steps, mpi.exchange_volume(ours, round_robin, steps)


def _steps(n_cameras):
    return [step_cameras(SEED, n_cameras, RANKS * PER_RANK, s) for s in range(STEPS)]


def test_at_weight_one_the_plan_is_the_bench_count():
    city = generate_city(CityConfig(blocks=1, density=0.5, cameras=12, width=160, height=90))
    layout, steps, volume = _bench(city.splats(), city.cameras, 40)
    plan = plan_run(city.splats(), 1, city.cameras, _steps(len(city.cameras)), RANKS, PER_RANK, 40, sh_degree=3)
    for got, want in zip(plan.steps, steps):
        np.testing.assert_array_equal(got.cameras, want.cameras)
        np.testing.assert_array_equal(got.ranks, want.ranks)
    travelling = np.sum([s.travelling() for s in plan.steps], axis=0)
    assert sum(s.pairs.sum() for s in plan.steps) == volume.splats > 0
    assert travelling[0] == volume.ours  # exactly: the same splats, owners and camera ranks
    assert travelling[1] == pytest.approx(volume.gsplat, rel=0.1)  # the round robin's expectation
    np.testing.assert_array_equal(plan.rank_gaussians(), layout.rank_gaussians())
    assert (plan.rank_state_bytes() == layout.rank_gaussians() * 724).all()
    # The cache: by brute force, every owned block some camera of the step sees, at 724 B a Gaussian.
    for step in plan.steps:
        want = np.zeros(RANKS)
        for b in range(len(layout.counts)):
            if any(frustum_cull(layout.extents[b : b + 1], c.viewmat, c.K, c.width, c.height)[0]
                   for c in (city.cameras[i] for i in step.cameras)):
                want[layout.block_rank[b]] += layout.counts[b] * 724
        np.testing.assert_array_equal(step.cache_bytes, want)
    # What each rank sends and receives adds up to what travels.
    for step in plan.steps:
        t = step.rank_traffic()
        assert t["ours sent"].sum() == t["ours received"].sum() == step.travelling()[0]
        assert t["gsplat sent"].sum() == pytest.approx(t["gsplat received"].sum())


def test_a_sampled_city_plans_what_the_full_city_measures_within_10_percent():
    cfg = CityConfig(blocks=2, density=0.5, cameras=48, width=320, height=180, seed=3)
    full = generate_city(cfg)
    _, _, volume = _bench(full.splats(), full.cameras, 2048)
    weight = 16
    sampled = sample_city(cfg, weight)
    assert [c.name for c in sampled.cameras] == [c.name for c in full.cameras]
    assert sampled.gaussians == pytest.approx(len(full), rel=0.03)
    plan = plan_run(sampled.splats, weight, sampled.cameras, _steps(len(full.cameras)), RANKS, PER_RANK, 2048,
                    sh_degree=3)
    travelling = np.sum([s.travelling() for s in plan.steps], axis=0)
    assert sum(s.pairs.sum() for s in plan.steps) == pytest.approx(volume.splats, rel=0.1)
    assert travelling[0] == pytest.approx(volume.ours, rel=0.1)
    assert travelling[1] == pytest.approx(volume.gsplat, rel=0.1)


def test_the_command_prints_a_consistent_plan(capsys):
    args = ["--gaussians", "2e4", "--ranks", "2", "--batch-size", "2", "--cameras", "16", "--width", "160",
            "--height", "90", "--max-per-block", "2048", "--samples-per-block", "512", "--steps", "2",
            "--cache-gb", "1", "--network-gbps", "10"]
    assert cli.main([*args, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    r = doc["per_rank"]
    assert sum(r["gaussians"]) == doc["gaussians"] == doc["city"]["samples"] * 4
    assert doc["gaussians"] == pytest.approx(2e4, rel=0.1)
    assert r["state_bytes"] == [g * 724 for g in r["gaussians"]] and sum(r["blocks"]) == doc["blocks"]
    s = doc["per_step"]
    assert s["bytes_ours_fwd_bwd"] == pytest.approx(s["travelling_ours"] * 85)  # 48 B forward, at most 37 back
    assert s["bytes_gsplat_fwd_bwd"] == pytest.approx(s["travelling_gsplat"] * 96)
    assert s["seconds_ours"] == pytest.approx(max(r["link_bytes_per_step"]) * 8 / 10e9)
    assert doc["cache"]["ranks_that_fit"] == 2
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "gsplat round robin" in out and "imbalance (max/mean)" in out and "--cache-gb 1 holds it on 2 of 2" in out


@pytest.mark.parametrize("args, message", [
    (["--gaussians", "1e15"], "--gaussians 1e+15: must be a whole number"),
    (["--gaussians", "nan"], "--gaussians nan"),
    (["--gaussians", "-5"], "--gaussians -5"),
    (["--gaussians", "1234.5"], "--gaussians 1234.5"),
    (["--ranks", "0"], "--ranks 0: must be at least 1"),
    (["--ranks", "64", "--cameras", "10"], "--cameras 10: a step needs"),
    (["--cache-gb", "0.01"], "--cache-gb 0.01 is too small for one view"),
    (["--cache-gb", "0"], "--cache-gb 0.0: must be a positive number"),
    (["--sh-degree", "4"], "--sh-degree 4"),
    (["--network-gbps", "0"], "--network-gbps 0.0"),
    (["--gaussians", "1e11"], "samples, more than"),
])
def test_bad_input_is_one_clear_error_before_any_work(args, message, capsys, monkeypatch):
    monkeypatch.setattr(cli, "sampled_city", lambda *a: pytest.fail("planning started"))
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err and err.count("\n") == 1


def test_a_non_numeric_count_is_an_argument_error(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--gaussians", "lots"])
    assert e.value.code == 2 and "'lots' is not a number" in capsys.readouterr().err


def test_a_stores_plan_is_what_mpirun_sends_byte_for_byte(wall, tmp_path, capsys):
    """`--store`: the planner's per-rank, per-step splat bytes are those `mpirun -n 2 python -m
    train` logs (`bytes_sent` and `bytes_received` less the gradients' `grad_`) on the same store,
    cameras and schedule: the same regions, camera assignment, culling and projection, and the
    same wire format; the gradients' return is at most what it plans."""
    data, store = wall
    trained = tmp_path / "t.zarr"
    shutil.copytree(store, trained)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([MPIRUN, "-n", "2", sys.executable, "-m", "train", "--data", str(data), "--store", str(trained),
                           "--out", str(tmp_path / "out"), "--steps", "3", "--batch-size", "2", "--strategy", "none",
                           "--log-every", "1", "--no-progress", "--deterministic"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert cli.main(["--store", str(store), "--data", str(data), "--ranks", "2", "--batch-size", "2", "--steps", "3",
                     "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["gaussians"] == 12_000 and doc["sample_weight"] == 1 and len(doc["steps"]) == 3
    for rank in range(2):
        lines = [json.loads(line) for line in (tmp_path / "out" / f"metrics.rank{rank}.jsonl").read_text().splitlines()]
        logged = [r for r in lines if r["kind"] == "train"]
        assert [r["step"] for r in logged] == [1, 2, 3]
        for planned, measured in zip(doc["steps"], logged):
            for way in ("sent", "received"):
                splats = measured[f"bytes_{way}"] - measured[f"grad_bytes_{way}"]
                assert planned[f"splat_bytes_{way}"][rank] == splats, (rank, way, measured["step"])
                assert measured[f"grad_bytes_{way}"] <= planned[f"grad_bytes_{way}_max"][rank], (rank, way)
        assert sum(r["grad_bytes_sent"] for r in logged) + sum(r["grad_bytes_received"] for r in logged) > 0
        assert all(r["owned"] == doc["per_rank"]["gaussians"][rank] for r in logged), rank  # the same regions
    assert all(sum(step["splat_bytes_sent"]) > 0 for step in doc["steps"]), "splats must travel"
    assert sum(doc["per_rank"]["gaussians"]) == 12_000


def test_a_store_plan_needs_its_dataset_and_enough_cameras(wall, tmp_path, capsys):
    data, store = wall
    assert cli.main(["--store", str(store)]) == 2
    assert "--store and --data go together" in capsys.readouterr().err
    assert cli.main(["--store", str(store), "--data", str(data), "--ranks", "20", "--batch-size", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "28 training cameras, but a step needs --ranks x --batch-size = 40" in err
    assert cli.main(["--store", str(data), "--data", str(data)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err and err.count("\n") == 1
    damaged = tmp_path / "damaged.zarr"
    shutil.copytree(store, damaged)
    bad = sorted(Store.open(damaged, mode="r").table)[3]
    (damaged / "blocks" / bad / "0" / "params" / "c.0.0").write_bytes(b"not a chunk")
    assert cli.main(["--store", str(damaged), "--data", str(data), "--ranks", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and bad in err and "Traceback" not in err and err.count("\n") == 1


def test_a_large_store_is_sampled_every_weight_th_row_of_each_block(wall):
    """Past `max_samples` the store's layout holds rows 0, w, 2w, ... of every block, in Morton
    order, and nothing else (the samples are copied out block by block)."""
    from tools.plan.store import store_layout
    from train.layout import BlockTable

    data, path = wall
    store = Store.open(path, mode="r")
    table = BlockTable.from_store(store.table)
    layout, weight = store_layout(store, 2, [], max_samples=12_000 // 5)
    assert weight == 5
    assert layout.counts.tolist() == [-(-int(c) // 5) for c in table.counts]
    for b in (0, len(table.keys) // 2, len(table.keys) - 1):
        params = store.read_params(table.keys[b])
        lo, n = int(layout.starts[b]), int(layout.counts[b])
        for name in ("means", "scales", "quats", "opacities", "sh0"):
            assert np.array_equal(layout.splats[name][lo:lo + n].numpy(), params[name][::5]), name
        assert layout.splats["shN"].shape == (int(layout.counts.sum()), 0, 3)
