"""`python -m tools.bench gpu`: the trainer on one CUDA device against a loop written from gsplat's own pieces.

For each scene, tiled once into a store that every run trains from, three runs side by side, on
the same cameras in the same order (the trainer's `Schedule`), with the same loss, learning
rates, SH schedule, background and held-out views (every 8th photo, the trainer's --test-every,
read by the trainer's own loader), all settings parsed from one trainer command line:

1. reference, in this process: every Gaussian on the GPU as six leaf tensors, rendered by
   `gsplat.rasterization` (packed=False; the trainer's near and far planes, eps2d, tile size and
   background), one `torch.optim.Adam` per parameter as gsplat's simple_trainer has them (eps
   1e-15; the means' learning rate times the scene scale under an ExponentialLR to 1% over the
   run), the trainer's loss (`train.losses.photometric_loss`: 0.8 L1 + 0.2 (1 - SSIM)), the
   training photos preloaded on the device. Steps per second between two
   `torch.cuda.synchronize()`, after the warm-up steps.
2. ours: `python -m train --device cuda --adam dense` (torch Adam's semantics, every Gaussian
   every step) with a --cache-mb that holds every block and a step's working memory in the device
   tier; steps per second from its metrics lines (one a step), held-out PSNR from its summary.
3. ours, paged: --cache-mb a quarter of the state's bytes (the pinned host tier as large again,
   the store on disk behind them), stopped after --paged-steps (`--stop-at`: the schedule and
   learning rates of run 2); its time per step against run 2's over the same steps.

Targets: (2) at least 0.8x the reference's steps per second, and held-out PSNR within 0.05 dB of
it after the same steps; (3) at most 1.3x the time per step of (2). Peak GPU memory is
`torch.cuda.max_memory_allocated` (the reference: this process, reset before it loads the scene,
its preloaded photos included; ours: the trainer's `peak_gpu_mib`). Our seconds per phase are the trainer's `t_*` fields: host
wall time, so the kernels a phase queues are charged to whichever phase next waits on the device.

Scenes, in --scenes order: lund, lund_door (COLMAP) at --data-factor 2, tiled from its points
into blocks of at most 512 (75 blocks: a quarter of its 11k Gaussians must still hold a block and
its working memory); city, `tools.make_scene city` of about --gaussians Gaussians with
--point-fraction 1 (so the store holds about that many), tiled at SH degree 3 into blocks of at
most 32,768 (64 blocks for 1e6).

The whole bench has a --budget of wall time (default 450 s: a lent GPU comes for 15 minutes,
start-up included). It starts with a preflight: numba's kernels compiled into its disk cache
(about two minutes on a fresh checkout, once) and one render through gsplat's CUDA kernels. A
child process still running when the budget is spent is stopped and the bench fails, naming it.

Exit status: 0 when every run finished (a missed target is reported, not an error), 1 when a run
failed or the budget ran out, 2 for bad arguments, missing data or no CUDA device (checked before
any work).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from storage import Store, StoreError
from tools.bench import data_dir
from tools.bench.train import (BenchError, TrainRun, copy_dataset, python_module, run_child, scratch, store_size,
                               tile, train, warm_images)
from train.camera import Camera
from train.cli import HelpFormatter
from train.config import ConfigError, TrainConfig, parse_config
from train.data import DatasetError
from train.losses import photometric_loss, psnr
from train.render.errors import RenderError
from train.render.semantics import EPS2D, FAR_PLANE, NEAR_PLANE, TILE_SIZE
from train.schedule import Schedule
from train.trainer import Scene, load_cameras, look_features

MiB = 2**20
SCENES = ("lund", "city")
CITY_BLOCK = 32768  # Gaussians per block at most: 64 blocks for 1e6, paged a block or two a wave by a quarter cache
LUND_BLOCK = 512  # lund_door's 11k points in 75 blocks, so a quarter of the state holds several
# The targets.
SPEED_TARGET = 0.8  # ours' steps per second over the reference's, at least
PSNR_TARGET = 0.05  # |ours - reference| held-out PSNR in dB, at most
PAGED_TARGET = 1.3  # paged seconds per step over whole-scene seconds per step, at most
# gsplat simple_trainer's Adam at batch size 1 (eps 1e-15 / sqrt(B), betas 1 - B (1 - beta)).
GSPLAT_BETAS = (0.9, 0.999)
GSPLAT_EPS = 1e-15
MEANS_LR_FINAL = 0.01  # simple_trainer's ExponentialLR: the means' lr ends at 1% of its start

# splats (leaves by gsplat's names), camera, SH degree, background [3] -> rgb [H, W, 3], differentiable
RasterizeFn = Callable[[dict[str, Tensor], Camera, int, Tensor], Tensor]


class GsplatRasterizer:
    """`gsplat.rasterization` behind `RasterizeFn`. Each camera's matrices go to the device once:
    a copy from pageable host memory every step would wait for the queued kernels."""

    def __init__(self) -> None:
        self._matrices: dict[str, tuple[Tensor, Tensor]] = {}  # camera name -> viewmat [1, 4, 4], K [1, 3, 3]

    def __call__(self, splats: dict[str, Tensor], camera: Camera, sh_degree: int, background: Tensor) -> Tensor:
        from gsplat import rasterization  # CUDA only: on CPU tensors its kernels start a JIT build and fail

        means = splats["means"]  # [N, 3]
        if camera.name not in self._matrices:
            self._matrices[camera.name] = tuple(
                torch.as_tensor(m, dtype=torch.float32, device=means.device)[None] for m in (camera.viewmat, camera.K))
        viewmat, K = self._matrices[camera.name]
        colors = torch.cat([splats["sh0"], splats["shN"]], dim=1)  # [N, 1 + K, 3]: gsplat reads (sh_degree + 1)^2
        rgb, _, _ = rasterization(means, splats["quats"], torch.exp(splats["scales"]),
                                  torch.sigmoid(splats["opacities"]), colors, viewmat, K, camera.width, camera.height,
                                  near_plane=NEAR_PLANE, far_plane=FAR_PLANE, eps2d=EPS2D, sh_degree=sh_degree,
                                  packed=False, tile_size=TILE_SIZE, backgrounds=background[None])  # [1, H, W, 3]
        return rgb[0]


@dataclass
class ReferenceRun:
    """What the reference loop measured and left."""

    steps: int
    timed_steps: int  # the steps after the warm-up
    seconds: float  # wall seconds of the timed steps, device work included
    psnr: float  # mean held-out PSNR after the run (nan: no held-out views)
    initial_psnr: float  # the same before the first step
    peak_gpu_mib: float  # torch.cuda.max_memory_allocated over loading and training (nan on CPU)
    splats: dict[str, Tensor]  # the trained parameters, detached, on the CPU
    lrs: list[dict[str, float]] = field(default_factory=list)  # per step: the learning rate each parameter took
    cameras: list[int] = field(default_factory=list)  # per step: the training camera's index

    @property
    def steps_per_second(self) -> float:
        return self.timed_steps / self.seconds if self.seconds > 0 else float("nan")


def check_reference_config(cfg: TrainConfig) -> None:
    """Refuse settings the reference loop does not implement, so a comparison never silently differs."""
    if cfg.batch_size != 1:
        raise ConfigError(f"reference loop: --batch-size {cfg.batch_size}: it trains one camera a step")
    if cfg.densify.strategy != "none":
        raise ConfigError(f"reference loop: --strategy {cfg.densify.strategy}: it does not densify "
                          "(pass --strategy none)")
    if cfg.optim.opacity_reg or cfg.optim.scale_reg:
        raise ConfigError("reference loop: --opacity-reg / --scale-reg: it has no regularisers")
    if cfg.adam != "dense":
        raise ConfigError(f"reference loop: --adam {cfg.adam}: torch's Adam steps every Gaussian (--adam dense)")


def load_splats(store: Store, device: torch.device) -> dict[str, Tensor]:
    """Every block's parameters, concatenated in the store's order, as leaves on `device`:
    means [N, 3], scales [N, 3] (log), quats [N, 4], opacities [N] (logits), sh0 [N, 1, 3], shN [N, K, 3]."""
    blocks = [store.read_params(key) for key in store.table]
    if not blocks:
        raise BenchError(f"store {store.name} holds no blocks")
    return {name: torch.from_numpy(np.concatenate([b[name] for b in blocks])).to(device).requires_grad_(True)
            for name in blocks[0]}


def gsplat_optimizers(splats: dict[str, Tensor], cfg: TrainConfig, scene_scale: float
                      ) -> tuple[dict[str, torch.optim.Adam], torch.optim.lr_scheduler.ExponentialLR]:
    """simple_trainer's optimizers: one Adam per parameter, the means' lr times the scene scale and
    decaying exponentially to 1% of it over the run (its scheduler, stepped once a step)."""
    o = cfg.optim
    lr = {"means": o.means_lr * scene_scale, "scales": o.scales_lr, "quats": o.quats_lr,
          "opacities": o.opacities_lr, "sh0": o.sh0_lr, "shN": o.shN_lr}
    optimizers = {name: torch.optim.Adam([{"params": [p], "lr": lr[name], "name": name}], betas=GSPLAT_BETAS,
                                         eps=GSPLAT_EPS)
                  for name, p in splats.items()}
    decay = torch.optim.lr_scheduler.ExponentialLR(optimizers["means"],
                                                   gamma=MEANS_LR_FINAL ** (1.0 / max(1, cfg.steps)))
    return optimizers, decay


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def held_out_psnr(splats: dict[str, Tensor], scene: Scene, cfg: TrainConfig, sh_degree: int, background: Tensor,
                  rasterize: RasterizeFn, device: torch.device) -> float:
    """Mean PSNR over the held-out views as the trainer's evaluation takes it (the first
    --max-eval-images of them, at the store's full SH degree)."""
    cameras = scene.test[:cfg.max_eval_images] if cfg.max_eval_images else scene.test
    if not cameras:
        return float("nan")
    return float(np.mean([psnr(rasterize(splats, c, sh_degree, background), scene.data.load_image(c).to(device))
                          for c in cameras]))


