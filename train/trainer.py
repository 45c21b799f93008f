"""The training loop: schedule -> step -> commit / evaluate, on one rank or as one of R MPI ranks."""
from __future__ import annotations

import json
import os
import resource
import signal
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from storage import CacheBudgetError, Store, StoreError
from storage.cache import BlockCache
from storage.schema import bytes_per_gaussian
from train import layout
from train.camera import Camera
from train.config import TrainConfig
from train.data import DataConfig, DatasetError, load_scene
from train.densify import Densifier
from train.eval import evaluate
from train.exchange import Exchange, LocalExchange
from train.logs import RunLog, plot_metrics, progress_bar, tensorboard_missing, write_config
from train.heap import step_memory_from_heap
from train.losses import Regularizers
from train.lpips import load_lpips
from train.memory import MemoryCeiling, MemoryCeilingError, check_supported
from train.occlusion import OcclusionCuller
from train.optim import AdamStep, LazyDense, learning_rates
from train.region import Ownership, Region
from train.render import RenderError
from train.schedule import Schedule
from train.step import COMPUTE_PHASES, Delivered, StepStats, catch_up_block, train_step
from train.waves import plan_waves, step_bytes


class TrainError(RuntimeError):
    """A run that cannot start or continue; the message says why and what to do."""


class SetupError(TrainError):
    """A run that could not start on some rank, raised on every rank after they agreed on it
    (`messages`: rank -> why), so the job ends with every rank's exit and its message is written
    out in full: an MPI_Abort from one rank can kill the others' output before it is read."""

    def __init__(self, messages: dict[int, str]) -> None:
        first = min(messages)
        others = "" if len(messages) == 1 else f" (and on {len(messages) - 1} other ranks)"
        alike = len(set(messages.values())) == 1
        super().__init__(messages[first] if alike else f"rank {first}: {messages[first]}{others}")


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
    # The store holds the Gaussians: the dataset's point cloud is not needed.
    data = load_scene(cfg.data, DataConfig(data_factor=cfg.data_factor, test_every=cfg.test_every, normalize=False,
                                           image_memory_mb=cfg.image_memory_mb,
                                           allow_external_images=cfg.allow_external_images, point_cloud=False))
    T = np.asarray(store.attrs.get("world_transform", np.eye(4)), dtype=np.float64)
    train = [c.transformed(T) for c in data.train_cameras]
    test = [c.transformed(T) for c in data.test_cameras]
    if not train:
        raise TrainError(f"dataset {cfg.data} has no training images")
    return Scene(train, test, data, scene_scale(train))


def scene_scale(cameras: list[Camera]) -> float:
    """The scale the learning rates (and the schedule's locality metric) use: 1.1 x the largest
    distance of a camera centre from their mean (gsplat's)."""
    centers = np.stack([c.center for c in cameras])
    return float(np.linalg.norm(centers - centers.mean(0), axis=1).max() * 1.1) or 1.0


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
    return Region.from_table(table, Ownership.balanced(table, size, cameras or []).keys_of(table, rank)).keys


def assign_step(cams: list[Camera], region: Region, exchange: Exchange, per_rank: int) -> list[int]:
    """Each camera to the rank owning most of what it sees, exactly `per_rank` cameras a rank."""
    if exchange.size == 1:
        return [0] * len(cams)
    mine = layout.visible_counts(region.counts, region.extents, cams).astype(np.float64)
    return layout.assign_step(exchange.gather_rows(mine).T, per_rank).tolist()


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


