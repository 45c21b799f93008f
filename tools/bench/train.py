"""`python -m tools.bench train [overhead] [memory] [quality] [--quick]`: what training out of core costs.

Every figure comes from real trainer runs (`python -m train`, one child process each) on stores that
`python -m tools.tile` makes in a scratch folder; each run trains a fresh copy of its store.

overhead: seconds per step with the block cache at 25% of the scene's bytes against a cache that
    holds the whole scene: same store, seed and schedule, the two runs alternated in one bench run.
    The scene is a grid of copies of the `tools.make_scene wall` facade (see `wall_grid`), so a
    camera sees a few per cent of it and a step's random camera usually stands at a wall the cache
    does not hold: the small cache pages (and writes back trained blocks) every few steps. A step's time is
    the gap between consecutive metrics lines (`--log-every 1`): the whole loop, prefetch, write-back
    and image loading included; the warm-up steps (numba's cache, first page-ins) are left out.
memory: peak RSS of the trainer (the kernel's ru_maxrss of that child, from wait4) with `--cache-mb B`
    on scenes of about 1, 4 and 16 B. The scenes grow by more walls in the grid, not by denser ones:
    a camera's view stays the same size, so one step's blocks fit in B whatever the scene. What is
    not the cache (RSS - B: Python, torch, numba, zarr, images, one step's working set) must not
    grow with the scene.
quality: held-out PSNR / SSIM and seconds per step on lund_door (a copy: the trainer writes its
    downscaled photos next to the originals) after a fixed number of steps, against a dense
    in-memory reference run in this process: every Gaussian in memory, one `torch.optim.Adam` per
    parameter with gsplat simple_trainer's learning rates (means decaying to 1% over the run, SH
    degree up by one every 1000 steps), no densification (the trainer has none yet), the same
    renderer, loss, camera schedule and held-out views. It checks what the out-of-core machinery
    (blocks, cache, sparse per-row Adam) does to the result; it is not an independent renderer.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from storage import Store, StoreError
from storage.schema import bytes_per_gaussian
from tools.bench import data_dir
from tools.scenes import make_wall, wall_grid, wall_points
from train.cli import HelpFormatter
from train.config import TrainConfig
from train.data import DataConfig, load_scene
from train.losses import photometric_loss, psnr, ssim
from train.render import render
from train.schedule import Schedule
from train.trainer import load_cameras, look_features

REPO = Path(__file__).resolve().parents[2]
DEFAULT_DATA = data_dir()
MPIRUN = Path(sys.executable).parent / "mpirun"
SECTIONS = ("overhead", "memory", "quality")
MiB = 2**20
OVERHEAD_TARGET = 1.10
# gsplat simple_trainer's Adam learning rates at batch size 1 (means: times the scene scale).
GSPLAT_LR = {"means": 1.6e-4, "scales": 5e-3, "quats": 1e-3, "opacities": 5e-2, "sh0": 2.5e-3, "shN": 2.5e-3 / 20}
SH_DEGREE_INTERVAL = 1000  # gsplat's default, and the trainer's


class BenchError(RuntimeError):
    """A child process failed or left no result; the message names it and quotes its error."""


# ---- child processes ----

@dataclass
class Child:
    seconds: float  # wall clock
    max_rss: int  # bytes: peak resident set of the child (and of the descendants it waited for)


def run_child(args: Sequence[str | os.PathLike], what: str, env: dict[str, str] | None = None,
              timeout: float | None = None) -> Child:
    """Run a command from the repository root; its own rusage comes from wait4, so each child's
    peak RSS is its own, not the maximum over every child so far (as RUSAGE_CHILDREN would be).
    `timeout` (seconds): the child is killed past it and the run fails, so a bench with a fixed
    budget of machine time fails early and says which run overran rather than being cut off."""
    killed = threading.Event()
    with tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        try:
            proc = subprocess.Popen([os.fspath(a) for a in args], cwd=REPO, stdout=subprocess.DEVNULL, stderr=err,
                                    env={**os.environ, **(env or {})})
        except OSError as e:
            raise BenchError(f"{what}: cannot start {os.fspath(args[0])}: {e.strerror}") from None
        timer = threading.Timer(timeout, lambda: (killed.set(), proc.kill())) if timeout else None
        if timer is not None:
            timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            if timer is not None:
                timer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
        seconds = time.perf_counter() - start
        err.seek(0)
        stderr = err.read().decode(errors="replace")
    if killed.is_set():
        raise BenchError(f"{what} ran past its {timeout:g} s limit and was stopped")
    if proc.returncode != 0:
        lines = [ln for ln in stderr.splitlines() if ln.strip()]
        errors = [ln for ln in lines if "error" in ln.lower()] or lines
        raise BenchError(f"{what} failed (exit {proc.returncode}): " + " | ".join(errors[-3:]))
    return Child(seconds, usage.ru_maxrss * 1024)


def python_module(module: str, *args: str | os.PathLike) -> list[str | os.PathLike]:
    return [sys.executable, "-m", module, *args]


@contextlib.contextmanager
def scratch(keep: Path | None) -> Iterator[Path]:
    """A work folder: `keep` (created, left in place) or a temporary one (removed afterwards)."""
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        yield keep
        return
    with tempfile.TemporaryDirectory(prefix="octosplat-bench-") as tmp:
        yield Path(tmp)


# ---- scenes and stores ----

def copy_dataset(src: Path, out: Path) -> Path:
    """A writable copy (the shared data is read-only, and the trainer caches downscaled photos beside them)."""
    if not out.exists():
        shutil.copytree(src, out, copy_function=shutil.copyfile)
        for folder, _, _ in os.walk(out):
            os.chmod(folder, 0o755)
    return out


def tile(src: Path, store: Path, max_per_block: int, *options: str, timeout: float | None = None) -> Path:
    """A pristine store (made once per work folder), `options` passed on to `tools.tile`; training
    copies it first (see `fresh_copy`); `timeout`: as `run_child`'s."""
    if not store.exists():
        run_child(python_module("tools.tile", src, "--out", store, "--max-per-block", str(max_per_block),
                                *options, "--no-progress"), f"tools.tile {src.name}", timeout=timeout)
    return store


