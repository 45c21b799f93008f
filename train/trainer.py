"""The training loop: schedule -> step -> commit / evaluate, on one rank or as one of R MPI ranks."""
from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from storage import CacheBudgetError, Store
from storage.cache import BlockCache
from train.camera import Camera
from train.config import TrainConfig
from train.data import DataConfig, load_scene
from train.eval import evaluate
from train.exchange import Exchange, LocalExchange
from train.logs import RunLog, plot_metrics, progress_bar, write_config
from train.optim import AdamConfig, learning_rates
from train.region import Region, ownership_weights
from train.schedule import Schedule
from train.assign import assign_cameras
from octree.partition import partition
from train.step import COMPUTE_PHASES, StepStats, train_step


class TrainError(RuntimeError):
    """A run that cannot start or continue; the message says why and what to do."""


@dataclass
class Scene:
    """The dataset's cameras in the store's frame, and the scale the learning rates use."""

    train: list[Camera]
    test: list[Camera]
    data: object  # train.data.SceneData (image loading)
    scene_scale: float


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise TrainError("--device cuda asked for, but torch sees no CUDA device")
    return torch.device(name)


def default_cache_bytes() -> int:
    """A quarter of the memory still available, so the page cache and the images have room."""
    try:
        pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        pages = 8 << 30
    return int(pages // 4)


def load_cameras(cfg: TrainConfig, store: Store) -> Scene:
    """Cameras of the dataset moved into the frame the store was tiled in."""
    data = load_scene(cfg.data, DataConfig(data_factor=cfg.data_factor, test_every=cfg.test_every, normalize=False))
    # The store holds the Gaussians: the dataset's point cloud (27 MiB at 744k points) is not kept.
    data = replace(data, points=np.zeros((0, 3)), colors=np.zeros((0, 3), dtype=np.uint8))
    T = np.asarray(store.attrs.get("world_transform", np.eye(4)), dtype=np.float64)
    train = [c.transformed(T) for c in data.train_cameras]
    test = [c.transformed(T) for c in data.test_cameras]
    if not train:
        raise TrainError(f"dataset {cfg.data} has no training images")
    centers = np.stack([c.center for c in train])
    scale = float(np.linalg.norm(centers - centers.mean(0), axis=1).max() * 1.1) or 1.0
    return Scene(train, test, data, scale)


def look_features(cameras: list[Camera], scene_scale: float) -> np.ndarray:  # [N, 6]
    """Where each camera stands and where it looks, in one metric for the schedule's locality
    order: its centre, and its viewing axis (OpenCV +z) scaled by a quarter of the scene's radius."""
    return np.stack([np.concatenate([c.center, c.viewmat[2, :3] * 0.25 * scene_scale]) for c in cameras])


def check_overlap(region: Region, scene: Scene, store: Store, cfg: TrainConfig) -> None:
    """Refuse a dataset that is not the one the store was tiled from (or that sees none of it)."""
    tiled = set(store.attrs.get("source", {}).get("images", []))
    names = {c.name for c in scene.train + scene.test}
    if tiled and len(tiled & names) < 0.5 * max(len(tiled), len(names)):
        raise TrainError(
            f"{cfg.store} was tiled from a dataset with {len(tiled)} images, {len(tiled & names)} of which "
            f"{cfg.data} has: the store and the dataset do not belong together"
        )
    if not any(region.visible(c) for c in scene.train):
        raise TrainError(
            f"no training camera of {cfg.data} sees any block of {cfg.store}: "
            "the store and the dataset do not belong together (tiled from another scene?)"
        )


def owned_blocks(table: dict, rank: int, size: int, cameras: list[Camera] | None = None) -> list[str]:
    """Rank `rank`'s contiguous share of the Morton-ordered blocks, balanced by `ownership_weights`
    over the training `cameras` (by Gaussian count without cameras)."""
    everything = Region.from_table(table)
    weights = ownership_weights(everything.counts, everything.extents, cameras or [])
    bounds = partition(weights, size)
    return everything.keys[bounds[rank] : bounds[rank + 1]]


def assign_step(cams: list[Camera], region: Region, exchange: Exchange, per_rank: int) -> list[int]:
    """Each camera to the rank owning most of what it sees, exactly `per_rank` cameras a rank."""
    if exchange.size == 1:
        return [0] * len(cams)
    counts = dict(zip(region.keys, region.counts))
    mine = np.array([sum(counts[k] for k in region.visible(c)) for c in cams], dtype=np.float64)
    return assign_cameras(exchange.gather_rows(mine).T, per_rank)


class _StopFlag:
    """First Ctrl-C: finish the step, commit, stop. Second: stop now (the last commit stays intact)."""

    def __init__(self) -> None:
        self.set = False
        self._previous = signal.getsignal(signal.SIGINT)

    def __enter__(self) -> "_StopFlag":
        def handler(signum, frame):  # noqa: ARG001
            if self.set:
                raise KeyboardInterrupt
            self.set = True

        signal.signal(signal.SIGINT, handler)
        return self

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self._previous)


