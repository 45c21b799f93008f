"""The trainer's learning-rate and loss flags reach the code they name; `--config` reruns a run."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import train.step as step_module
from storage import Store
from train.__main__ import main as train_main
from train.config import ConfigError, OptimConfig, parse_config
from train.logs import PLOT_DATA_KEY
from train.trainer import run


def _copy(store: Path, tmp_path: Path, name: str) -> Path:
    shutil.copytree(store, tmp_path / name)
    return tmp_path / name


def _flags(data: Path, store: Path, out: Path, *extra: str) -> list[str]:
    return ["--data", str(data), "--store", str(store), "--out", str(out), "--log-every", "1",
            "--commit-every", "50", "--no-progress", "--deterministic", "--strategy", "none", *extra]


def _blocks(store: Path) -> dict[str, dict[str, np.ndarray]]:
    s = Store.open(store, mode="r")
    return {k: s.read_block(k) for k in s.table}


def _train_losses(out: Path) -> list[float]:
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in lines if r["kind"] == "train"]


def test_means_lr_zero_leaves_every_mean_unchanged(wall, tmp_path):
    data, store = wall
    before = _blocks(store)
    trained = _copy(store, tmp_path, "a.zarr")
    run(parse_config(_flags(data, trained, tmp_path / "a", "--steps", "4", "--means-lr", "0")))
    after = _blocks(trained)
    for key in before:
        np.testing.assert_array_equal(after[key]["means"], before[key]["means"], err_msg=key)
    moved = sum(int((after[k]["scales"] != before[k]["scales"]).any(axis=1).sum()) for k in before)
    assert moved > 100, "the other parameters must have trained"
    # one rank's metrics.png draws its metrics.jsonl, and only the one-rank panels
    with Image.open(tmp_path / "a" / "metrics.png") as png:
        plotted = json.loads(png.text[PLOT_DATA_KEY])
    lines = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in lines if r["kind"] == "train"]
    assert plotted["loss"] == {"x": [r["step"] for r in train], "y": [r["loss"] for r in train]}
    assert plotted["held-out psnr"]["y"] == [r["psnr"] for r in lines if r["kind"] == "eval"]
    assert not any(name.startswith("rank ") or name.startswith("imbalance") for name in plotted)


def test_ssim_lambda_weighs_the_loss_as_the_formula_says(wall, tmp_path):
    """The first step renders the same image whatever the weight, so its loss is linear in it:
    (1 - l) L1 + l (1 - SSIM). Two runs give L1 and 1 - SSIM; a third must be their blend."""
    data, store = wall
    first = {}
    for weight in ("0", "1", "0.3"):
        s = _copy(store, tmp_path, f"s{weight}.zarr")
        run(parse_config(_flags(data, s, tmp_path / weight, "--steps", "1", "--ssim-lambda", weight)))
        first[weight] = _train_losses(tmp_path / weight)[0]
    l1, dssim = first["0"], first["1"]
    assert l1 != pytest.approx(dssim, rel=0.05), "the scene must tell the two terms apart"
    assert first["0.3"] == pytest.approx(0.7 * l1 + 0.3 * dssim, rel=1e-5)


def test_regularizers_add_simple_trainers_gradient_to_the_rows_adam_steps(wall, tmp_path, monkeypatch):
    """One step with --opacity-reg and --scale-reg beside one without, from the same store: the
    gradients Adam gets differ, on the rows it steps, by gsplat simple_trainer's terms over the
    whole scene (every block of the store, differentiated by autograd), and nowhere else."""
    data, store = wall
    seen: dict[str, list] = {"grads": [], "batch": []}
    real_adam, real_gather = step_module.SparseAdam, step_module.gather

    def adam(grads, mask, *args, **kwargs):
        seen["grads"].append(({n: g.clone() for n, g in grads.items()}, mask.clone()))
        return real_adam(grads, mask, *args, **kwargs)

    def gather(blocks, keys, requires_grad, **kwargs):
        batch = real_gather(blocks, keys, requires_grad, **kwargs)
        if requires_grad:
            seen["batch"].append((list(batch.keys), list(batch.offsets)))
        return batch

    monkeypatch.setattr(step_module, "SparseAdam", adam)
    monkeypatch.setattr(step_module, "gather", gather)
    weights = {"opacities": 0.5, "scales": 2.0}
    for name, flags in (("plain", []), ("reg", ["--opacity-reg", "0.5", "--scale-reg", "2"])):
        run(parse_config(_flags(data, _copy(store, tmp_path, f"{name}.zarr"), tmp_path / name, "--steps", "1",
                                *flags)))
    (plain, stepped), (reg, stepped_reg) = seen["grads"]
    assert torch.equal(stepped, stepped_reg) and 0 < int(stepped.sum())
    assert seen["batch"][0] == seen["batch"][1]
    keys, offsets = seen["batch"][0]

    scene = _blocks(store)  # every Gaussian, not only the step's blocks: the means are the scene's
    order = sorted(scene)
    starts = dict(zip(order, np.cumsum([0] + [len(scene[k]["means"]) for k in order])))
    leaves = {n: torch.from_numpy(np.concatenate([scene[k][n] for k in order])).requires_grad_(True) for n in weights}
    loss = (weights["opacities"] * torch.abs(torch.sigmoid(leaves["opacities"])).mean()
            + weights["scales"] * torch.abs(torch.exp(leaves["scales"])).mean())
    loss.backward()
    assert len(keys) < len(order), "the step must leave blocks out"
    for name in step_module.PARAM_NAMES:
        if name not in weights:
            assert torch.equal(reg[name], plain[name]), name
            continue
        term = torch.cat([leaves[name].grad[starts[k]: starts[k] + offsets[i + 1] - offsets[i]]
                          for i, k in enumerate(keys)])
        torch.testing.assert_close(reg[name][stepped], plain[name][stepped] + term[stepped], rtol=1e-6, atol=1e-12)
        assert torch.equal(reg[name][~stepped], plain[name][~stepped]), name
        assert (reg[name][stepped] != plain[name][stepped]).any(), name


def test_regularizers_default_to_gsplats_mcmc_preset_and_refuse_dense_adam(capsys):
    base = ["--data", "d", "--store", "s"]
    mcmc, default = parse_config([*base, "--strategy", "mcmc"]), parse_config(base)
    assert (mcmc.optim.opacity_reg, mcmc.optim.scale_reg) == (0.01, 0.01)
    assert (default.optim.opacity_reg, default.optim.scale_reg) == (0.0, 0.0)
    assert parse_config([*base, "--strategy", "mcmc", "--scale-reg", "0"]).optim.scale_reg == 0.0
    with pytest.raises(ConfigError, match="--adam dense with --opacity-reg 0.01"):
        parse_config([*base, "--strategy", "mcmc", "--adam", "dense"])
    assert parse_config([*base, "--strategy", "mcmc", "--adam", "dense", "--opacity-reg", "0", "--scale-reg", "0"])
    for bad in ("-0.1", "nan", "inf"):
        with pytest.raises(ConfigError, match=f"--opacity-reg {bad}: must be a finite number >= 0"):
            parse_config([*base, "--opacity-reg", bad])


def test_config_reruns_a_run_bit_for_bit(wall, tmp_path):
    data, store = wall
    a, b = _copy(store, tmp_path, "a.zarr"), _copy(store, tmp_path, "b.zarr")
    assert train_main(_flags(data, a, tmp_path / "a", "--steps", "5", "--seed", "3", "--sh0-lr", "3e-3",
                             "--ssim-lambda", "0.25", "--refine-every", "7")) == 0
    saved = json.loads((tmp_path / "a" / "config.json").read_text())
    assert saved["optim"]["sh0_lr"] == 3e-3 and saved["optim"]["shN_lr"] == pytest.approx(3e-3 / 20)
    assert train_main(["--config", str(tmp_path / "a" / "config.json"), "--store", str(b),
                       "--out", str(tmp_path / "b")]) == 0
    pa, pb = _blocks(a), _blocks(b)
    assert pa.keys() == pb.keys()
    for key in pa:
        for name in pa[key]:
            np.testing.assert_array_equal(pb[key][name], pa[key][name], err_msg=f"{key}/{name}")
    rerun = json.loads((tmp_path / "b" / "config.json").read_text())
    assert {k: v for k, v in rerun.items() if k not in ("store", "out")} == \
        {k: v for k, v in saved.items() if k not in ("store", "out")}
    # a flag given with --config overrides the file
    over = parse_config(["--config", str(tmp_path / "a" / "config.json"), "--steps", "9", "--means-lr", "0"])
    assert over.steps == 9 and over.optim.means_lr == 0 and over.seed == 3 and over.optim.ssim_lambda == 0.25


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(stpes=3), "stpes: unknown setting (did you mean steps?)"),
    (lambda c: c["densify"].update(grow_grad=1.0), "densify.grow_grad: unknown setting (did you mean densify.grow_grad2d?)"),
    (lambda c: c.update(steps="100"), "steps: '100' is not a valid integer"),
    (lambda c: c["optim"].update(means_lr=None), "optim.means_lr: None is not a valid number"),
    (lambda c: c.update(background=[0, 0]), "background: [0, 0] is not a valid list of 3 numbers"),
    (lambda c: c.update(densify=3), "densify: must be a JSON object of settings"),
    (lambda c: c["optim"].update(ssim_lambda=2.0), "--ssim-lambda 2.0: must be in [0, 1]"),
], ids=["typo", "nested-typo", "type", "null", "tuple", "group", "range"])
def test_config_file_errors_name_the_setting(tmp_path, capsys, edit, message):
    cfg = json.loads(json.dumps(_saved_defaults()))
    edit(cfg)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert train_main(["--config", str(path)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and len(err.splitlines()) == 1


def test_config_file_unreadable(tmp_path, capsys):
    assert train_main(["--config", str(tmp_path / "missing.json")]) == 1
    assert "missing.json: no such file" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{not json")
    assert train_main(["--config", str(tmp_path / "bad.json")]) == 1
    assert "bad.json: not a readable JSON file" in capsys.readouterr().err
    (tmp_path / "list.json").write_text("[1, 2]")
    assert train_main(["--config", str(tmp_path / "list.json")]) == 1
    assert "holds list, not a JSON object" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value", [("--means-lr", "-1"), ("--quats-lr", "nan"), ("--shN-lr", "inf"),
                                         ("--ssim-lambda", "1.5")])
def test_bad_learning_rates_are_refused(flag, value, capsys):
    assert train_main(["--data", "d", "--store", "s", flag, value]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {flag} {value}") or err.startswith(f"error: {flag} {float(value)}")


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_bad_image_memory_is_refused(value, capsys):
    assert train_main(["--data", "d", "--store", "s", "--image-memory-mb", value]) == 1
    assert capsys.readouterr().err.startswith(f"error: --image-memory-mb {float(value)}: must be a finite number >= 0")


def test_learning_rate_defaults_are_gsplats():
    o = OptimConfig()
    assert (o.means_lr, o.scales_lr, o.opacities_lr, o.quats_lr, o.sh0_lr, o.ssim_lambda) == \
        (1.6e-4, 5e-3, 5e-2, 1e-3, 2.5e-3, 0.2)
    assert o.shN_lr == 2.5e-3 / 20 and OptimConfig(sh0_lr=1e-2).shN_lr == 1e-2 / 20
    with pytest.raises(ConfigError, match="--scales-lr"):
        OptimConfig(scales_lr=-1.0)


def _saved_defaults() -> dict:
    """What a run's config.json holds for default settings (and the facts a run adds)."""
    from dataclasses import asdict

    cfg = parse_config(["--data", "d", "--store", "s"])
    return {**asdict(cfg), "ranks": 1, "device": "cpu", "scene_scale": 1.0, "train_images": 3, "test_images": 1}