def fresh_copy(store: Path, out: Path) -> Path:
    """Training commits into its store, so every run gets its own copy of the pristine one. The
    copy is hard links: a store never writes into a committed file (a commit writes new version
    folders and renames its documents), so the pristine store stays as it was, and a 30 GB city
    costs neither a second 30 GB of disk nor minutes of copying."""
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(store, out, copy_function=_link_or_copy)
    return out


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system, or one without links
        shutil.copy2(src, dst)


@dataclass(frozen=True)
class StoreSize:
    gaussians: int
    blocks: int
    nbytes: int  # what the block cache counts: Gaussians x bytes_per_gaussian(sh_degree)


def store_size(store: Path) -> StoreSize:
    try:
        s = Store.open(store, mode="r", verify="table")
    except StoreError as e:  # e.g. a store an older OctoSplat left in --work
        raise BenchError(f"{e} (remove it, or pass another --work)") from e
    n = sum(info.count for info in s.table.values())
    return StoreSize(n, len(s.table), n * bytes_per_gaussian(s.sh_degree))


def warm_images(data: Path, data_factor: int) -> None:
    """Make the trainer's downscaled copies of the photos now, so no timed run pays for them."""
    scene = load_scene(str(data), DataConfig(data_factor=data_factor, normalize=False))
    for camera in scene.train_cameras + scene.test_cameras:
        scene.load_image(camera)


# ---- trainer runs ----

@dataclass
class TrainRun:
    summary: dict  # the trainer's summary.json
    ranks: list[list[dict]]  # per rank: its "train" metrics lines, one per step
    max_rss: int  # bytes (the largest process of the run)
    seconds: float  # wall clock of the whole run, start-up included

    def loop_seconds(self, warmup: int) -> np.ndarray:  # [steps - warmup]
        """Seconds per step after `warmup` steps: gaps between rank 0's consecutive metrics lines."""
        times = np.array([r["time"] for r in self.ranks[0]])
        return np.diff(times)[max(warmup, 1) - 1:]

    def column(self, name: str, warmup: int) -> np.ndarray:  # [R, steps - warmup]
        return np.array([[r[name] for r in lines[warmup:]] for lines in self.ranks], dtype=np.float64)


