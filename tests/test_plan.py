"""python -m tools.plan: the planner against the exchange-volume bench's exact counting (the
same layout code, and a sampled city against the full one), its accounting against brute force,
and its refusal of bad input before any work."""
from __future__ import annotations

import json

import numpy as np
import pytest

from octree import frustum_cull
from tools.bench import mpi
from tools.plan import __main__ as cli
from tools.plan.city import sample_city
from tools.plan.core import plan_run
from tools.scenes import CityConfig, generate_city
from train.schedule import step_cameras

RANKS, PER_RANK, STEPS, SEED = 3, 2, 4, 5


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
    assert s["bytes_ours_fwd_bwd"] == pytest.approx(s["travelling_ours"] * 88)
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