def test_tensorboard_events_hold_the_logged_numbers_and_renders(wall, tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    data, store = wall
    s = _copy(store, tmp_path, "tb.zarr")
    out = tmp_path / "tb"
    run(parse_config(_flags(data, s, out, "--steps", "4", "--eval-every", "2", "--max-eval-images", "2",
                            "--tensorboard")))
    events = event_accumulator.EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for kind, key in (("train", "loss"), ("train", "psnr"), ("train", "gaussians"), ("train", "cache_hit_rate"),
                      ("train", "bytes_read"), ("eval", "psnr"), ("eval", "ssim")):
        want = [(r["step"], r[key]) for r in lines if r["kind"] == kind]
        got = [(e.step, e.value) for e in events.Scalars(f"{kind}/{key}")]
        assert [s for s, _ in got] == [s for s, _ in want], f"{kind}/{key}"
        np.testing.assert_allclose([v for _, v in got], [v for _, v in want], rtol=1e-6, err_msg=f"{kind}/{key}")
    images = events.Tags()["images"]
    assert len(images) == 2 and all(t.startswith("held-out/") for t in images)
    steps = sorted({e.step for t in images for e in events.Images(t)})
    assert steps == [2, 4]  # the evaluation at step 2 and the final one
    first = events.Images(images[0])[0]
    rendered = sorted((out / "renders" / "step_000002").glob("*.png"))[0]
    with Image.open(rendered) as png:
        assert (first.width, first.height) == png.size  # the side-by-side pair, as saved


def test_tensorboard_without_the_package_is_a_clear_error(wall, tmp_path, monkeypatch, capsys):
    import builtins

    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name.startswith("torch.utils.tensorboard"):
            raise ImportError("No module named 'tensorboard'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    data, store = wall
    assert train_main(_flags(data, _copy(store, tmp_path, "x.zarr"), tmp_path / "x", "--steps", "1",
                             "--tensorboard")) == 1
    err = capsys.readouterr().err
    assert "error: --tensorboard needs the tensorboard package" in err and "Traceback" not in err


def test_lpips_is_skipped_once_with_the_reason_where_its_weights_are_missing(wall, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "empty-torch-home"))
    data, store = wall
    summary = run(parse_config(_flags(data, _copy(store, tmp_path, "l.zarr"), tmp_path / "l", "--steps", "4",
                                      "--eval-every", "2", "--max-eval-images", "2")))
    err = capsys.readouterr().err
    assert err.count("LPIPS skipped:") == 1  # two evaluations, one message
    assert summary["test_lpips"] is None and summary["lpips_skipped"].startswith("LPIPS skipped:")


def test_lpips_where_installed_is_the_mean_over_held_out_views(wall, tmp_path, monkeypatch):
    """The loading code with a stand-in for the lpips package (its real network needs torchvision
    and AlexNet's weights, which cannot be had here): a distance we can compute from the renders."""
    import sys
    import types

    import torch

    home = tmp_path / "torch-home"
    (home / "hub" / "checkpoints").mkdir(parents=True)
    (home / "hub" / "checkpoints" / "alexnet-owt-7be5be79.pth").write_bytes(b"stand-in")
    monkeypatch.setenv("TORCH_HOME", str(home))

    class StandIn(torch.nn.Module):
        def __init__(self, net: str, verbose: bool) -> None:
            super().__init__()
            assert net == "alex"

        def forward(self, a, b):  # [1, 3, H, W] in [-1, 1]
            return (a - b).abs().mean(dim=(1, 2, 3), keepdim=True)

    monkeypatch.setitem(sys.modules, "lpips", types.SimpleNamespace(LPIPS=StandIn))
    data, store = wall
    out = tmp_path / "l"
    summary = run(parse_config(_flags(data, _copy(store, tmp_path, "l.zarr"), out, "--steps", "2",
                                      "--max-eval-images", "3")))
    assert "lpips_skipped" not in summary
    pairs = sorted((out / "renders" / "step_000002").glob("*.png"))
    assert len(pairs) == 3
    want = []
    for path in pairs:  # rendered | ground truth, 8-bit
        pair = np.asarray(Image.open(path), dtype=np.float64) / 255.0
        w = pair.shape[1] // 2
        want.append(2.0 * np.abs(pair[:, :w] - pair[:, w:]).mean())  # the stand-in on [-1, 1] images
    assert summary["test_lpips"] == pytest.approx(float(np.mean(want)), abs=4 / 255)