def train(data: Path, store: Path, out: Path, steps: int, *options: str, ranks: int = 0,
          keep_store: bool = False, timeout: float | None = None) -> TrainRun:
    """`python -m train` on a fresh copy of `store` (OUT.zarr, removed afterwards unless
    keep_store), a metrics line every step; ranks > 0: under `mpirun -n ranks`, one thread per
    rank (also with one rank, so ranks are the only parallelism); `timeout`: as `run_child`'s."""
    shutil.rmtree(out, ignore_errors=True)
    work = fresh_copy(store, out.with_name(out.name + ".zarr"))
    args = python_module("train", "--data", data, "--store", work, "--out", out, "--steps", str(steps),
                         "--log-every", "1", "--no-progress", *options)
    env = None
    if ranks:
        args = [MPIRUN, "-n", str(ranks), *args]
        env = {"OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"}
    # The copy, and the previous run's commit, are dirty pages the kernel would write back during
    # this run, competing with it for the disk and the two cores: write them out before timing.
    os.sync()
    child = run_child(args, f"python -m train ({out.name})", env, timeout)
    files = [out / "metrics.jsonl"] if ranks <= 1 else [out / f"metrics.rank{r}.jsonl" for r in range(ranks)]
    try:
        summary = json.loads((out / "summary.json").read_text())
        lines = [[json.loads(ln) for ln in f.read_text().splitlines()] for f in files]
    except (OSError, ValueError) as e:
        raise BenchError(f"python -m train ({out.name}) left no readable summary or metrics: {e}") from None
    if not keep_store:
        shutil.rmtree(work)
    return TrainRun(summary, [[r for r in ls if r["kind"] == "train"] for ls in lines], child.max_rss, child.seconds)


def ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}x" if b else "n/a"


def run_means(runs: list[TrainRun], warmup: int) -> str:
    """Each run's mean seconds per step: how far other load on the machine moved them."""
    return " ".join(f"{r.loop_seconds(warmup).mean():.3f}" for r in runs)


# ---- overhead ----

@dataclass(frozen=True)
class OverheadConfig:
    """The out-of-core overhead run (see the module docstring)."""

    wall: tuple[str, ...] = ()  # `tools.make_scene wall` options of one wall of the grid
    copies: int = 4  # walls in the grid: a 25% cache holds about one wall
    steps: int = 60  # training steps of each run
    warmup: int = 10  # first steps left out of the timings
    repeats: int = 4  # in-memory / out-of-core pairs, alternated (runs of one config differ by up to 20%)
    max_per_block: int = 2048  # small enough that one step's blocks fit in the small cache
    cache_share: float = 0.25  # the small cache, as a share of the scene's bytes