class Trainer:
    """The training loop of one rank as phases: `plan` a step (assign its cameras, start loading
    its images and blocks), `train` it, `refine` (the densification hook: grow, prune, move,
    split and merge blocks, then commit and rebalance), `commit`, `evaluate`. `run` drives them."""

    def __init__(self, cfg: TrainConfig, exchange: Exchange | None = None) -> None:
        self.cfg = cfg
        if cfg.tensorboard and (missing := tensorboard_missing()):
            raise TrainError(missing)
        self.exchange = exchange = exchange or LocalExchange()
        self.rank, self.size = exchange.rank, exchange.size
        if cfg.deterministic:
            torch.use_deterministic_algorithms(True)
        torch.manual_seed(cfg.seed)
        self.device = resolve_device(cfg.device)
        self.backend = "cuda" if self.device.type == "cuda" else "cpu"
        self.out = Path(cfg.out)
        self.store = store = Store.open(cfg.store, mode="r+", keep_commits=cfg.keep_commits, gc=(self.rank == 0))
        if store.head is None:
            raise TrainError(f"store {cfg.store} has no commit yet: tile it with `python -m tools.tile`")
        max_degree = int(store.attrs["sh_degree"])
        self.sh_degree = max_degree if cfg.sh_degree is None else cfg.sh_degree
        if not 0 <= self.sh_degree <= max_degree:
            raise TrainError(f"--sh-degree {self.sh_degree}: the store holds SH up to degree {max_degree}")
        self.start = start = int(store.state.get("step", 0))
        if start > 0 and not cfg.resume:
            raise TrainError(f"store {cfg.store} was trained to step {start}: pass --resume to continue it")
        if start >= cfg.steps and cfg.resume:
            raise TrainError(f"store {cfg.store} is already at step {start} >= --steps {cfg.steps}")
        # Learning rates decay over --steps, so a slice must know the whole run's length.
        self.end = min(cfg.steps, cfg.stop_at) if cfg.stop_at > 0 else cfg.steps
        if cfg.stop_at > 0 and self.end <= start:
            raise TrainError(f"--stop-at {cfg.stop_at}: the store is already at step {start}")
        planned = int(store.state.get("steps", cfg.steps))
        if start > 0 and planned != cfg.steps:
            print(f"warning: {cfg.store} was trained as part of a {planned}-step run; continuing it as a "
                  f"{cfg.steps}-step run changes the learning-rate schedule", flush=True)
        check_strategy(cfg, store)

        self.scene = scene = load_cameras(cfg, store)
        try:  # a resume keeps the regions its run had rebalanced to (on as many ranks)
            self.ownership = Ownership.current(store.state, store.table, self.size, scene.train)
        except ValueError as e:
            raise TrainError(f"store {cfg.store}: {e}") from e
        self.occlusion = OcclusionCuller(bytes_per_gaussian(store.sh_degree)) if cfg.occlusion == "on" else None
        self._set_regions(store.table)
        check_overlap(Region.from_table(store.table), scene, store, cfg)
        self.budget = int(cfg.cache_mb * 2**20) if cfg.cache_mb else default_cache_bytes()
        start_peak = 0
        if cfg.memory_mb is not None:
            try:
                start_peak = check_supported()
            except MemoryCeilingError as e:
                raise TrainError(str(e)) from e
        self.cache = BlockCache(store, self.budget, self.device)
        self.ceiling = (None if cfg.memory_mb is None else
                        MemoryCeiling(int(cfg.memory_mb * 2**20), self.cache.host_budget, self.cache.set_host_budget,
                                      start_peak))
        self.background = torch.tensor(cfg.background, dtype=torch.float32, device=self.device)
        self.adam = cfg.optim.adam().for_batch(cfg.batch_size * self.size)
        self.log = RunLog(self.out, self.rank, self.size, cfg.tensorboard)
        self._lpips: tuple | None = None  # (metric or None, why it is skipped or None), from the first evaluation
        self.lazy = LazyDense(self.adam, cfg.steps, scene.scene_scale) if cfg.adam == "dense" else None
        self.densifier = Densifier(cfg.densify, store, self.cache, exchange, scene.scene_scale, cfg.seed,
                                   set(store.state.get("refine_pending", [])), self.catch_up,
                                   every_block=self.lazy is not None)
        if self.rank == 0:
            write_config(self.out, cfg, {"ranks": self.size, "device": str(self.device),
                                         "scene_scale": scene.scene_scale, "train_images": len(scene.train),
                                         "test_images": len(scene.test)})
        self.schedule = Schedule(cfg.seed, len(scene.train), cfg.batch_size * self.size,
                                 look_features(scene.train, scene.scene_scale), cfg.locality_window)
        self.plans: dict[int, list[int]] = {}  # step -> rank of each camera, planned one step ahead
        self.images = ThreadPoolExecutor(max_workers=2, thread_name_prefix="images")
        self.pending: dict[int, dict[int, Future]] = {}  # step -> camera index -> its photo, loading
        self.bar = progress_bar(cfg.steps, start, enabled=cfg.progress and self.rank == 0)
        self._traffic0 = _traffic(exchange)
        self.skipped = self.skipped_in_row = 0  # steps skipped for a non-finite loss or gradient

    def _set_regions(self, table: dict) -> None:
        """This rank's region and, for the culling pass under MPI, every block with its extent
        (each rank's steps move its own; `train` passes the new extents around)."""
        self.region = Region.from_table(table, self.ownership.keys_of(table, self.rank))
        self.world = Region.from_table(table) if self.occlusion is not None and self.size > 1 else self.region

    # ---- phases ----

    def cameras_of(self, step: int) -> list[Camera]:
        return [self.scene.train[i] for i in self.schedule.cameras(step)]

    def plan(self, step: int, prefetch: bool = True) -> None:
        """Assign step's cameras (a collective: every rank plans the same steps in the same order),
        then start loading this rank's images and (with `prefetch`) blocks for it."""
        cams, region = self.cameras_of(step), self.region
        self.plans[step] = assign_step(cams, region, self.exchange, self.cfg.batch_size)
        self.pending[step] = {i: self.images.submit(self.scene.data.load_image, cams[i])
                              for i, r in enumerate(self.plans[step]) if r == self.rank}
        if not prefetch or (self.occlusion is None and self.cache.holds(self.region.keys)):
            return  # (every owned block in the cache: which of them the cameras see is not needed)
        self.cache.prefetch(self._prefetch_keys(cams))
        if step + 1 < self.end and not self.densifier.due(step):
            # and, where the budget allows, the step after: a move starts paging early
            self.cache.prefetch(self._prefetch_keys(self.cameras_of(step + 1)))

    def _prefetch_keys(self, cams: list[Camera]) -> list[str]:
        """The blocks to page ahead for these cameras: their frustums' or, with occlusion culling,
        what each kept when last culled (its nearest blocks the first time), so hidden blocks stay unread."""
        region = self.region
        if self.occlusion is not None:
            return self.occlusion.prefetch_keys(cams, self.world, region)
        return region.union(region.visible(c) for c in cams)

    def train(self, step: int) -> tuple[StepStats, float]:
        """One step (planned already); plans the next one unless a refinement comes between."""
        cams, cam_rank = self.cameras_of(step), self.plans.pop(step)
        gt = {i: f.result().to(self.device) for i, f in self.pending.pop(step).items()}
        t0 = time.time()
        visible, culled, delivered = self._cull(cams, cam_rank, step)
        if visible is None:  # culled once here, for the pin below and for the step's paging
            visible = [self.region.visible(c) for c in cams]
        # This step's blocks are pinned and its working memory reserved first, so the next step's
        # prefetch takes only what is left; a view larger than the cache pages them in waves, and
        # the next step's blocks would only be evicted again.
        needed = self.region.union(visible)
        waves = plan_waves(needed, visible, self.cache)
        with ExitStack() as paged:
            if waves is None:
                self.cache.pin(needed)
                paged.callback(self.cache.unpin, needed)
                paged.enter_context(self.cache.working(step_bytes(needed, visible, self.cache),
                                                       f"step {step}'s working memory"))
            if step + 1 < self.end and not self.densifier.due(step):
                self.plan(step + 1, prefetch=waves is None)
            lrs = learning_rates(self.adam, step, self.cfg.steps, self.scene.scene_scale)
            degree = min(step // self.cfg.sh_degree_interval, self.sh_degree)
            perturb = self.densifier.perturb(
                step, learning_rates(self.adam, step + 1, self.cfg.steps, self.scene.scene_scale)["means"])
            with step_memory_from_heap():
                stats = train_step(cams, cam_rank, gt, self.region, self.cache, self.exchange, degree, lrs,
                                   self.adam, self.background, self.backend, perturb=perturb,
                                   adam_step=AdamStep(self.cfg.adam, step + 1, self.lazy),
                                   absgrad=self.cfg.densify.absgrad and self.cfg.densify.strategy == "default",
                                   visible=visible, ssim_lambda=self.cfg.optim.ssim_lambda,
                                   regularizers=Regularizers(self.cfg.optim.opacity_reg, self.cfg.optim.scale_reg,
                                                             _num_gaussians(self.store)), waves=waves,
                                   delivered=delivered)
        if culled is not None:
            stats.occlusion, stats.timings["occlusion"], stats.cpu["occlusion"] = culled
        self.region.update_extents(stats.extents)
        if self.world is not self.region:
            for moved in self.exchange.allgather(stats.extents):
                self.world.update_extents(moved)
        self.densifier.observe(list(stats.extents), step)
        return stats, time.time() - t0

    def _cull(self, cams: list[Camera], cam_rank: list[int], step: int
              ) -> tuple[list[list[str]] | None, tuple[dict, float, float] | None, Delivered | None]:
        """--occlusion on: each camera's blocks that can change its image (the forward-only
        culling pass), the pass's report, wall and CPU seconds, and the splats it carried that the
        step need not send again; (None, None, None) when off."""
        if self.occlusion is None:
            return None, None, None
        wall, cpu = time.perf_counter(), time.thread_time()
        degree = min(step // self.cfg.sh_degree_interval, self.sh_degree)
        culls, report, delivered = self.occlusion.cull(cams, cam_rank, self.world, self.region, self.cache,
                                                       self.exchange, degree, self.background, self.backend)
        return ([c.kept for c in culls], (report.fields(), time.perf_counter() - wall, time.thread_time() - cpu),
                delivered)

    def refine(self, step: int) -> None:
        """The densification hook after step: the strategy's refinement or opacity reset; a
        refinement lands in a commit, then the regions are rebalanced if need be."""
        try:
            report = self.densifier.run(step, self.ownership, self.rank)
        except CacheBudgetError as e:
            raise TrainError(f"--cache-mb {self.budget / 2**20:.2f} is too small to refine at step {step}: {e} "
                             f"(the store keeps its last commit, step {self.store.state.get('step', 0)})") from e
        if report is not None:
            self.commit(step + 1)
            before = self.ownership
            moves = self.rebalance()
            if self.ownership != before:  # the new regions into a commit: a resume and a viewer see them
                self.commit(step + 1)
            self.log.write("refine", step + 1, gaussians=_num_gaussians(self.store), owned=int(self.region.counts.sum()),
                           blocks=len(self.store.table), **report.fields(), **moves)
        if step + 1 < self.end:
            self.plan(step + 1)

    def rebalance(self) -> dict:
        """New regions when the heaviest rank's work is more than `rebalance_above` times the mean.
        Blocks that change owner move through the store: they are all committed and clean now,
        the old owner lets go of them and the new one pages them in when a step needs them."""
        t0 = time.perf_counter()
        table, cams, threshold = self.store.table, self.scene.train, self.cfg.densify.rebalance_above
        weights = self.ownership.weights(table, cams)
        imbalance = float(weights.max() / max(weights.mean(), 1e-12))
        moved: list[str] = []
        if self.size > 1 and imbalance > threshold:
            new = Ownership.balanced(table, self.size, cams)
            moved = [k for k in table if new.owner(k) != self.ownership.owner(k)]
            self.cache.release([k for k in moved if self.ownership.owner(k) == self.rank])
            self.ownership = new
        self._set_regions(table)
        after = self.ownership.weights(table, cams)
        return {"imbalance_before": round(imbalance, 4),
                "imbalance_after": round(float(after.max() / max(after.mean(), 1e-12)), 4),
                "rebalanced_blocks": len(moved),
                "rebalanced_bytes": sum(table[k].count for k in moved) * bytes_per_gaussian(self.store.sh_degree),
                "rebalance_seconds": round(time.perf_counter() - t0, 4)}

    def commit(self, step: int) -> None:
        """Every rank writes its dirty blocks; rank 0 alone writes the commit, once all have written."""
        parts = self.exchange.gather((self.cache.flush(), sorted(self.densifier.pending)))
        if self.rank == 0:
            updated = {k: v for (u, _), _ in parts for k, v in u.items()}
            removed = [k for (_, r), _ in parts for k in r]
            pending = sorted({k for _, p in parts for k in p})
            cfg = self.cfg
            state = {"step": step, "steps": cfg.steps, "seed": cfg.seed, "global_batch": cfg.batch_size * self.size,
                     "refine_pending": pending, "regions": self.ownership.to_state()}
            self.store.commit(updated, removed, state=state)
        self.exchange.barrier()
        if self.rank != 0:
            self.store.refresh()

    def evaluate(self, step: int) -> dict:
        if self._lpips is None:
            self._lpips = load_lpips(self.device)
            if self._lpips[1] and self.rank == 0:
                self.bar.write(self._lpips[1], file=sys.stderr)
        return evaluate(self.scene.test, self.scene.data.load_image, step, self.region, self.cache, self.exchange,
                        self.sh_degree, self.background, self.backend, self.out, self.log, self.cfg.max_eval_images,
                        lambda key: self.catch_up(key, step), self._lpips[0],
                        None if self.occlusion is None else self._cull_held_out)

    def _cull_held_out(self, cams: list[Camera], cam_rank: list[int]) -> tuple[list[list[str]], int, int]:
        """Evaluation's culling (`train.eval.Cull`): the pass the steps run, at the full SH degree."""
        culls, report, _ = self.occlusion.cull(cams, cam_rank, self.world, self.region, self.cache, self.exchange,
                                               self.sh_degree, self.background, self.backend)
        return [c.kept for c in culls], report.frustum_gaussians, report.kept_gaussians

    def catch_up(self, key: str, done: int) -> int:
        """Dense Adam: the owned block `key`'s rows take the steps they missed, up to `done`;
        returns how many rows were behind."""
        return 0 if self.lazy is None else catch_up_block(self.lazy, self.cache, key, done)

    def catch_up_all(self, done: int) -> bool:
        """Dense Adam, at the end of a run or slice: every owned block up to date in the store (an
        export reads the store), streamed through the cache. Whether any rank changed a block."""
        keys = self.region.keys if self.lazy is not None else []
        behind = 0
        for i, key in enumerate(keys):
            self.cache.prefetch(keys[i + 1 : i + 5])
            behind += self.catch_up(key, done)
        return self.exchange.any(behind > 0)

    # ---- the loop ----

    def run(self) -> dict:
        """Train; returns the summary dict that is also printed and written as summary.json."""
        cfg, exchange = self.cfg, self.exchange
        t_start, step = time.time(), self.start
        try:
            with _StopFlag() as stop:
                if step < self.end:
                    self.plan(step)
                while step < self.end and not exchange.any(stop.set):
                    with self._phase():
                        stats, seconds = self.train(step)
                        if self.densifier.due(step):
                            self.refine(step)
                        step += 1
                        self._log_step(step, stats, seconds)
                        self._count_skipped(step, stats.skipped)
                        if step % cfg.commit_every == 0 and step < self.end and self.store.state.get("step") != step:
                            self.commit(step)
                        if cfg.eval_every and step % cfg.eval_every == 0 and step < self.end:
                            self.evaluate(step)
                with self._phase():
                    if self.catch_up_all(step) or self.store.state.get("step") != step:
                        self.commit(step)
                    metrics = self.evaluate(step)
        except CacheBudgetError as e:
            raise TrainError(f"--cache-mb {self.budget / 2**20:.2f} is too small for one step: {e}") from e
        finally:
            self.close()
        return self._summary(step, time.time() - t_start, metrics)

    @contextmanager
    def _phase(self) -> Iterator[None]:
        """One step with what follows it, or the final commit and evaluation: with --memory-mb, the
        ceiling measures its peak and sets the cache's budget for the next."""
        if self.ceiling is None:
            yield
            return
        floored = self.ceiling.floored
        with self.ceiling.phase():
            yield
        if self.ceiling.floored and not floored:
            self.bar.write(f"warning: rank {self.rank} peaked at {self.ceiling.excess / 2**20:.0f} MiB over its cache "
                           f"budget, so --memory-mb {self.cfg.memory_mb:g} would leave the cache less than half of "
                           f"--cache-mb; it keeps half ({self.ceiling.budget / 2**20:.0f} MiB) and the ceiling is "
                           "not kept", file=sys.stderr)

    def _count_skipped(self, step: int, skipped: bool) -> None:
        """A skipped step changes nothing; a run of them means training has broken down."""
        self.skipped += skipped
        self.skipped_in_row = self.skipped_in_row + 1 if skipped else 0
        limit = self.cfg.max_skipped
        if limit and self.skipped_in_row >= limit:
            raise TrainError(f"steps {step - limit + 1} to {step}: {limit} steps in a row had a non-finite loss or "
                             f"gradient and were skipped (a corrupt photo, or learning rates too high?); nothing "
                             f"of them was written, the store keeps its last commit, step "
                             f"{self.store.state.get('step', 0)} (--max-skipped sets the limit)")

    def _log_step(self, step: int, stats: StepStats, seconds: float) -> None:
        cfg, exchange, cache = self.cfg, self.exchange, self.cache
        imbalance, imbalance_seconds = _imbalance(exchange, stats, seconds)
        gaussians = _num_gaussians(self.store)
        if stats.skipped:
            self.log.write("skipped", step, reason="non-finite loss or gradient")
            self.bar.write(f"step {step}: non-finite loss or gradient, step skipped (nothing written)")
        if step % cfg.log_every == 0 or step == self.end:
            self.log.write("train", step, loss=stats.loss, psnr=stats.psnr, gaussians=gaussians,
                           owned=int(self.region.counts.sum()), blocks=stats.blocks, waves=stats.waves,
                           projected=stats.projected,
                           local=stats.local, received=stats.received, contributed=stats.contributed,
                           seconds=seconds, imbalance=imbalance, imbalance_seconds=imbalance_seconds,
                           **{f"t_{phase}": round(t, 5) for phase, t in stats.timings.items()},
                           **{f"cpu_{phase}": round(t, 5) for phase, t in stats.cpu.items()},
                           **{k: v - self._traffic0[k] for k, v in _traffic(exchange).items()},
                           **_cache_fields(cache, self.ceiling),
                           **stats.occlusion)
            self._traffic0 = _traffic(exchange)
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{stats.loss:.4f}", psnr=f"{stats.psnr:.2f}", gs=str(gaussians),
                             hit=f"{cache.stats.hit_rate:.2f}", io=f"{cache.stats.io_wait_s:.1f}s",
                             **({"imb": f"{imbalance:.2f}"} if self.size > 1 else {}))

    def _summary(self, step: int, elapsed: float, metrics: dict) -> dict:
        summary = {
            "steps": step,
            "interrupted": step < self.cfg.steps,
            "stopped_by_signal": step < self.end,  # the loop ends early only on a Ctrl-C (any rank's)
            "seconds": round(elapsed, 2),
            "seconds_per_step": round(elapsed / max(1, step - self.start), 4),
            "gaussians": _num_gaussians(self.store),
            "skipped_steps": self.skipped,
            "test_psnr": metrics.get("psnr"),
            "test_ssim": metrics.get("ssim"),
            "test_lpips": metrics.get("lpips"),
            **({"lpips_skipped": self._lpips[1]} if self._lpips and self._lpips[1] else {}),
            **_cache_fields(self.cache, self.ceiling),
            "store": str(self.cfg.store),
            "out": str(self.out),
        }
        self.exchange.barrier()  # every rank's metrics lines are on disk before rank 0 plots them all
        if self.rank == 0:
            (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
            plot_metrics(self.out, self.size)
        return summary

    def close(self) -> None:
        self.bar.close()
        self.images.shutdown(wait=False, cancel_futures=True)
        with warnings.catch_warnings():
            if sys.exc_info()[0] is not None:  # closing on an error, which says what the store keeps:
                warnings.simplefilter("ignore")  # the cache's list of the changes lost would repeat it
            self.cache.close()
        self.log.close()


def check_strategy(cfg: TrainConfig, store: Store) -> None:
    """Settings that need the store to judge."""
    d = cfg.densify
    if d.strategy != "none" and "octree" not in store.attrs:
        raise TrainError(f"store {cfg.store} records no octree (root cube, leaf cap): densification needs it "
                         "to place Gaussians in blocks; tile the store again or pass --strategy none")
    total = sum(info.count for info in store.table.values())
    if d.strategy == "mcmc" and d.cap_max < total:
        raise TrainError(f"--cap-max {d.cap_max} is below the {total} Gaussians {cfg.store} holds already")


# What a run can refuse with a message; anything else is a bug. OSError: a full disk or a lost
# mount outside the store's own writes (logs, renders, a commit document); its message names the
# file, and the store keeps its last commit.
EXPECTED_ERRORS = (TrainError, DatasetError, StoreError, RenderError, OSError)


def run(cfg: TrainConfig, exchange: Exchange | None = None) -> dict:
    """Train; returns the summary dict that is also printed and written as summary.json."""
    exchange = exchange or LocalExchange()
    if exchange.size == 1:
        return Trainer(cfg, exchange).run()
    trainer, why = None, None
    try:  # the setup has no collectives, so each rank gets here and the ranks agree below
        trainer = Trainer(cfg, exchange)
    except EXPECTED_ERRORS as e:  # anything else takes the job down at once
        why = str(e)
    failed = {r: m for r, m in enumerate(exchange.allgather(why)) if m is not None}
    if failed:
        if trainer is not None:
            trainer.close()
        raise SetupError(failed)
    return trainer.run()


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


def _cache_fields(cache: BlockCache, ceiling: MemoryCeiling | None = None) -> dict:
    """The cache's counters since the run started, and the process's peak RSS so far (and on
    CUDA its peak of allocated device memory: the device tier, the step's tensors, the images);
    under a --memory-mb ceiling, which keeps the peak itself, the host budget in force too."""
    s = cache.stats
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 if ceiling is None  # Linux reports KiB
            else ceiling.current_peak())
    budget = ({} if ceiling is None else
              {"budget_mib": round(ceiling.budget / 2**20, 1), "excess_mib": round(ceiling.excess / 2**20, 1)})
    gpu = ({"peak_gpu_mib": round(torch.cuda.max_memory_allocated(cache.device) / 2**20, 1)}
           if cache.device.type == "cuda" else {})
    return {"cache_hit_rate": round(s.hit_rate, 4), "io_wait_s": round(s.io_wait_s, 3), "io_s": round(s.io_s, 3),
            "bytes_read": s.bytes_read, "bytes_written": s.bytes_written,
            "peak_rss_mib": round(peak / 2**20, 1), **gpu, **budget}


def _traffic(exchange: Exchange) -> dict[str, int]:
    """The exchange's counters so far: all the bytes it sent and received, and of that the
    gradients' return (`grad_`), which depends on which splats got a gradient; and the gradient
    rows sent back (the splats this rank rendered for another that some pixel blended)."""
    return {"bytes_sent": exchange.bytes_sent, "bytes_received": exchange.bytes_received,
            "grad_bytes_sent": exchange.grad_bytes_sent, "grad_bytes_received": exchange.grad_bytes_received,
            "grad_rows_sent": exchange.grad_rows_sent}


def _num_gaussians(store: Store) -> int:
    return sum(info.count for info in store.table.values())
