"""`python -m tools.bench densify [SECTION ...] [--quick] [--only RUN ...]`: adaptive density control.

Each scene is trained up to six ways, side by side in one bench run, each from a fresh copy of the
same store (`python -m tools.tile`), `--steps` steps at batch 1, seed 0, on the trainer's camera
schedule, scored on the dataset's held-out views every `--eval-every` steps and at the end:

reference: gsplat's own densification in this process, all in memory: `gsplat.strategy.DefaultStrategy`
    (its defaults, plus the opacity reset gsplat 1.5.3 never fires, see `ResetFixedStrategy`) driven
    in packed mode with our CPU renderer's projected splats (means2d, radii, ids), one
    `torch.optim.Adam` per parameter with gsplat simple_trainer's learning rates (means x scene scale,
    decaying to 1% over the run), its loss and SH schedule; the strategy's post-backward step runs
    after the optimisers stepped, as simple_trainer does. Everything but the strategy is
    `tools.bench.train.dense_reference`.
reference-visible: the same with simple_trainer's `--visible_adam` (gsplat's SelectiveAdam: Adam
    changes only the rows the camera projected), the optimizer closest to the trainer's sparse
    Adam (which changes only rows that reached a pixel); it tells how much of a gap to the
    reference is the optimizer rather than densification.
ours: `python -m train --strategy default` with the same refine schedule (`Refine`) and the
    trainer's default `--adam visible` (Adam steps every Gaussian a camera projected,
    bias-corrected by the training step: gsplat's SelectiveAdam, as reference-visible): what
    blocks and out-of-core paging do to densification.
ours-contributed: the same with `--adam contributed` (Adam steps only the Gaussians that reached a
    pixel, each bias-corrected by its own step count: what `--occlusion on` needs).
ours-dense: the same with `--adam dense` (every Gaussian every step, as torch's Adam in the
    reference; the steps of Gaussians no camera used are taken when they are next used).
ours-none: `python -m train --strategy none`, the same store without densification: what
    densification buys at all.

Scenes: lund_door (SfM points, 12 photos), vesta_colmap_bin (1,465 SfM points, 4 RGBA photos) and
`nopoints`, the `tools.make_scene object` dataset without its point cloud, tiled from random points
(`--init-random`): densification has to make the scene (with an opacity reset every 1000 steps
unless `--reset-every` says otherwise: the reset is what clears a random start). Section `mcmc` trains lund_door with
`--strategy mcmc --cap-max 3 x initial` twice: `mcmc`, gsplat simple_trainer's mcmc preset (the
store tiled with `--init-opacity 0.5 --init-scale 0.1`, the trainer's default opacity and scale
regularisers of 0.01), and `mcmc-noreg`, the default store without the regularisers (what the
preset adds); a failure there is reported and the rest goes on.
Section `ranks` trains lund_door with densification under `mpirun -n 4` (batch 1 a rank) and
under `mpirun -n 1` (batch 4), `--ranks-steps` steps, and checks that both end with the same
blocks bit for bit; it prints, per refinement, the rebalance and the Gaussians each rank owns
after it (max / mean).
Targets per scene: ours >= reference - 0.1 dB PSNR, SSIM within 0.005 of it, ours >= ours-none + 1 dB,
final Gaussian count within 5% of the reference's. s/step: the step's own time (render, backward,
Adam, densification; the trainer's `seconds` field, every 10th step), after warm-up steps.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from gsplat.strategy import DefaultStrategy
from gsplat.strategy.ops import reset_opa

from train.cli import HelpFormatter
from storage import Store
from tools.bench import data_dir
from tools.bench.train import (GSPLAT_LR, SH_DEGREE_INTERVAL, BenchError, copy_dataset, python_module,
                               run_child, scratch, store_size, tile, train, warm_images)
from train.config import TrainConfig
from train.losses import photometric_loss, psnr, ssim
from train.render import render
from train.schedule import Schedule
from train.trainer import load_cameras, look_features

SECTIONS = ("lund_door", "vesta", "nopoints", "mcmc", "ranks")
RUNS = ("reference", "reference-visible", "ours", "ours-contributed", "ours-dense", "ours-none", "mcmc", "mcmc-noreg")
MCMC_INIT = ("--init-opacity", "0.5", "--init-scale", "0.1")  # simple_trainer's mcmc preset: init_opa, init_scale
LABELS = {"reference": "ref: gsplat", "reference-visible": "ref: visible", "ours": "ours+densify",
          "ours-contributed": "ours+contributed", "ours-dense": "ours+dense", "ours-none": "ours-none"}


@dataclass(frozen=True)
class Refine:
    """The densification schedule both sides share (DefaultStrategy's names and defaults; both
    leave refine_stop_iter at 15,000). gsplat refines at 0-based step s > refine_start_iter with
    s % refine_every == 0, and (fixed) resets opacities at s % reset_every == 0."""

    refine_start_iter: int = 500
    refine_every: int = 100
    reset_every: int = 3000

    def flags(self, reset: bool = True) -> list[str]:
        names = ("refine_start_iter", "refine_every") + (("reset_every",) if reset else ())
        return [a for n in names for a in (f"--{n.replace('_', '-')}", str(getattr(self, n)))]


@dataclass(frozen=True)
class BenchConfig:
    """One bench run: every run of every scene trains this long on this schedule."""

    steps: int = 3000
    eval_every: int = 500
    seed: int = 0
    refine: Refine = Refine()
    warmup: int = 10  # first steps left out of s/step
    log_every: int = 10  # the trainer's metrics lines (and the reference's count samples)
    runs: tuple[str, ...] = RUNS
    lund_factor: int = 4  # lund_door's photos: 1296 x 1936 -> 324 x 484
    vesta_factor: int = 2  # vesta's: 1024 x 1024 -> 512 x 512
    max_per_block: int = 2048  # lund_door and nopoints: many blocks, so paging and block splits take part
    vesta_per_block: int = 512  # its 1,465 points still make several blocks
    init_random: int = 10_000  # nopoints: random initial Gaussians (the object's point cloud has 12,000)
    # nopoints: gsplat's opacity reset (every 3000 of its 30,000 steps) is what clears a random
    # start; a 3000-step run resets every 1000 instead, both sides (--reset-every overrides it)
    nopoints_reset_every: int = 1000

    @property
    def suffix(self) -> str:
        """Of every run folder: runs of another seed keep their own."""
        return f"-seed{self.seed}" if self.seed else ""


@dataclass(frozen=True)
class SceneSpec:
    """A scene ready to train: its dataset and pristine store."""

    name: str
    data: Path  # a writable dataset folder
    store: Path  # the pristine store
    data_factor: int
    milestones: tuple[int, ...] = ()  # extra rows: held-out PSNR at these steps


@dataclass
class Result:
    """One run: final held-out metrics, s/step, and its curves (step, value)."""

    psnr: float
    ssim: float
    gaussians: int
    seconds_per_step: float
    counts: list[tuple[int, int]] = field(default_factory=list)
    evals: list[tuple[int, float, float]] = field(default_factory=list)  # (step, psnr, ssim)
    note: str = ""


def _mean(values: list[float]) -> float:
    return float(np.mean(values)) if values else float("nan")  # nan: a run no longer than the warm-up


@dataclass
class ResetFixedStrategy(DefaultStrategy):
    """DefaultStrategy with the opacity reset firing. gsplat 1.5.3 tests `step % self.reset_every
    == 0 & step > 0`, which Python reads as `step % reset_every == (0 & step) > 0`: never true, so
    the parent cannot reset too and this adds the reset, where the parent means it to happen."""

    resets: list[int] = field(default_factory=list)  # steps at which the reset fired (the bench reports them)

    def step_post_backward(self, params, optimizers, state, step, info, packed=False) -> None:
        super().step_post_backward(params, optimizers, state, step, info, packed=packed)
        if step < self.refine_stop_iter and step % self.reset_every == 0 and step > 0:
            reset_opa(params=params, optimizers=optimizers, state=state, value=self.prune_opa * 2.0)
            self.resets.append(step)


def reference(spec: SceneSpec, cfg: BenchConfig, visible_adam: bool = False) -> Result:
    """dense_reference's trainer with gsplat's DefaultStrategy (module docstring); steps are 0-based
    for the strategy, as in simple_trainer, and 1-based (steps done) in the curves, as in the trainer's logs.
    visible_adam: as simple_trainer's --visible_adam (gsplat's SelectiveAdam), Adam changes only the
    rows the camera projected: the others' parameters and moments are put back after each step."""
    torch.manual_seed(cfg.seed)  # split() samples new means
    store = Store.open(spec.store, mode="r")
    scene = load_cameras(TrainConfig(data=str(spec.data), store=str(spec.store), data_factor=spec.data_factor), store)
    blocks = [store.read_params(key) for key in store.table]
    splats = {name: torch.nn.Parameter(torch.from_numpy(np.concatenate([b[name] for b in blocks])))
              for name in blocks[0]}
    optimizers = {name: torch.optim.Adam([p], lr=GSPLAT_LR[name] * (scene.scene_scale if name == "means" else 1.0),
                                         eps=1e-15) for name, p in splats.items()}
    decay = torch.optim.lr_scheduler.ExponentialLR(optimizers["means"], gamma=0.01 ** (1.0 / cfg.steps))
    strategy = ResetFixedStrategy(refine_start_iter=cfg.refine.refine_start_iter,
                                  refine_every=cfg.refine.refine_every, reset_every=cfg.refine.reset_every)
    strategy.check_sanity(splats, optimizers)
    state = strategy.initialize_state(scene_scale=scene.scene_scale)
    background = torch.zeros(3)
    photos = {c.name: scene.data.load_image(c) for c in scene.train + scene.test}
    schedule = Schedule(cfg.seed, len(scene.train), 1, look_features(scene.train, scene.scene_scale),
                        TrainConfig().locality_window)  # the trainer's schedule

    @torch.no_grad()
    def held_out(step: int) -> tuple[int, float, float]:
        p = s = 0.0
        for cam in scene.test:
            rgb, _, _ = render(splats, cam, store.sh_degree, background)
            p += psnr(rgb, photos[cam.name])
            s += float(ssim(rgb.clamp(0, 1), photos[cam.name]))
        return step, p / len(scene.test), s / len(scene.test)

    counts, evals, times = [(0, len(splats["means"]))], [], []
    for step in range(cfg.steps):
        cam = scene.train[int(schedule.cameras(step)[0])]
        start = time.perf_counter()
        rgb, _, meta = render(splats, cam, min(step // SH_DEGREE_INTERVAL, store.sh_degree), background)
        info = {"means2d": meta["means2d"], "radii": meta["radii"], "gaussian_ids": meta["ids"],
                "width": cam.width, "height": cam.height, "n_cameras": 1}
        strategy.step_pre_backward(splats, optimizers, state, step, info)
        photometric_loss(rgb, photos[cam.name]).backward()
        hidden = torch.ones(len(splats["means"]), dtype=torch.bool)
        hidden[meta["ids"]] = False
        for name, opt in optimizers.items():
            if visible_adam:
                p = splats[name]
                kept = {k: v[hidden].clone() for k, v in opt.state.get(p, {}).items() if k != "step"}
                kept["param"] = p.detach()[hidden].clone()
            opt.step()
            if visible_adam:
                with torch.no_grad():
                    p[hidden] = kept.pop("param")
                    for k, v in kept.items():
                        opt.state[p][k][hidden] = v
            opt.zero_grad(set_to_none=True)
        decay.step()
        strategy.step_post_backward(splats, optimizers, state, step, info, packed=True)
        times.append(time.perf_counter() - start)
        done = step + 1
        if done % cfg.log_every == 0 or done == cfg.steps:
            counts.append((done, len(splats["means"])))
        if done % cfg.eval_every == 0 or done == cfg.steps:
            evals.append(held_out(done))
    resets = ", ".join(map(str, strategy.resets)) or "none"
    return Result(evals[-1][1], evals[-1][2], len(splats["means"]), _mean(times[cfg.warmup:]), counts, evals,
                  note=f"opacity resets at steps {resets}")


def ours(spec: SceneSpec, cfg: BenchConfig, name: str, options: list[str]) -> Result:
    """`python -m train` on a fresh copy of the store; curves from its metrics.jsonl."""
    out = spec.store.parent / f"densify-{spec.name}-{name}{cfg.suffix}"
    run = train(spec.data, spec.store, out, cfg.steps, "--data-factor", str(spec.data_factor), "--seed",
                str(cfg.seed), "--eval-every", str(cfg.eval_every), "--log-every", str(cfg.log_every), *options)
    # train() keeps the "train" lines only: the "eval" lines are read back here.
    lines = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    logged = run.ranks[0]
    counts = [(0, store_size(spec.store).gaussians)] + [(r["step"], r["gaussians"]) for r in logged if "gaussians" in r]
    evals = [(r["step"], r["psnr"], r["ssim"]) for r in lines if r["kind"] == "eval"]
    seconds = [r["seconds"] for r in logged if r["step"] > cfg.warmup]  # the step's own time, no loop around it
    s = run.summary
    return Result(s["test_psnr"], s["test_ssim"], int(s["gaussians"]), _mean(seconds), counts, evals,
                  note=f"whole run {s['seconds_per_step']:.4f} s/step (start-up, commits, evals included)")


def compare(spec: SceneSpec, cfg: BenchConfig, results: dict[str, Result]) -> None:
    """Print the scene's table and whether each target is met."""
    size = store_size(spec.store)
    print(f"\n[{spec.name}] --data-factor {spec.data_factor}: {size.gaussians:,} initial Gaussians in {size.blocks} "
          f"blocks; {cfg.steps} steps, batch 1, seed {cfg.seed}; refine from {cfg.refine.refine_start_iter} every "
          f"{cfg.refine.refine_every}, opacity reset every {cfg.refine.reset_every}; s/step after {cfg.warmup} steps")
    runs = [r for r in LABELS if r in results]
    print(f"{'':22s}" + "".join(f"{LABELS[r]:>14s}" for r in runs))
    at = {r: dict((s, p) for s, p, _ in results[r].evals) for r in runs}
    rows = [(f"PSNR at step {m}", [at[r].get(m, float("nan")) for r in runs], "{:.3f}") for m in spec.milestones]
    rows += [("held-out PSNR", [results[r].psnr for r in runs], "{:.3f}"),
             ("held-out SSIM", [results[r].ssim for r in runs], "{:.4f}"),
             ("final Gaussians", [results[r].gaussians for r in runs], "{:,d}"),
             ("s/step", [results[r].seconds_per_step for r in runs], "{:.4f}")]
    for label, values, fmt in rows:
        print(f"{label:22s}" + "".join(f"{fmt.format(v):>14s}" for v in values))
    for r in runs:
        print(f"  {LABELS[r]}: {results[r].note}")
    ref, none = results.get("reference"), results.get("ours-none")
    for name in ("ours", "ours-contributed", "ours-dense"):
        ok = results.get(name)
        if ok is None:
            continue
        targets = [("PSNR: ours >= reference - 0.1 dB", ref and ok.psnr >= ref.psnr - 0.1),
                   ("SSIM: |ours - reference| <= 0.005", ref and abs(ok.ssim - ref.ssim) <= 0.005),
                   ("PSNR: ours >= ours-none + 1 dB", none and ok.psnr >= none.psnr + 1.0),
                   ("count: ours within 5% of reference", ref and abs(ok.gaussians / ref.gaussians - 1) <= 0.05)]
        for label, met in targets:  # met is None where a run it needs was left out (--only)
            verdict = "n/a (run left out)" if met is None else ("met" if met else "MISSED")
            print(f"  {LABELS[name]}: target {label:36s} {verdict}")


def plot(png: Path, scenes: dict[str, dict[str, Result]]) -> None:
    """Gaussian count and held-out PSNR over steps, a row per scene."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(scenes), 2, figsize=(11, 3.6 * len(scenes)), squeeze=False)
    for (name, results), (count_ax, psnr_ax) in zip(scenes.items(), axes):
        for run, r in results.items():
            if r.counts:
                count_ax.plot(*zip(*r.counts), label=LABELS.get(run, run))
            if r.evals:
                psnr_ax.plot([e[0] for e in r.evals], [e[1] for e in r.evals], marker="o", label=LABELS.get(run, run))
        count_ax.set(title=f"{name}: Gaussians", xlabel="step")
        psnr_ax.set(title=f"{name}: held-out PSNR (dB)", xlabel="step")
        for ax in (count_ax, psnr_ax):
            ax.grid(alpha=0.3)
            ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def ranks(spec: SceneSpec, cfg: BenchConfig, steps: int) -> bool:
    """4 ranks against 1 at the same global batch: bit for bit, and the regions' balance."""
    options = ["--data-factor", str(spec.data_factor), "--seed", str(cfg.seed), "--batch-size", "4",
               "--strategy", "default", *cfg.refine.flags(), "--log-every", str(cfg.log_every)]
    runs = {n: spec.store.parent / f"densify-ranks-{n}{cfg.suffix}" for n in (1, 4)}
    one = train(spec.data, spec.store, runs[1], steps, *options, ranks=1, keep_store=True)
    four = train(spec.data, spec.store, runs[4], steps, *options, "--batch-size", "1", ranks=4,
                 keep_store=True)  # (the later --batch-size wins)
    a, b = (Store.open(runs[n].with_name(runs[n].name + ".zarr"), mode="r") for n in (1, 4))
    same = a.table.keys() == b.table.keys() and all(
        np.array_equal(x, y) for k in a.table for x, y in zip(a.read_block(k).values(), b.read_block(k).values()))
    refines: dict[int, list[dict]] = {}
    for r in range(4):
        for line in (runs[4] / f"metrics.rank{r}.jsonl").read_text().splitlines():
            record = json.loads(line)
            if record["kind"] == "refine":
                refines.setdefault(record["step"], []).append(record)
    print(f"\n[ranks] lund_door --data-factor {spec.data_factor}, {steps} steps, global batch 4: mpirun -n 4 "
          f"{four.summary['seconds_per_step']:.4f} s/step, -n 1 {one.summary['seconds_per_step']:.4f} s/step; "
          f"{sum(i.count for i in a.table.values()):,} Gaussians in {len(a.table)} blocks")
    print(f"same blocks bit for bit on 4 ranks and 1: {'yes' if same else 'NO'}")
    print(f"{'step':>6s} {'Gaussians':>10s} {'owned per rank':>32s} {'max/mean':>9s} {'imbalance before/after':>23s} "
          f"{'blocks moved':>13s} {'MiB moved':>10s} {'rows sent MiB':>14s}")
    for step, lines in sorted(refines.items()):
        lines.sort(key=lambda r: r["owned"])
        owned = np.array([r["owned"] for r in lines])
        r0 = lines[0]
        print(f"{step:>6d} {r0['gaussians']:>10,d} {' '.join(f'{o:>7,d}' for o in owned):>32s} "
              f"{owned.max() / owned.mean():>9.3f} {r0['imbalance_before']:>11.3f}/{r0['imbalance_after']:<11.3f} "
              f"{r0['rebalanced_blocks']:>13d} {r0['rebalanced_bytes'] / 2**20:>10.2f} "
              f"{sum(r['bytes_sent'] for r in lines) / 2**20:>14.3f}")
    return same


def nopoints_dataset(work: Path) -> Path:
    """The `tools.make_scene object` dataset without its point cloud: transforms.json minus
    `ply_file_path` (make_scene always writes one), photos linked; the loader then draws random
    points in the box around the cameras, which surround the object. (A scene seen from one side,
    as the wall, is no test of this: the box around its cameras holds none of the wall.)"""
    base = work / "object"
    if not (base / "transforms.json").is_file():
        run_child(python_module("tools.make_scene", "object", base, "--overwrite"), "tools.make_scene object")
    out = work / "object-nopoints"
    if not (out / "transforms.json").is_file():
        out.mkdir(exist_ok=True)
        meta = json.loads((base / "transforms.json").read_text())
        meta.pop("ply_file_path", None)
        if not (out / "images").exists():
            os.symlink((base / "images").resolve(), out / "images")
        (out / "transforms.json").write_text(json.dumps(meta))
    return out


def scene_specs(work: Path, data_root: Path, sections: list[str], cfg: BenchConfig) -> dict[str, SceneSpec]:
    """Datasets (writable copies: the trainer writes its downscaled photos beside them) and pristine
    stores of the sections asked for, made once per work folder."""
    specs = {}
    if {"lund_door", "mcmc", "ranks"} & set(sections):
        data = copy_dataset(data_root / "lund_door", work / "lund_door")
        store = tile(data, work / f"lund_door-{cfg.max_per_block}.zarr", cfg.max_per_block)
        specs["lund_door"] = SceneSpec("lund_door", data, store, cfg.lund_factor)
        if "mcmc" in sections:
            preset = tile(data, work / f"lund_door-mcmc-{cfg.max_per_block}.zarr", cfg.max_per_block, *MCMC_INIT)
            specs["mcmc"] = SceneSpec("lund_door", data, preset, cfg.lund_factor)
    if "vesta" in sections:
        data = copy_dataset(data_root / "vesta_colmap_bin", work / "vesta_colmap_bin")
        store = tile(data, work / f"vesta-{cfg.vesta_per_block}.zarr", cfg.vesta_per_block)
        specs["vesta"] = SceneSpec("vesta", data, store, cfg.vesta_factor)
    if "nopoints" in sections:
        data = nopoints_dataset(work)
        store = tile(data, work / f"{data.name}-random{cfg.init_random}-{cfg.max_per_block}.zarr", cfg.max_per_block,
                     "--init-random", str(cfg.init_random), "--seed", str(cfg.seed))
        specs["nopoints"] = SceneSpec("nopoints", data, store, 1, (cfg.steps // 3, cfg.steps))
    for spec in specs.values():
        warm_images(spec.data, spec.data_factor)
    return specs


def mcmc(specs: dict[str, SceneSpec], cfg: BenchConfig, scenes: dict[str, dict[str, Result]], png: Path) -> bool:
    """The mcmc section: gsplat's mcmc preset and the same without its regularisers, at a cap of 3 x
    the initial count; prints each beside the lund_door runs. False if a run failed."""
    cap = 3 * store_size(specs["lund_door"].store).gaussians
    options = ["--strategy", "mcmc", "--cap-max", str(cap), *cfg.refine.flags(reset=False)]  # MCMC: no reset
    runs = {"mcmc": (specs["mcmc"], options, "gsplat's mcmc preset: init opacity 0.5, scale x 0.1, regularisers 0.01"),
            "mcmc-noreg": (specs["lund_door"], [*options, "--opacity-reg", "0", "--scale-reg", "0"],
                           "gsplat's initialisation, no regularisers")}
    ok = True
    for name, (spec, flags, what) in runs.items():
        if name not in cfg.runs:
            continue
        try:
            r = ours(spec, cfg, name, flags)
        except BenchError as e:
            print(f"error: {name}: {e} (the other sections went on)", file=sys.stderr)
            ok = False
            continue
        print(f"\n[{name}] lund_door, --cap-max {cap:,} (3 x initial), {what}: held-out PSNR {r.psnr:.3f}, SSIM "
              f"{r.ssim:.4f}, {r.gaussians:,} Gaussians, {r.seconds_per_step:.4f} s/step; {r.note}")
        for run, other in scenes.get("lund_door", {}).items():
            print(f"  {LABELS.get(run, run)}: {other.psnr:.3f} dB, {other.gaussians:,} Gaussians")
        scenes.setdefault("lund_door", {})[name] = r
        plot(png, scenes)
    return ok


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(formatter_class=HelpFormatter, prog="python -m tools.bench densify",
                                description="densification: gsplat's DefaultStrategy against the trainer's")
    p.add_argument("sections", nargs="*", metavar="SECTION", help=f"any of {', '.join(SECTIONS)} (default: all)")
    p.add_argument("--quick", action="store_true", help="300 steps, refine schedule scaled down (a smoke run)")
    p.add_argument("--only", action="append", choices=RUNS,
                   help="run only these (repeatable; default: all; mcmc, mcmc-noreg: the mcmc section's runs)")
    p.add_argument("--data", type=Path, default=data_dir(), help="the shared data folder")
    p.add_argument("--work", type=Path, help="keep datasets, stores and runs here (default: a temporary folder)")
    p.add_argument("--steps", type=int, help="training steps of every run (default 3000, --quick 300)")
    p.add_argument("--eval-every", type=int, help="held-out evaluation every N steps (default 500, --quick 100)")
    for name, default, quick in (("refine-start-iter", 500, 100), ("refine-every", 100, 50),
                                 ("reset-every", 3000, 200)):
        p.add_argument(f"--{name}", type=int, help=f"refine schedule, both sides (default {default}, --quick {quick})")
    p.add_argument("--seed", type=int, default=0, help="seed of every run (the split samples and the camera schedule): "
                   "one training run is chaotic, so compare runs over several seeds")
    p.add_argument("--ranks-steps", type=int, default=1000, help="ranks: training steps of the 4- and 1-rank runs")
    p.add_argument("--vesta-factor", type=int, help="vesta's image downscale factor (default 2: 512 x 512)")
    p.add_argument("--init-random", type=int, help="nopoints: random initial Gaussians (default 10000)")
    p.add_argument("--plot", type=Path, help="the PNG (default: WORK/densify.png, without --work $TMPDIR/densify.png)")
    return p


def main(argv: list[str]) -> int:
    p = _parser()
    a = p.parse_args(argv)
    a.sections = a.sections or list(SECTIONS)
    for name in a.sections:
        if name not in SECTIONS:
            p.error(f"unknown section {name!r} (choose from {', '.join(SECTIONS)})")
    for name in ("steps", "eval_every", "refine_start_iter", "refine_every", "reset_every", "vesta_factor",
                 "init_random"):
        if getattr(a, name) is not None and getattr(a, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    base = BenchConfig(steps=300, eval_every=100, refine=Refine(100, 50, 200)) if a.quick else BenchConfig()
    refine = Refine(*(getattr(a, n) or getattr(base.refine, n) for n in ("refine_start_iter", "refine_every",
                                                                          "reset_every")))
    cfg = replace(base, steps=a.steps or base.steps, eval_every=a.eval_every or base.eval_every, refine=refine,
                  runs=tuple(a.only or RUNS), seed=a.seed, vesta_factor=a.vesta_factor or base.vesta_factor,
                  init_random=a.init_random or base.init_random)
    if not a.data.is_dir():
        print(f"error: {a.data}: no such data folder (pass --data)", file=sys.stderr)
        return 2
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (other processes share them)")
    start, failed = time.perf_counter(), False
    scenes: dict[str, dict[str, Result]] = {}
    with scratch(a.work) as work:
        # a temporary work folder goes when the bench ends: its plot then goes to the temp dir, not the cwd
        png = a.plot or (work if a.work else Path(tempfile.gettempdir())) / "densify.png"
        try:
            specs = scene_specs(work, a.data, a.sections, cfg)
            for name in (s for s in a.sections if s not in ("mcmc", "ranks")):
                spec, results = specs[name], scenes.setdefault(name, {})
                run_cfg = cfg
                if name == "nopoints" and not a.quick and a.reset_every is None:
                    run_cfg = replace(cfg, refine=replace(cfg.refine, reset_every=cfg.nopoints_reset_every))
                try:
                    if "reference" in run_cfg.runs:
                        results["reference"] = reference(spec, run_cfg)
                    if "reference-visible" in run_cfg.runs:
                        results["reference-visible"] = reference(spec, run_cfg, visible_adam=True)
                    if "ours" in run_cfg.runs:
                        results["ours"] = ours(spec, run_cfg, "ours",
                                               ["--strategy", "default", *run_cfg.refine.flags()])
                    for mode in ("contributed", "dense"):
                        if f"ours-{mode}" in run_cfg.runs:
                            results[f"ours-{mode}"] = ours(spec, run_cfg, mode, ["--strategy", "default", "--adam",
                                                                                 mode, *run_cfg.refine.flags()])
                    if "ours-none" in run_cfg.runs:
                        results["ours-none"] = ours(spec, run_cfg, "none", ["--strategy", "none"])
                finally:  # a failed run still shows the runs before it; a missed target is a figure, not an error
                    if results:
                        compare(spec, run_cfg, results)
                        plot(png, scenes)
        except BenchError as e:
            if scenes:
                print(f"\nplot (the runs so far): {png}")
            print(f"error: {e}", file=sys.stderr)
            return 1
        if "mcmc" in a.sections:
            failed |= not mcmc(specs, cfg, scenes, png)
        if "ranks" in a.sections:
            try:
                failed |= not ranks(specs["lund_door"], cfg, a.ranks_steps)
            except BenchError as e:
                print(f"error: ranks: {e}", file=sys.stderr)
                failed = True
        if scenes:
            print(f"\nplot: {png}")
    print(f"\ntotal {time.perf_counter() - start:.0f} s, load average {os.getloadavg()[0]:.1f}")
    return 1 if failed else 0