def reference_train(cfg: TrainConfig, device: torch.device, warmup: int,
                    rasterize: RasterizeFn | None = None) -> ReferenceRun:
    """Train `cfg.store`'s Gaussians (read, never written) for `cfg.steps` steps as gsplat's
    simple_trainer would, all of them on `device` (module docstring, run 1); `rasterize` defaults
    to `GsplatRasterizer` (CUDA only), a test passes a CPU renderer."""
    check_reference_config(cfg)
    if not 0 <= warmup < cfg.steps:
        raise ValueError(f"warm-up of {warmup} steps: must be below the run's {cfg.steps}")
    rasterize = rasterize or GsplatRasterizer()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    store = Store.open(cfg.store, mode="r")
    scene = load_cameras(cfg, store)  # the trainer's cameras, frame, held-out split and scene scale
    max_degree = int(store.attrs["sh_degree"]) if cfg.sh_degree is None else cfg.sh_degree
    splats = load_splats(store, device)
    optimizers, decay = gsplat_optimizers(splats, cfg, scene.scene_scale)
    background = torch.tensor(cfg.background, dtype=torch.float32, device=device)
    photos = [scene.data.load_image(c).to(device) for c in scene.train]  # [H, W, 3] each
    schedule = Schedule(cfg.seed, len(scene.train), 1, look_features(scene.train, scene.scene_scale),
                        cfg.locality_window)
    order = [int(schedule.cameras(step)[0]) for step in range(cfg.steps)]  # ahead: no numpy in the timed loop
    initial = held_out_psnr(splats, scene, cfg, max_degree, background, rasterize, device)
    lrs: list[dict[str, float]] = []
    start = time.perf_counter()
    for step, i in enumerate(order):
        if step == warmup:
            _sync(device)
            start = time.perf_counter()
        degree = min(step // cfg.sh_degree_interval, max_degree)
        rgb = rasterize(splats, scene.train[i], degree, background)
        photometric_loss(rgb, photos[i], cfg.optim.ssim_lambda).backward()  # no PSNR: on CUDA it would sync
        lrs.append({name: opt.param_groups[0]["lr"] for name, opt in optimizers.items()})
        for opt in optimizers.values():
            opt.step()
            opt.zero_grad(set_to_none=True)
        decay.step()
    _sync(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) / MiB if device.type == "cuda" else float("nan")
    final = held_out_psnr(splats, scene, cfg, max_degree, background, rasterize, device)
    trained = {name: p.detach().cpu() for name, p in splats.items()}
    return ReferenceRun(cfg.steps, cfg.steps - warmup, seconds, final, initial, peak, trained, lrs, order)


# ---- the scenes ----

@dataclass(frozen=True)
class BenchScene:
    """A scene ready to train: its dataset and its tiled store."""

    name: str
    data: Path  # the dataset (a writable copy: the trainer caches downscaled photos beside it)
    store: Path  # the pristine tiled store; each trainer run trains a fresh copy
    data_factor: int


class Deadline:
    """The bench's budget of wall time: a child process may take what is left of it and is
    stopped past that, so a bench on lent GPU time fails saying where, rather than being cut off."""

    def __init__(self, budget: float) -> None:
        self.budget, self.end = budget, time.perf_counter() + budget

    def left(self, what: str) -> float:
        """Seconds left for `what`; a BenchError when there are none."""
        left = self.end - time.perf_counter()
        if left < 1.0:
            raise BenchError(f"the --budget of {self.budget:g} s was spent before {what} (pass fewer --steps or "
                             "--paged-steps, fewer --scenes, or a larger --budget)")
        return left


def city_scene(work: Path, gaussians: float, cameras: int, deadline: Deadline) -> BenchScene:
    data = work / f"city-{gaussians:g}"
    if not (data / "transforms.json").is_file():
        run_child(python_module("tools.make_scene", "city", data, "--gaussians", f"{gaussians:g}", "--cameras",
                                str(cameras), "--point-fraction", "1", "--overwrite", "--clean"),
                  f"tools.make_scene city {gaussians:g}", timeout=deadline.left("generating the city"))
    store = tile(data, work / f"city-{gaussians:g}-{CITY_BLOCK}.zarr", CITY_BLOCK, "--sh-degree", "3",
                 timeout=deadline.left("tiling the city"))
    warm_images(data, 1)
    return BenchScene("city", data, store, 1)


def lund_scene(work: Path, data_root: Path, data_factor: int, deadline: Deadline | None = None) -> BenchScene:
    data = copy_dataset(data_root / "lund_door", work / "lund_door")
    store = tile(data, work / f"lund_door-{LUND_BLOCK}.zarr", LUND_BLOCK,
                 timeout=deadline.left("tiling lund_door") if deadline else None)
    warm_images(data, data_factor)
    return BenchScene("lund", data, store, data_factor)


# ---- one scene's three runs ----

@dataclass(frozen=True)
class BenchConfig:
    """What every scene's runs share (the command's flags)."""

    steps: int = 300  # training steps of the reference and of ours
    # Steps of the paged run (and of ours it is compared with): a city step in waves pages
    # most of the city twice, and the bench must fit a lent GPU's 15 minutes.
    paged_steps: int = 40
    warmup: int = 10  # first steps left out of every timing
    seed: int = 0
    budget: float = 450.0  # seconds of wall time for the whole bench (preflight, scenes and runs)


@dataclass
class SceneResult:
    """One scene's three runs and what the report says about the scene."""

    scene: BenchScene
    gaussians: int
    blocks: int
    state_bytes: int
    train_views: int
    test_views: int
    image: tuple[int, int]  # width, height of the training photos
    whole_mb: float  # --cache-mb of run 2
    paged_mb: float  # --cache-mb of run 3
    reference: ReferenceRun
    ours: TrainRun
    paged: TrainRun


def trainer_flags(scene: BenchScene, cfg: BenchConfig) -> list[str]:
    """The settings every run shares (the reference parses the same line): one camera a step, no
    densification, torch Adam's semantics, no commit or evaluation inside the timed steps."""
    return ["--data-factor", str(scene.data_factor), "--seed", str(cfg.seed), "--adam", "dense", "--strategy", "none",
            "--device", "cuda", "--commit-every", str(cfg.steps), "--eval-every", "0"]


def run_scene(scene: BenchScene, work: Path, cfg: BenchConfig, deadline: Deadline) -> SceneResult:
    size = store_size(scene.store)
    flags = trainer_flags(scene, cfg)
    ref_cfg = parse_config(["--data", str(scene.data), "--store", str(scene.store), "--steps", str(cfg.steps), *flags])
    device = torch.device("cuda")
    deadline.left(f"the reference run on {scene.name}")  # in this process: it cannot be stopped, only not started
    reference = reference_train(ref_cfg, device, cfg.warmup)
    torch.cuda.empty_cache()  # the trainer's children get the device's memory back
    # The device tier holds every block and a step's working memory (about as much again: each
    # row's gathered copy, its gradients and its projection), the rasterizer's buffers beside.
    whole_mb = 2.5 * size.nbytes / MiB + 256
    paged_mb = 0.25 * size.nbytes / MiB
    ours = train(scene.data, scene.store, work / f"ours-{scene.name}", cfg.steps, *flags,
                 "--cache-mb", f"{whole_mb:.3f}", timeout=deadline.left(f"our run on {scene.name}"))
    paged = train(scene.data, scene.store, work / f"paged-{scene.name}", cfg.steps, *flags,
                  "--cache-mb", f"{paged_mb:.3f}", "--stop-at", str(cfg.paged_steps),
                  timeout=deadline.left(f"our paged run on {scene.name}"))
    store = Store.open(scene.store, mode="r")
    cams = load_cameras(ref_cfg, store)
    return SceneResult(scene, size.gaussians, size.blocks, size.nbytes, len(cams.train), len(cams.test),
                       (cams.train[0].width, cams.train[0].height), whole_mb, paged_mb, reference, ours, paged)


# ---- the report ----

def _mean_field(run: TrainRun, name: str, warmup: int, last: int | None = None) -> float:
    lines = run.ranks[0][warmup:last]
    return float(np.mean([ln[name] for ln in lines])) if lines else float("nan")


def _peak_gpu(run: TrainRun) -> float:
    return max((ln.get("peak_gpu_mib", float("nan")) for ln in run.ranks[0]), default=float("nan"))


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def report(r: SceneResult, cfg: BenchConfig) -> None:
    ref, ours, paged, w = r.reference, r.ours, r.paged, cfg.warmup
    ours_s = ours.loop_seconds(w)  # [steps - warmup]
    paged_s = paged.loop_seconds(w)  # [paged_steps - warmup]
    ours_early = ours_s[:len(paged_s)]  # the same steps as the paged run's
    ref_sps, ours_sps = ref.steps_per_second, 1.0 / float(ours_s.mean())
    ours_psnr, paged_psnr = ours.summary["test_psnr"], paged.summary["test_psnr"]
    print(f"\n[{r.scene.name}] {r.gaussians:,} Gaussians in {r.blocks} blocks, state {r.state_bytes / MiB:.1f} MiB; "
          f"{r.train_views} training / {r.test_views} held-out views at {r.image[0]}x{r.image[1]} "
          f"(--data-factor {r.scene.data_factor}); {cfg.steps} steps ({cfg.paged_steps} paged), seed {cfg.seed}, "
          f"the first {w} left out of the timings")
    print(f"{'':30s} {'reference':>12s} {'ours':>12s} {'ours paged':>12s}")
    rows = [("--cache-mb", float("nan"), r.whole_mb, r.paged_mb, "{:.1f}"),
            ("steps/s", ref_sps, ours_sps, 1.0 / float(paged_s.mean()), "{:.2f}"),
            ("ms/step, mean", 1e3 / ref_sps, 1e3 * ours_s.mean(), 1e3 * paged_s.mean(), "{:.2f}"),
            ("ms/step, median", float("nan"), 1e3 * np.median(ours_s), 1e3 * np.median(paged_s), "{:.2f}"),
            (f"ms/step, steps {w + 1}-{cfg.paged_steps}", float("nan"), 1e3 * ours_early.mean(), 1e3 * paged_s.mean(),
             "{:.2f}"),
            ("held-out PSNR (initial)", ref.initial_psnr, float("nan"), float("nan"), "{:.4f}"),
            ("held-out PSNR (end of run)", ref.psnr, ours_psnr, paged_psnr, "{:.4f}"),
            ("peak GPU MiB", ref.peak_gpu_mib, _peak_gpu(ours), _peak_gpu(paged), "{:.1f}"),
            ("peak RSS MiB (trainer)", float("nan"), ours.max_rss / MiB, paged.max_rss / MiB, "{:.1f}"),
            ("cache hit rate", float("nan"), ours.summary["cache_hit_rate"], paged.summary["cache_hit_rate"], "{:.3f}"),
            ("MiB read from the store", float("nan"), ours.summary["bytes_read"] / MiB,
             paged.summary["bytes_read"] / MiB, "{:.1f}")]
    for label, a, b, c, fmt in rows:
        cells = ["-" if np.isnan(x) else fmt.format(x) for x in (a, b, c)]
        print(f"{label:30s} {cells[0]:>12s} {cells[1]:>12s} {cells[2]:>12s}")
    print("ours' phases, ms/step (host wall time; asynchronous kernels count where the device is next waited on):")
    phases = sorted({k for ln in ours.ranks[0] for k in ln if k.startswith("t_")})
    for label, run, last in (("ours", ours, None), ("ours paged", paged, None)):
        parts = {k[2:]: 1e3 * _mean_field(run, k, w, last) for k in phases}
        rest = 1e3 * float(run.loop_seconds(w).mean()) - sum(parts.values())
        print(f"  {label:12s} " + " ".join(f"{k} {v:.2f}" for k, v in parts.items())
              + f" | rest of the loop {rest:.2f}")
    speed = ours_sps / ref_sps
    dpsnr = ours_psnr - ref.psnr
    slowdown = float(paged_s.mean() / ours_early.mean())
    print(f"{'target':44s} {'measured':>12s} {'target':>12s}")
    for label, value, target, ok in (
            ("ours / reference steps/s", f"{speed:.3f}x", f">= {SPEED_TARGET:.2f}x", speed >= SPEED_TARGET),
            ("ours - reference held-out PSNR", f"{dpsnr:+.4f} dB", f"<= {PSNR_TARGET:.2f} dB",
             abs(dpsnr) <= PSNR_TARGET),
            (f"paged / whole s/step (steps {w + 1}-{cfg.paged_steps})", f"{slowdown:.3f}x", f"<= {PAGED_TARGET:.2f}x",
             slowdown <= PAGED_TARGET)):
        print(f"{label:44s} {value:>12s} {target:>12s}  {verdict(ok)}")


# ---- the command ----

def gsplat_smoke() -> None:
    """One small render and backward through gsplat's CUDA kernels; raises unless the image has
    colour and the gradients are finite. `preflight` runs it in a child process."""
    device = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    n = 64
    splats = {"means": torch.randn(n, 3, generator=g) * 0.3 + torch.tensor([0.0, 0.0, 3.0]),
              "scales": torch.full((n, 3), -3.0), "quats": torch.randn(n, 4, generator=g),
              "opacities": torch.zeros(n), "sh0": torch.rand(n, 1, 3, generator=g), "shN": torch.zeros(n, 15, 3)}
    splats = {k: v.to(device).requires_grad_(True) for k, v in splats.items()}
    cam = Camera(np.eye(4), np.array([[64.0, 0, 32], [0, 64.0, 32], [0, 0, 1]]), 64, 64, name="smoke")
    rgb = GsplatRasterizer()(splats, cam, 3, torch.zeros(3, device=device))  # [64, 64, 3]
    rgb.sum().backward()
    if not bool(torch.isfinite(splats["means"].grad).all()) or float(rgb.sum()) <= 0.0:
        raise RuntimeError("error: gsplat's test render came out empty or with non-finite gradients")


def preflight(deadline: Deadline) -> None:
    """Before any timing: numba's CPU kernels in its disk cache (the trainer's statistics and
    checks use some), then gsplat's CUDA kernels built and working, each timed, so a first-run
    compile is seen for what it is. The gsplat check runs in a child process: a JIT build of its
    extension (minutes, where the install has none built) can then be stopped at the budget, and
    the build it leaves on disk serves this process and the trainer's."""
    from train.render.cpu.compiled import ensure_compiled

    start = time.perf_counter()
    ensure_compiled()
    print(f"numba kernels ready in {time.perf_counter() - start:.1f} s")
    start = time.perf_counter()
    run_child([sys.executable, "-c", "from tools.bench.gpu import gsplat_smoke; gsplat_smoke()"],
              "gsplat's CUDA kernels (a test render)", timeout=deadline.left("checking gsplat's CUDA kernels"))
    print(f"gsplat kernels ready in {time.perf_counter() - start:.1f} s")


def _scenes(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in SCENES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated subset of {','.join(SCENES)}")
    return list(dict.fromkeys(names))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.bench gpu", formatter_class=HelpFormatter,
                                description=__doc__.split("\n\n")[0])
    d = BenchConfig()
    p.add_argument("--scenes", type=_scenes, default=",".join(SCENES),
                   help="which scenes, comma-separated, run in this order (the small one first: its table is "
                   "printed even if the city overruns --budget)")
    p.add_argument("--steps", type=int, default=d.steps, help="training steps of the reference and of ours")
    p.add_argument("--paged-steps", type=int,
                   help=f"steps of the run with a quarter of the state on the device (default: {d.paged_steps}, "
                   "or --steps if fewer)")
    p.add_argument("--warmup", type=int, default=d.warmup, help="first steps left out of every timing")
    p.add_argument("--seed", type=int, default=d.seed, help="the camera schedule's seed")
    p.add_argument("--gaussians", type=float, default=1e6, help="city: Gaussians of the generated city (and its store)")
    p.add_argument("--cameras", type=int, default=64, help="city: cameras of the generated city")
    p.add_argument("--data-factor", type=int, default=2, help="lund: image downscale factor")
    p.add_argument("--data", type=Path, default=data_dir(), help="the shared data folder (lund_door)")
    p.add_argument("--budget", type=float, default=d.budget,
                   help="seconds of wall time for the whole bench: a child process (scene generation, tiling, a "
                   "training run) still running when it is spent is stopped and the bench fails")
    p.add_argument("--work", type=Path, help="keep the scenes, stores and runs here (default: a temporary folder)")
    return p


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, BenchConfig]:
    p = _parser()
    a = p.parse_args(argv)
    if a.paged_steps is None:
        a.paged_steps = min(BenchConfig.paged_steps, a.steps)
    for name in ("steps", "paged_steps", "cameras", "data_factor"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(a, name)}: must be at least 1")
    if a.warmup < 0:
        p.error(f"--warmup {a.warmup}: must be at least 0")
    if a.paged_steps > a.steps:
        p.error(f"--paged-steps {a.paged_steps}: at most --steps ({a.steps})")
    if a.warmup + 2 > a.paged_steps:
        p.error(f"--warmup {a.warmup}: leaves fewer than 2 timed steps of --paged-steps {a.paged_steps}")
    if not 1e3 <= a.gaussians <= 1e8:
        p.error(f"--gaussians {a.gaussians:g}: between 1e3 and 1e8")
    if not (np.isfinite(a.budget) and a.budget > 0):
        p.error(f"--budget {a.budget:g}: must be a positive number of seconds")
    return a, BenchConfig(a.steps, a.paged_steps, a.warmup, a.seed, a.budget)