def overhead(work: Path, cfg: OverheadConfig) -> None:
    base = make_wall(work, cfg.wall)
    data = wall_grid(base, work / f"{base.name}-x{cfg.copies}", cfg.copies)
    store = tile(data, work / f"{data.name}-{cfg.max_per_block}.zarr", cfg.max_per_block)
    size = store_size(store)
    caches = {"in memory": 2.0 * size.nbytes / MiB, "out of core": cfg.cache_share * size.nbytes / MiB}
    print(f"\n[overhead] a grid of {cfg.copies} walls: {size.gaussians:,} Gaussians in {size.blocks} blocks, "
          f"{size.nbytes / MiB:.1f} MiB; {cfg.steps} steps, batch 1, the first {cfg.warmup} left out; "
          f"{cfg.repeats} alternated pair(s) of runs")
    runs: dict[str, list[TrainRun]] = {name: [] for name in caches}
    for rep in range(cfg.repeats):
        for name, mb in caches.items():
            runs[name].append(train(data, store, work / f"overhead-{name.replace(' ', '-')}-{rep}", cfg.steps,
                                    "--cache-mb", f"{mb:.3f}", "--max-eval-images", "2"))
    step = {name: np.concatenate([r.loop_seconds(cfg.warmup) for r in rs]) for name, rs in runs.items()}
    inner = {name: np.concatenate([r.column("seconds", cfg.warmup)[0] for r in rs]) for name, rs in runs.items()}
    ours, ref = "out of core", "in memory"
    print(f"{'':34s} {'ours: 25% cache':>16s} {'ref: whole scene':>17s} {'ratio':>8s}")
    rows = [("cache MiB", caches[ours], caches[ref], "{:.1f}"),
            ("s/step, mean (whole loop)", step[ours].mean(), step[ref].mean(), "{:.4f}"),
            ("s/step, median (whole loop)", float(np.median(step[ours])), float(np.median(step[ref])), "{:.4f}"),
            ("s/step, mean (train_step only)", inner[ours].mean(), inner[ref].mean(), "{:.4f}")]
    for label, a, b, fmt in rows:
        print(f"{label:34s} {fmt.format(a):>16s} {fmt.format(b):>17s} {ratio(a, b):>8s}")
    for label, key, fmt in (("cache hit rate", "cache_hit_rate", "{:.3f}"), ("MiB read", "bytes_read", "{:.1f}"),
                            ("MiB written", "bytes_written", "{:.1f}"), ("I/O wait s", "io_wait_s", "{:.2f}"),
                            ("held-out PSNR", "test_psnr", "{:.4f}")):
        scale = MiB if key.startswith("bytes") else 1
        a, b = (np.mean([r.summary[key] / scale for r in runs[n]]) for n in (ours, ref))
        print(f"{label:34s} {fmt.format(a):>16s} {fmt.format(b):>17s}")
    print(f"{'s/step, mean of each run':34s} {run_means(runs[ours], cfg.warmup):>16s} {run_means(runs[ref], cfg.warmup):>17s}")
    same = {r.summary["test_psnr"] for rs in runs.values() for r in rs}
    print(f"same parameters with either cache (held-out PSNR identical): {'yes' if len(same) == 1 else 'NO'}")
    result = step[ours].mean() / step[ref].mean()
    print(f"out-of-core overhead {result:.3f}x (target <= {OVERHEAD_TARGET:.2f}x): "
          f"{'met' if result <= OVERHEAD_TARGET else 'MISSED'}")


# ---- memory ----

@dataclass(frozen=True)
class MemoryConfig:
    """The peak-RSS runs (see the module docstring)."""

    wall: tuple[str, ...] = ()  # `tools.make_scene wall` options of one wall of the grid
    cache_mb: float = 32.0  # B, the --cache-mb of every run
    scales: tuple[int, ...] = (1, 4, 16)  # scene sizes in units of B
    steps: int = 40  # enough for the cache to fill and evict on every scene but the smallest
    max_per_block: int = 8192  # large blocks tile faster; one step's still fit in B


def memory(work: Path, cfg: MemoryConfig) -> None:
    base = make_wall(work, cfg.wall)
    wall_bytes = wall_points(base) * bytes_per_gaussian(3)  # the tiler's default SH degree for points
    print(f"\n[memory] --cache-mb {cfg.cache_mb:g} (B); scenes of about {', '.join(f'{s}' for s in cfg.scales)} B "
          f"as grids of walls ({wall_bytes / MiB:.2f} MiB each); {cfg.steps} steps, batch 1")
    imports = run_child(python_module("train", "--help"), "python -m train --help").max_rss
    print(f"{'scene':>6s} {'walls':>6s} {'Gaussians':>10s} {'blocks':>7s} {'MiB':>8s} {'x B':>6s} | "
          f"{'peak RSS MiB':>12s} {'RSS - B':>8s} {'vs 1st':>8s} {'hit rate':>9s} {'MiB read':>9s} {'s/step':>7s}")
    scenes = []
    for scale in cfg.scales:
        copies = max(1, round(scale * cfg.cache_mb * MiB / wall_bytes))
        data = wall_grid(base, work / f"{base.name}-x{copies}", copies)
        scenes.append((scale, copies, data, tile(data, work / f"{data.name}-{cfg.max_per_block}.zarr", cfg.max_per_block)))
    options = ("--cache-mb", f"{cfg.cache_mb:g}", "--max-eval-images", "1")
    # A first run may compile numba kernels (when their sources changed), and LLVM's memory is no
    # part of what training needs: this run fills the cache and is not counted.
    warm = train(*scenes[0][2:], work / "memory-warmup", 2, *options)
    over = []
    for scale, copies, data, store in scenes:
        size = store_size(store)
        run = train(data, store, work / f"memory-{scale}", cfg.steps, *options)
        rss = run.max_rss / MiB
        over.append(rss - cfg.cache_mb)
        print(f"{scale:>5d}B {copies:>6d} {size.gaussians:>10,d} {size.blocks:>7d} {size.nbytes / MiB:>8.1f} "
              f"{size.nbytes / MiB / cfg.cache_mb:>6.2f} | {rss:>12.1f} {over[-1]:>8.1f} {over[-1] / over[0]:>7.3f}x "
              f"{run.summary['cache_hit_rate']:>9.3f} {run.summary['bytes_read'] / MiB:>9.1f} "
              f"{run.loop_seconds(1).mean():>7.3f}")
    fixed = max(over)
    print(f"fixed overhead (largest RSS - B): {fixed:.0f} MiB, of which {imports / MiB:.0f} MiB is the interpreter "
          f"with the trainer's imports (`python -m train --help`); peak RSS <= B + {fixed:.0f} MiB on every scene "
          f"(a 2-step warm-up run before them: {warm.max_rss / MiB:.0f} MiB)")
    growth = over[-1] / over[0]
    print(f"RSS - B on the {cfg.scales[-1]} B scene over the {cfg.scales[0]} B scene: {growth:.3f}x "
          f"({'flat' if growth <= 1.1 else 'GROWS with the scene'})")