def run(cfg: TrainConfig, exchange: Exchange | None = None) -> dict:
    """Train; returns the summary dict that is also printed and written as summary.json."""
    exchange = exchange or LocalExchange()
    rank, size = exchange.rank, exchange.size
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True)
    torch.manual_seed(cfg.seed)
    device = resolve_device(cfg.device)
    backend = "cuda" if device.type == "cuda" else "cpu"
    out = Path(cfg.out)

    store = Store.open(cfg.store, mode="r+", keep_commits=cfg.keep_commits, gc=(rank == 0))
    if store.head is None:
        raise TrainError(f"store {cfg.store} has no commit yet: tile it with `python -m tools.tile`")
    max_degree = int(store.attrs["sh_degree"])
    sh_degree = max_degree if cfg.sh_degree is None else cfg.sh_degree
    if not 0 <= sh_degree <= max_degree:
        raise TrainError(f"--sh-degree {sh_degree}: the store holds SH up to degree {max_degree}")
    start = int(store.state.get("step", 0))
    if start > 0 and not cfg.resume:
        raise TrainError(f"store {cfg.store} was trained to step {start}: pass --resume to continue it")
    if start >= cfg.steps and cfg.resume:
        raise TrainError(f"store {cfg.store} is already at step {start} >= --steps {cfg.steps}")
    # Learning rates decay over --steps, so a slice must know the whole run's length.
    end = min(cfg.steps, cfg.stop_at) if cfg.stop_at > 0 else cfg.steps
    if cfg.stop_at > 0 and end <= start:
        raise TrainError(f"--stop-at {cfg.stop_at}: the store is already at step {start}")
    planned = int(store.state.get("steps", cfg.steps))
    if start > 0 and planned != cfg.steps:
        print(f"warning: {cfg.store} was trained as part of a {planned}-step run; continuing it as a "
              f"{cfg.steps}-step run changes the learning-rate schedule", flush=True)

    scene = load_cameras(cfg, store)
    region = Region.from_table(store.table, owned_blocks(store.table, rank, size, scene.train))
    check_overlap(Region.from_table(store.table), scene, store, cfg)
    budget = int(cfg.cache_mb * 2**20) if cfg.cache_mb else default_cache_bytes()
    cache = BlockCache(store, budget, device)
    background = torch.tensor(cfg.background, dtype=torch.float32, device=device)
    adam = AdamConfig().for_batch(cfg.batch_size * size)
    global_batch = cfg.batch_size * size
    log = RunLog(out, rank, size)
    if rank == 0:
        write_config(out, cfg, {"ranks": size, "device": str(device), "scene_scale": scene.scene_scale,
                                "train_images": len(scene.train), "test_images": len(scene.test)})

    schedule = Schedule(cfg.seed, len(scene.train), global_batch, look_features(scene.train, scene.scene_scale),
                        cfg.locality_window)

    def cameras_of(step: int) -> list[Camera]:
        return [scene.train[i] for i in schedule.cameras(step)]

    plans: dict[int, list[int]] = {}  # step -> rank of each camera, planned one step ahead
    images = ThreadPoolExecutor(max_workers=2, thread_name_prefix="images")
    pending: dict[int, dict[int, Future]] = {}

    def plan(step: int) -> None:
        """Assign step's cameras (a collective: every rank plans the same steps in the same order),
        then start loading this rank's images and blocks for it."""
        cams = cameras_of(step)
        plans[step] = assign_step(cams, region, exchange, cfg.batch_size)
        pending[step] = {i: images.submit(scene.data.load_image, cams[i])
                         for i, r in enumerate(plans[step]) if r == rank}
        cache.prefetch(region.union(region.visible(c) for c in cams))
        if step + 1 < end:  # and, where the budget allows, the step after: a move starts paging early
            cache.prefetch(region.union(region.visible(c) for c in cameras_of(step + 1)))

    def evaluate_now(step: int) -> dict:
        return evaluate(scene.test, scene.data.load_image, step, region, cache, exchange, sh_degree, background,
                        backend, out, log, cfg.max_eval_images)

    bar = progress_bar(cfg.steps, start, enabled=cfg.progress and rank == 0)
    t_start, step, last = time.time(), start, StepStats()
    sent0, received0 = exchange.bytes_sent, exchange.bytes_received
    try:
        with _StopFlag() as stop:
            if step < end:
                plan(step)
            while step < end and not exchange.any(stop.set):
                cams, cam_rank = cameras_of(step), plans.pop(step)
                gt = {i: f.result().to(device) for i, f in pending.pop(step).items()}
                t0 = time.time()
                # This step's blocks are pinned first, so the next step's prefetch evicts others.
                needed = region.union(region.visible(c) for c in cams)
                cache.pin(needed)
                try:
                    if step + 1 < end:
                        plan(step + 1)
                    lrs = learning_rates(adam, step, cfg.steps, scene.scene_scale)
                    degree = min(step // cfg.sh_degree_interval, sh_degree)
                    last = train_step(cams, cam_rank, gt, region, cache, exchange, degree, lrs, adam, background, backend)
                finally:
                    cache.unpin(needed)
                seconds = time.time() - t0
                region.update_extents(last.extents)
                step += 1
                imbalance, imbalance_seconds = _imbalance(exchange, last, seconds)
                if last.skipped:
                    log.write("skipped", step, reason="non-finite loss or gradient")
                    bar.write(f"step {step}: non-finite loss or gradient, step skipped (nothing written)")
                if step % cfg.log_every == 0 or step == end:
                    log.write("train", step, loss=last.loss, psnr=last.psnr, owned=int(region.counts.sum()),
                              blocks=last.blocks, projected=last.projected, local=last.local, received=last.received,
                              contributed=last.contributed, seconds=seconds, imbalance=imbalance,
                              imbalance_seconds=imbalance_seconds,
                              **{f"t_{phase}": round(t, 5) for phase, t in last.timings.items()},
                              **{f"cpu_{phase}": round(t, 5) for phase, t in last.cpu.items()},
                              bytes_sent=exchange.bytes_sent - sent0, bytes_received=exchange.bytes_received - received0,
                              **_cache_fields(cache))
                    sent0, received0 = exchange.bytes_sent, exchange.bytes_received
                bar.update(1)
                bar.set_postfix(loss=f"{last.loss:.4f}", psnr=f"{last.psnr:.2f}", gs=_num_gaussians(store),
                                hit=f"{cache.stats.hit_rate:.2f}", io=f"{cache.stats.io_wait_s:.1f}s",
                                **({"imb": f"{imbalance:.2f}"} if size > 1 else {}))
                if step % cfg.commit_every == 0 and step < end:
                    _commit(store, cache, exchange, step, cfg)
                if cfg.eval_every and step % cfg.eval_every == 0 and step < end:
                    evaluate_now(step)
            _commit(store, cache, exchange, step, cfg)
        metrics = evaluate_now(step)
    except CacheBudgetError as e:
        raise TrainError(f"--cache-mb {budget / 2**20:.2f} is too small for one step: {e}") from e
    finally:
        bar.close()
        images.shutdown(wait=False, cancel_futures=True)
        cache.close()
        log.close()
    elapsed = time.time() - t_start
    summary = {
        "steps": step,
        "interrupted": step < cfg.steps,
        "seconds": round(elapsed, 2),
        "seconds_per_step": round(elapsed / max(1, step - start), 4),
        "gaussians": _num_gaussians(store),
        "test_psnr": metrics.get("psnr"),
        "test_ssim": metrics.get("ssim"),
        **_cache_fields(cache),
        "store": str(cfg.store),
        "out": str(out),
    }
    if rank == 0:
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        metrics_file = out / "metrics.jsonl"
        if metrics_file.exists():
            plot_metrics(metrics_file, out / "metrics.png")
    return summary


def _commit(store: Store, cache: BlockCache, exchange: Exchange, step: int, cfg: TrainConfig) -> None:
    """Every rank writes its dirty blocks; rank 0 alone writes the commit, once all have written."""
    parts = exchange.gather(cache.flush())
    if exchange.rank == 0:
        updated = {k: v for u, _ in parts for k, v in u.items()}
        removed = [k for _, r in parts for k in r]
        state = {"step": step, "steps": cfg.steps, "seed": cfg.seed, "global_batch": cfg.batch_size * exchange.size}
        store.commit(updated, removed, state=state)
    exchange.barrier()
    if exchange.rank != 0:
        store.refresh()


def _imbalance(exchange: Exchange, stats: StepStats, seconds: float) -> tuple[float, float]:
    """max / mean over the ranks of the step's work (CPU seconds in the compute phases) and of its
    wall seconds (1.0 on one rank). The wall times say little: collectives make every rank wait
    for the slowest, and ranks sharing cores run at each other's expense."""
    if exchange.size == 1:
        return 1.0, 1.0
    work = sum(stats.cpu.get(phase, 0.0) for phase in COMPUTE_PHASES)
    rows = exchange.gather_rows(np.array([work, seconds]))  # [R, 2]
    ratios = rows.max(axis=0) / np.maximum(rows.mean(axis=0), 1e-12)
    return float(ratios[0]), float(ratios[1])


def _cache_fields(cache: BlockCache) -> dict:
    s = cache.stats
    return {"cache_hit_rate": round(s.hit_rate, 4), "io_wait_s": round(s.io_wait_s, 3),
            "bytes_read": s.bytes_read, "bytes_written": s.bytes_written}


def _num_gaussians(store: Store) -> int:
    return sum(info.count for info in store.table.values())