def main(argv: list[str]) -> int:
    a, cfg = parse_args(argv)
    if not torch.cuda.is_available():
        print("error: python -m tools.bench gpu needs a CUDA device (torch.cuda.is_available() is False: no GPU, "
              "or a torch built without CUDA); nothing was run", file=sys.stderr)
        return 2
    if "lund" in a.scenes and not (a.data / "lund_door").is_dir():
        print(f"error: {a.data}: no lund_door folder (pass --data, or --scenes city)", file=sys.stderr)
        return 2
    sys.stdout.reconfigure(line_buffering=True)  # a run cut off from outside still shows its tables so far
    deadline, device = Deadline(cfg.budget), torch.device("cuda")
    with scratch(a.work) as work:
        try:
            import gsplat

            print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, gsplat {gsplat.__version__}; "
                  f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; budget {cfg.budget:g} s")
            preflight(deadline)
            for name in a.scenes:
                t0 = time.perf_counter()
                scene = (city_scene(work, a.gaussians, a.cameras, deadline) if name == "city"
                         else lund_scene(work, a.data, a.data_factor, deadline))
                print(f"\n{name}: scene and store ready in {time.perf_counter() - t0:.1f} s")
                t0 = time.perf_counter()
                report(run_scene(scene, work, cfg, deadline), cfg)
                print(f"{name}: the three runs took {time.perf_counter() - t0:.1f} s")
        except BenchError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        except (ImportError, ConfigError, DatasetError, StoreError, RenderError, OSError, RuntimeError) as e:
            print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
    print(f"\ntotal {cfg.budget - (deadline.end - time.perf_counter()):.0f} s of the {cfg.budget:g} s budget")
    return 0