# ---- quality ----

@dataclass(frozen=True)
class QualityConfig:
    """The lund_door run and its dense reference (see the module docstring)."""

    steps: int = 500  # training steps of both
    data_factor: int = 8  # image downscale factor (162 x 242)
    warmup: int = 10  # first steps left out of seconds per step
    max_per_block: int = 2048  # several blocks, so paging and per-block Adam take part
    seed: int = 0  # the camera schedule's seed


@dataclass
class Quality:
    """Mean over the held-out views, and mean seconds per training step (nan: not measured)."""

    psnr: float
    ssim: float
    seconds_per_step: float


def dense_reference(data: Path, store_path: Path, cfg: QualityConfig) -> tuple[Quality, Quality]:
    """(initial, trained): the store's Gaussians trained all in memory with dense Adam (module docstring)."""
    store = Store.open(store_path, mode="r")
    scene = load_cameras(TrainConfig(data=str(data), store=str(store_path), data_factor=cfg.data_factor), store)
    blocks = [store.read_params(key) for key in store.table]
    splats = {name: torch.from_numpy(np.concatenate([b[name] for b in blocks])).requires_grad_(True)
              for name in blocks[0]}
    optimizers = {name: torch.optim.Adam([p], lr=GSPLAT_LR[name] * (scene.scene_scale if name == "means" else 1.0),
                                         eps=1e-15) for name, p in splats.items()}
    decay = torch.optim.lr_scheduler.ExponentialLR(optimizers["means"], gamma=0.01 ** (1.0 / cfg.steps))
    background = torch.zeros(3)
    photos = {c.name: scene.data.load_image(c) for c in scene.train + scene.test}

    @torch.no_grad()
    def held_out(seconds_per_step: float) -> Quality:
        p = s = 0.0
        for cam in scene.test:
            rgb, _, _ = render(splats, cam, store.sh_degree, background)
            p += psnr(rgb, photos[cam.name])
            s += float(ssim(rgb.clamp(0, 1), photos[cam.name]))
        return Quality(p / len(scene.test), s / len(scene.test), seconds_per_step)

    initial = held_out(float("nan"))
    times = []
    defaults = TrainConfig()
    schedule = Schedule(cfg.seed, len(scene.train), 1, look_features(scene.train, scene.scene_scale),
                        defaults.locality_window)  # the trainer's schedule
    for step in range(cfg.steps):
        cam = scene.train[int(schedule.cameras(step)[0])]
        start = time.perf_counter()
        rgb, _, _ = render(splats, cam, min(step // SH_DEGREE_INTERVAL, store.sh_degree), background)
        photometric_loss(rgb, photos[cam.name]).backward()
        for opt in optimizers.values():
            opt.step()
            opt.zero_grad(set_to_none=True)
        decay.step()
        times.append(time.perf_counter() - start)
    return initial, held_out(float(np.mean(times[cfg.warmup:])))


def quality(work: Path, data_root: Path, cfg: QualityConfig) -> None:
    data = copy_dataset(data_root / "lund_door", work / "lund_door")
    store = tile(data, work / f"lund_door-{cfg.max_per_block}.zarr", cfg.max_per_block)
    warm_images(data, cfg.data_factor)
    size = store_size(store)
    run = train(data, store, work / "quality", cfg.steps, "--data-factor", str(cfg.data_factor),
                "--seed", str(cfg.seed))
    ours = Quality(run.summary["test_psnr"], run.summary["test_ssim"], float(run.loop_seconds(cfg.warmup).mean()))
    start = time.perf_counter()
    initial, ref = dense_reference(data, store, cfg)
    ref_seconds = time.perf_counter() - start
    cam = json.loads((work / "quality" / "config.json").read_text())
    print(f"\n[quality] lund_door at --data-factor {cfg.data_factor}: {size.gaussians:,} Gaussians in {size.blocks} "
          f"blocks, {cam['train_images']} training / {cam['test_images']} held-out photos; {cfg.steps} steps, "
          f"batch 1, seed {cfg.seed}; s/step is the mean after {cfg.warmup} warm-up steps")
    print(f"{'':16s} {'ours (trainer)':>15s} {'ref: dense Adam':>16s} {'ratio':>8s} {'initial':>9s}")
    for label, a, b, c, fmt in (("held-out PSNR", ours.psnr, ref.psnr, initial.psnr, "{:.3f}"),
                                ("held-out SSIM", ours.ssim, ref.ssim, initial.ssim, "{:.4f}"),
                                ("s/step", ours.seconds_per_step, ref.seconds_per_step, float("nan"), "{:.4f}")):
        print(f"{label:16s} {fmt.format(a):>15s} {fmt.format(b):>16s} {ratio(a, b):>8s} {fmt.format(c):>9s}")
    print(f"whole run: trainer {run.seconds:.1f} s (start-up, final commit and evaluation included), "
          f"reference {ref_seconds:.1f} s (in this process, images preloaded)")


# ---- the command ----

QUICK_WALL = ("--gaussians", "10000", "--cameras", "16")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(formatter_class=HelpFormatter, prog="python -m tools.bench train",
                                description="out-of-core overhead, memory and quality of the trainer")
    p.add_argument("sections", nargs="*", metavar="SECTION", help=f"any of {', '.join(SECTIONS)} (default: all)")
    p.add_argument("--quick", action="store_true", help="small scenes and few steps (a smoke run)")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="the shared data folder (lund_door)")
    p.add_argument("--work", type=Path, help="keep datasets, stores and runs here (default: a temporary folder)")
    p.add_argument("--cache-mb", type=float, help="memory: B (default 32, --quick 4)")
    p.add_argument("--steps", type=int, help="quality: training steps (default 500, --quick 30)")
    p.add_argument("--data-factor", type=int, help="quality: image downscale factor (default 8)")
    return p


def main(argv: list[str]) -> int:
    p = _parser()
    a = p.parse_args(argv)
    sections = a.sections or list(SECTIONS)
    for name in sections:
        if name not in SECTIONS:
            p.error(f"unknown section {name!r} (choose from {', '.join(SECTIONS)})")
    for name in ("cache_mb", "steps", "data_factor"):
        if getattr(a, name) is not None and getattr(a, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if "quality" in sections and not (a.data / "lund_door").is_dir():
        print(f"error: {a.data}: no lund_door folder (pass --data)", file=sys.stderr)
        return 2
    if a.quick:
        o = OverheadConfig(wall=QUICK_WALL, steps=20, warmup=5, repeats=1, max_per_block=512)
        m = MemoryConfig(wall=QUICK_WALL, cache_mb=a.cache_mb or 4.0, steps=12, max_per_block=2048)
        q = QualityConfig(steps=a.steps or 30, data_factor=a.data_factor or 8, warmup=5)
    else:
        o = OverheadConfig()
        m = MemoryConfig(cache_mb=a.cache_mb or 32.0)
        q = QualityConfig(steps=a.steps or 500, data_factor=a.data_factor or 8)
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (other processes share them)")
    start = time.perf_counter()
    with scratch(a.work) as work:
        runs = {"overhead": lambda: overhead(work, o), "memory": lambda: memory(work, m),
                "quality": lambda: quality(work, a.data, q)}
        try:
            for section in sections:
                runs[section]()
        except BenchError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    print(f"\ntotal {time.perf_counter() - start:.0f} s, load average {os.getloadavg()[0]:.1f}")
    return 0
