"""tools.bench gpu without a GPU: the refusal without CUDA, argument checks, the reference loop
run on the CPU renderer against the trainer's `--adam dense` (parameters equal), the gsplat
wrapper's arguments, the report's arithmetic and verdicts, and the paged configuration on lund."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from storage import Store
from storage.cache import CacheStats
from storage.schema import bytes_per_gaussian
from tools.bench import gpu as bench
from tools.bench.train import BenchError, TrainRun, run_child
from tools.make_scene import main as make_scene_main
from tools.tile.__main__ import main as tile_main
from train.camera import Camera
from train.config import ConfigError, parse_config
from train.optim import learning_rates
from train.render import project, rasterize
from train.render.semantics import EPS2D, FAR_PLANE, NEAR_PLANE, TILE_SIZE
from train.trainer import _cache_fields, run

REPO = Path(__file__).resolve().parents[1]
STEPS = 5


def cpu_rasterize(splats: dict[str, torch.Tensor], camera: Camera, sh_degree: int,
                  background: torch.Tensor) -> torch.Tensor:  # -> rgb [H, W, 3]
    """The trainer's CPU renderer behind the reference loop's `RasterizeFn` (differentiable)."""
    return rasterize(project(splats, camera, sh_degree, backend="cpu"), camera, background, backend="cpu").rgb


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    """A 20 m wall seen by 9 cameras (1,200 Gaussians in 4 blocks): both held-out views overlap
    the training views, so a few steps change the held-out PSNR."""
    root = tmp_path_factory.mktemp("tiny")
    assert make_scene_main(["wall", str(root / "data"), "--gaussians", "3000", "--cameras", "9",
                            "--wall-length", "20"]) == 0
    assert tile_main([str(root / "data"), "--out", str(root / "tiny.zarr"), "--max-per-block", "400",
                      "--no-progress"]) == 0
    return root / "data", root / "tiny.zarr"


# ---- the command line ----

def test_without_cuda_one_error_line_and_exit_2_before_any_work(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here: the bench would run")
    work = tmp_path / "work"
    proc = subprocess.run([sys.executable, "-m", "tools.bench", "gpu", "--work", str(work)], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: python -m tools.bench gpu needs a CUDA device ("), lines
    assert proc.stdout == "" and not work.exists()


def test_without_cuda_in_process(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--work", str(tmp_path / "w"), "--scenes", "lund"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs a CUDA device" in err[0] and not (tmp_path / "w").exists()


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps 0: must be at least 1"),
    (["--steps", "x"], "invalid int value"),
    (["--scenes", "city,paris"], "a comma-separated subset of lund,city"),
    (["--scenes", ""], "a comma-separated subset of lund,city"),
    (["--steps", "50", "--paged-steps", "60"], "--paged-steps 60: at most --steps (50)"),
    (["--warmup", "99"], "--warmup 99: leaves fewer than 2 timed steps"),
    (["--warmup", "-1"], "--warmup -1: must be at least 0"),
    (["--gaussians", "1e12"], "--gaussians 1e+12: between 1e3 and 1e8"),
    (["--budget", "0"], "--budget 0: must be a positive number"),
])
def test_bad_arguments_are_clear_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_defaults_and_a_short_run():
    a, cfg = bench.parse_args([])
    assert a.scenes == ["lund", "city"] and a.gaussians == 1e6 and a.data_factor == 2
    assert (cfg.steps, cfg.paged_steps, cfg.warmup) == (300, 40, 10)
    a, cfg = bench.parse_args(["--steps", "30", "--scenes", "lund,lund"])
    assert a.scenes == ["lund"] and cfg.paged_steps == 30  # the paged run never outlasts --steps


# ---- the reference loop ----

def test_reference_loop_equals_the_trainers_dense_adam(tiny, tmp_path):
    """The same TrainConfig trains the store with our trainer (one rank, `--adam dense`, on the
    CPU) and with the reference loop (torch.optim.Adam, gsplat's scheduler) on the same CPU
    renderer: after 5 steps every parameter agrees to float rounding. The one exception is
    named: the tiler's rotations are the identity, where the gradient of quats' w is zero but for
    rounding, and Adam (eps 1e-15) turns that noise into steps of up to lr either way. So w is
    the sign of each run's rounding, which a kernel's summation order or the CPU's vector width
    changes (runs 5.5e-4 and 6.9e-4 apart after 5 steps), and the two runs' w are not compared:
    each is held to the most Adam can move it, 1.02 lr a step (bias-corrected, beta1 0.9, beta2
    0.999: |m^ / sqrt(v^)| <= sqrt(sum w_i^2 / u_i) <= 1.011 over 5 steps, w_i and u_i the
    moments' weights). The other three components (whose gradients scale with 1 / |q|, which w's
    noise moves) are compared to 1e-5, a hundredth of their lr (measured: 5e-5, 2e-6)."""
    data, store = tiny
    trained = shutil.copytree(store, tmp_path / "ours.zarr")
    flags = ["--data", str(data), "--steps", str(STEPS), "--adam", "dense", "--strategy", "none", "--device", "cpu",
             "--locality-window", "0", "--no-progress", "--log-every", "1"]
    summary = run(parse_config([*flags, "--store", str(trained), "--out", str(tmp_path / "out")]))
    cfg = parse_config([*flags, "--store", str(store)])
    ref = bench.reference_train(cfg, torch.device("cpu"), 0, cpu_rasterize)

    s, initial = Store.open(trained, mode="r"), Store.open(store, mode="r")
    assert list(s.table) == list(initial.table)  # the reference's order of the rows
    lr = cfg.optim.adam().lr
    for name, got in ref.splats.items():
        ours = np.concatenate([s.read_params(k)[name] for k in s.table])
        start = np.concatenate([initial.read_params(k)[name] for k in initial.table])
        got = got.numpy()
        assert got.shape == ours.shape
        if name == "quats":
            np.testing.assert_allclose(got[:, 1:], ours[:, 1:], rtol=1e-5, atol=1e-5)
            for w in (got[:, 0], ours[:, 0]):
                assert np.abs(w - start[:, 0]).max() <= 1.02 * lr["quats"] * STEPS
        else:
            np.testing.assert_allclose(got, ours, rtol=1e-5, atol=1e-6, err_msg=name)
        if name != "shN":  # at SH degree 0 (the first 1000 steps) shN has no gradient
            assert np.abs(ours - start).max() > 100 * 1e-6, f"{name} hardly moved: the comparison shows nothing"
    assert ref.psnr == pytest.approx(summary["test_psnr"], abs=1e-4)
    assert ref.psnr != pytest.approx(ref.initial_psnr, abs=1e-3)  # the held-out views did change
    # the learning rates step by step: the trainer's `learning_rates`, from gsplat's ExponentialLR
    scale = json.loads((tmp_path / "out" / "config.json").read_text())["scene_scale"]
    assert len(ref.lrs) == STEPS and ref.steps_per_second > 0
    for step, lrs in enumerate(ref.lrs):
        want = learning_rates(cfg.optim.adam(), step, STEPS, scale)
        assert lrs.keys() == want.keys()
        for name in want:
            assert lrs[name] == pytest.approx(want[name], rel=1e-6), (step, name)
    assert ref.lrs[-1]["means"] < 0.5 * ref.lrs[0]["means"]  # the decay took part


def test_reference_refuses_what_it_does_not_implement(tiny):
    data, store = tiny
    base = ["--data", str(data), "--store", str(store), "--steps", "3"]
    for extra, message in ((["--adam", "dense"], "--strategy default"),
                           (["--strategy", "none"], "--adam visible"),
                           (["--strategy", "none", "--adam", "dense", "--batch-size", "2"], "--batch-size 2")):
        with pytest.raises(ConfigError, match=message):
            bench.reference_train(parse_config([*base, *extra]), torch.device("cpu"), 0, cpu_rasterize)
    with pytest.raises(ValueError, match="warm-up of 3 steps"):
        bench.reference_train(parse_config([*base, "--strategy", "none", "--adam", "dense"]), torch.device("cpu"), 3,
                              cpu_rasterize)


def test_gsplat_wrapper_passes_the_trainers_semantics(monkeypatch):
    """What `GsplatRasterizer` hands `gsplat.rasterization` (replaced here: its kernels need CUDA)."""
    import gsplat

    calls = []

    def fake(means, quats, scales, opacities, colors, viewmats, Ks, width, height, **kw):
        calls.append(dict(means=means, quats=quats, scales=scales, opacities=opacities, colors=colors,
                          viewmats=viewmats, Ks=Ks, width=width, height=height, **kw))
        return torch.zeros(1, height, width, 3) + colors.sum(), torch.zeros(1, height, width, 1), {}

    monkeypatch.setattr(gsplat, "rasterization", fake)
    g = torch.Generator().manual_seed(0)
    n = 7
    splats = {"means": torch.randn(n, 3, generator=g), "scales": torch.randn(n, 3, generator=g),
              "quats": torch.randn(n, 4, generator=g), "opacities": torch.randn(n, generator=g),
              "sh0": torch.randn(n, 1, 3, generator=g), "shN": torch.randn(n, 15, 3, generator=g)}
    viewmat = np.eye(4)
    viewmat[:3, 3] = [0.5, -1.0, 2.0]
    cam = Camera(viewmat, np.array([[50.0, 0, 20], [0, 55.0, 15], [0, 0, 1]]), 40, 30, name="c")
    r = bench.GsplatRasterizer()
    background = torch.tensor([0.1, 0.2, 0.3])
    rgb = r(splats, cam, 2, background)
    r(splats, cam, 3, background)
    assert rgb.shape == (30, 40, 3) and len(calls) == 2
    c = calls[0]
    torch.testing.assert_close(c["scales"], torch.exp(splats["scales"]))
    torch.testing.assert_close(c["opacities"], torch.sigmoid(splats["opacities"]))
    assert torch.equal(c["colors"], torch.cat([splats["sh0"], splats["shN"]], 1)) and c["colors"].shape == (n, 16, 3)
    assert c["viewmats"].shape == (1, 4, 4) and torch.equal(c["viewmats"][0].double(), torch.from_numpy(viewmat))
    assert c["Ks"].shape == (1, 3, 3) and torch.equal(c["Ks"][0].double(), torch.from_numpy(cam.K))
    assert (c["width"], c["height"], c["sh_degree"], c["packed"]) == (40, 30, 2, False)
    assert (c["near_plane"], c["far_plane"], c["eps2d"], c["tile_size"]) == (NEAR_PLANE, FAR_PLANE, EPS2D, TILE_SIZE)
    assert torch.equal(c["backgrounds"], background[None])
    assert calls[1]["sh_degree"] == 3 and calls[1]["viewmats"] is c["viewmats"]  # the matrices moved once


# ---- the report ----

def _train_run(seconds: list[float], psnr: float, peak: float, read: int) -> TrainRun:
    times = np.cumsum([0.5, *seconds])  # the first line comes after start-up
    lines = [{"kind": "train", "step": i + 1, "time": float(t), "t_io": 0.001, "t_render": 0.5 * s,
              "t_adam": 0.25 * s, "peak_gpu_mib": peak - 10 + i % 3}
             for i, (t, s) in enumerate(zip(times, [0.1, *seconds]))]
    summary = {"test_psnr": psnr, "cache_hit_rate": 0.5, "bytes_read": read}
    return TrainRun(summary, [lines], 300 * 2**20, float(times[-1]))


def _result(ref_seconds: float, ours_step: float, paged_step: float, ours_psnr: float) -> bench.SceneResult:
    steps, paged = 40, 20
    ref = bench.ReferenceRun(steps, steps - 10, ref_seconds, 20.0, 12.0, 1234.0, {})
    scene = bench.BenchScene("lund", Path("lund"), Path("lund.zarr"), 2)
    return bench.SceneResult(scene, 11_000, 30, 11_000 * 724, 10, 2, (968, 648), 40.0, 2.0, ref,
                             _train_run([ours_step] * (steps - 1), ours_psnr, 900.0, 0),
                             _train_run([paged_step] * (paged - 1), 15.0, 300.0, 10 * 2**20))


def _verdicts(out: str) -> list[str]:
    return [ln.split()[-1] for ln in out.splitlines() if ln.endswith(("PASS", "MISS"))]


def test_report_ratios_and_verdicts(capsys):
    cfg = bench.BenchConfig(steps=40, paged_steps=20, warmup=10)
    # reference 30 steps in 1.5 s (20 steps/s); ours 0.0625 s a step (16/s: 0.8x); paged 1.25x
    bench.report(_result(1.5, 0.0625, 0.078125, 20.04), cfg)
    out = capsys.readouterr().out
    assert "ours / reference steps/s" in out and "0.800x" in out and "+0.0400 dB" in out and "1.250x" in out
    assert _verdicts(out) == ["PASS", "PASS", "PASS"]
    assert "peak GPU MiB" in out and "1234.0" in out and "892.0" in out  # the largest of ours' lines
    assert "render 31.25" in out and "adam 15.62" in out  # ours' phases, ms per timed step
    bench.report(_result(1.5, 0.07, 0.1, 19.9), cfg)  # 0.71x, -0.1 dB, 1.43x
    assert _verdicts(capsys.readouterr().out) == ["MISS", "MISS", "MISS"]


# ---- the paged configuration ----

def test_a_quarter_of_lunds_state_holds_a_step_in_waves(shared_data, tmp_path):
    """Run 3's settings on lund_door (the bench's block size, its --cache-mb share, --data-factor
    2), on the CPU for 2 steps: the cache must page, not refuse the step, before a GPU is spent on it."""
    scene = bench.lund_scene(tmp_path, shared_data, 2)
    store = Store.open(scene.store, mode="r")
    nbytes = sum(i.count for i in store.table.values()) * bytes_per_gaussian(store.sh_degree)
    assert len(store.table) >= 16
    cfg = bench.BenchConfig(steps=2, paged_steps=2, warmup=0)
    flags = bench.trainer_flags(scene, cfg)
    flags[flags.index("--device") + 1] = "cpu"
    out = tmp_path / "paged"
    work = shutil.copytree(scene.store, tmp_path / "paged.zarr")
    summary = run(parse_config(["--data", str(scene.data), "--store", str(work), "--out", str(out), "--steps", "2",
                                *flags, "--cache-mb", f"{0.25 * nbytes / 2**20:.3f}", "--max-eval-images", "1",
                                "--no-progress", "--log-every", "1"]))
    assert summary["steps"] == 2 and summary["cache_hit_rate"] < 1.0


# ---- what the bench reads and how it runs children ----

def test_metrics_lines_carry_peak_gpu_memory_on_cuda_only(monkeypatch):
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3 * 2**20 + 2**19)
    on_gpu = _cache_fields(SimpleNamespace(stats=CacheStats(), device=torch.device("cuda", 0)))
    assert on_gpu["peak_gpu_mib"] == 3.5 and "peak_rss_mib" in on_gpu
    assert "peak_gpu_mib" not in _cache_fields(SimpleNamespace(stats=CacheStats(), device=torch.device("cpu")))


def test_a_child_past_its_timeout_is_stopped_and_fails_clearly():
    with pytest.raises(BenchError, match=r"sleeper ran past its 0.5 s limit and was stopped"):
        run_child([sys.executable, "-c", "import time; time.sleep(60)"], "sleeper", timeout=0.5)
    assert run_child([sys.executable, "-c", "pass"], "quick", timeout=60).seconds < 60


def test_the_budget_is_shared_by_every_child_and_spent_clearly():
    assert 99 < bench.Deadline(100).left("anything") <= 100
    with pytest.raises(BenchError, match=r"--budget of 0.5 s was spent before our run on city \(pass fewer"):
        bench.Deadline(0.5).left("our run on city")
