"""`python -m tools.plan --gaussians 1e9 --ranks 64 ...`: what training a city of that size on R
ranks would hold, page and send per rank and step, without rendering (see docs/plan.md).
`python -m tools.plan --store STORE --data DATA --ranks R ...` plans a store that exists instead."""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from octree.semantics import MAX_SH_DEGREE
from storage import Store, StoreError
from storage.schema import bytes_per_gaussian
from tools.plan.city import PlanError, sampled_city
from tools.plan.core import plan_layout, plan_run
from tools.plan.report import plan_document, print_plan
from tools.plan.store import store_layout
from tools.scenes import CityConfig, CityError
from tools.tile import TileConfig
from train.cli import HelpFormatter
from train.config import ConfigError, TrainConfig
from train.data.errors import DatasetError
from train.schedule import Schedule
from train.trainer import TrainError, load_cameras, look_features, scene_scale

MIN_GAUSSIANS = 1_000
MAX_GAUSSIANS = 10**12  # 724 TB of state at SH degree 3: beyond any run this planner is for
MAX_SAMPLES = 20_000_000  # samples held in memory (~1.5 GB with the projection's temporaries)


@dataclass(frozen=True)
class PlanConfig:
    """A planned run; every field is a command-line option of the same name."""

    gaussians: float = 1e9  # Gaussians in the city
    ranks: int = 64
    batch_size: int = 1  # cameras per rank per step (the trainer's --batch-size)
    cameras: int = 4096  # training cameras, street level (`tools.city`)
    width: int = 1280
    height: int = 720
    fov: float = 75.0  # horizontal field of view, degrees
    cache_gb: float | None = None  # each rank's block cache; None: only report what it needs
    sh_degree: int = 3
    max_per_block: int = TileConfig.max_per_block  # octree leaf capacity
    network_gbps: float = 100.0  # each rank's link
    steps: int = 4  # steps of the trainer's schedule to plan
    locality_window: int = 100  # the trainer's --locality-window
    samples_per_block: int = 128  # resolution: a full block is represented by this many samples
    city_blocks: int | None = None  # city blocks a side; None: as many as the count needs at the city's density
    seed: int = 0
    store: Path | None = None  # plan this store instead of a city (its blocks, Gaussians, regions)
    data: Path | None = None  # the store's dataset: its training cameras
    data_factor: int = 1  # the trainer's --data-factor (the cameras' image size)
    test_every: int = 8  # the trainer's --test-every (which images are held out)

    def __post_init__(self) -> None:
        if (self.store is None) != (self.data is None):
            raise PlanError("--store and --data go together: a store is planned with its dataset's cameras")
        if self.data_factor < 1 or self.test_every < 1:
            raise PlanError(f"--data-factor {self.data_factor} / --test-every {self.test_every}: must be at least 1")
        g = self.gaussians
        if not math.isfinite(g) or g != int(g) or not MIN_GAUSSIANS <= g <= MAX_GAUSSIANS:
            raise PlanError(f"--gaussians {g:g}: must be a whole number in [{MIN_GAUSSIANS:g}, {MAX_GAUSSIANS:g}]")
        for name in ("ranks", "batch_size", "cameras", "width", "height", "max_per_block", "steps", "samples_per_block"):
            if getattr(self, name) < 1:
                raise PlanError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be at least 1")
        if self.store is None and self.cameras < self.ranks * self.batch_size:
            raise PlanError(f"--cameras {self.cameras}: a step needs --ranks x --batch-size = "
                            f"{self.ranks * self.batch_size} cameras")
        if not 0 <= self.sh_degree <= MAX_SH_DEGREE:
            raise PlanError(f"--sh-degree {self.sh_degree}: must be in [0, {MAX_SH_DEGREE}]")
        if not (math.isfinite(self.network_gbps) and self.network_gbps > 0):
            raise PlanError(f"--network-gbps {self.network_gbps}: must be a positive number")
        if self.city_blocks is not None and self.city_blocks < 1:
            raise PlanError(f"--city-blocks {self.city_blocks}: must be at least 1")
        if self.locality_window < 0:
            raise PlanError(f"--locality-window {self.locality_window}: must be at least 0")
        if self.cache_gb is not None:
            block = self.max_per_block * bytes_per_gaussian(self.sh_degree)
            if not (math.isfinite(self.cache_gb) and self.cache_gb > 0):
                raise PlanError(f"--cache-gb {self.cache_gb}: must be a positive number")
            if self.cache_gb * 1e9 < block:
                raise PlanError(f"--cache-gb {self.cache_gb:g} is too small for one view: a view pages at least one "
                                f"block, and a full block ({self.max_per_block} Gaussians x "
                                f"{bytes_per_gaussian(self.sh_degree)} B at SH degree {self.sh_degree}) takes "
                                f"{block / 1e9:.3f} GB")
        if self.gaussians / self.weight > MAX_SAMPLES:
            raise PlanError(f"--gaussians {self.gaussians:g} at --max-per-block {self.max_per_block} and "
                            f"--samples-per-block {self.samples_per_block} needs {self.gaussians / self.weight:,.0f} "
                            f"samples, more than {MAX_SAMPLES:,}: lower --samples-per-block")

    @property
    def weight(self) -> int:
        """Gaussians each sample stands for."""
        return max(1, self.max_per_block // self.samples_per_block)


def _gaussians(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (e.g. 1e9)") from None


def parse_args(argv: list[str]) -> tuple[PlanConfig, bool]:
    d = PlanConfig()
    p = argparse.ArgumentParser(prog="python -m tools.plan", formatter_class=HelpFormatter,
                                description="per-rank state, cache and exchange of a city-sized run, without rendering")
    p.add_argument("--gaussians", type=_gaussians, default=d.gaussians, help="Gaussians in the city (1e9 is fine)")
    p.add_argument("--ranks", type=int, default=d.ranks, help="MPI ranks")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="cameras per rank per step")
    p.add_argument("--cameras", type=int, default=d.cameras, help="training cameras")
    p.add_argument("--width", type=int, default=d.width, help="image width, pixels")
    p.add_argument("--height", type=int, default=d.height, help="image height, pixels")
    p.add_argument("--fov", type=float, default=d.fov, help="horizontal field of view, degrees")
    p.add_argument("--cache-gb", type=float, default=d.cache_gb, help="each rank's block cache (GB, 1e9 bytes) (default: none, report what each rank needs)")
    p.add_argument("--sh-degree", type=int, default=d.sh_degree, help="SH degree of the state")
    p.add_argument("--max-per-block", type=int, default=d.max_per_block, help="octree leaf capacity")
    p.add_argument("--network-gbps", type=float, default=d.network_gbps, help="each rank's link, Gbit/s")
    p.add_argument("--steps", type=int, default=d.steps, help="steps of the trainer's schedule to plan")
    p.add_argument("--locality-window", type=int, default=d.locality_window, help="the trainer's locality window")
    p.add_argument("--samples-per-block", type=int, default=d.samples_per_block,
                   help="resolution: samples standing for a full block's Gaussians")
    p.add_argument("--city-blocks", type=int, default=d.city_blocks,
                   help="city blocks a side (default: as many as --gaussians needs at 2 Gaussians a square metre)")
    p.add_argument("--seed", type=int, default=d.seed, help="the city's and the schedule's seed")
    p.add_argument("--store", type=Path, help="plan this store (from `tools.tile`) instead of a city; the city's "
                   "options, --sh-degree and --max-per-block are then the store's own (default: plan a city)")
    p.add_argument("--data", type=Path, help="with --store: its dataset, whose training cameras are planned (default: none)")
    p.add_argument("--data-factor", type=int, default=d.data_factor, help="with --store: the trainer's --data-factor")
    p.add_argument("--test-every", type=int, default=d.test_every, help="with --store: the trainer's --test-every")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON document instead of tables")
    a = vars(p.parse_args(argv))
    as_json = a.pop("json")
    return PlanConfig(**a), as_json


def main(argv: list[str]) -> int:
    try:
        cfg, as_json = parse_args(argv)
        if cfg.store is not None:
            return _plan_store(cfg, as_json)
        base = CityConfig(cameras=cfg.cameras, width=cfg.width, height=cfg.height, fov_x=cfg.fov, seed=cfg.seed)
    except (PlanError, CityError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    sampled = sampled_city(cfg.gaussians, base, cfg.weight, cfg.city_blocks)
    cams, c = sampled.cameras, sampled.config
    t_city = time.perf_counter() - t0
    log = _logger(t0)
    log(f"city: {c.blocks}x{c.blocks} city blocks, {sampled.samples:,} samples of {cfg.weight} Gaussians, "
        f"{len(cams):,} cameras")
    plan = plan_run(sampled.splats, cfg.weight, cams, _steps(cfg, cams), cfg.ranks, cfg.batch_size,
                    cfg.max_per_block, cfg.sh_degree, log)
    doc = plan_document(plan, cfg.network_gbps, cfg.cache_gb)
    seconds = time.perf_counter() - t0
    doc["city"] = {"blocks_per_side": c.blocks, "extent_m": c.extent, "buildings": len(sampled.layout.buildings),
                   "density": c.density, "samples": sampled.samples, "cameras": len(cams), "width": c.width,
                   "height": c.height, "fov": c.fov_x}
    doc["config"] = _jsonable(cfg)
    doc["seconds"] = {"city": round(t_city, 2), "total": round(seconds, 2)}
    if as_json:
        print(json.dumps(doc, indent=1))
        return 0
    print_plan(doc, [
        f"city: {c.blocks}x{c.blocks} city blocks, {c.extent / 1000:.2f} km square, {len(sampled.layout.buildings):,} "
        f"buildings, {doc['gaussians']:,} Gaussians ({sampled.samples:,} samples of {cfg.weight}); {len(cams):,} cameras "
        f"{c.width}x{c.height} at {c.fov_x:g} deg",
        f"octree: {doc['blocks']:,} blocks of at most {cfg.max_per_block:,} Gaussians over {cfg.ranks} ranks; "
        f"SH degree {cfg.sh_degree}: {doc['bytes_per_gaussian']} B of state a Gaussian",
        _schedule_line(cfg),
    ])
    print(f"\nplanned in {seconds:.1f} s (city {t_city:.1f} s)")
    return 0


def _plan_store(cfg: PlanConfig, as_json: bool) -> int:
    """The plan of an existing store: raises PlanError for what cannot be planned."""
    t0 = time.perf_counter()
    try:
        store = Store.open(cfg.store, mode="r")
        if store.head is None:
            raise PlanError(f"--store {cfg.store}: has no commit yet (tile it with `python -m tools.tile`)")
        scene = load_cameras(TrainConfig(data=str(cfg.data), store=str(cfg.store), data_factor=cfg.data_factor,
                                         test_every=cfg.test_every), store)
    except (StoreError, DatasetError, TrainError, ConfigError, OSError) as e:
        raise PlanError(f"{e}") from e
    cams = scene.train
    if len(cams) < cfg.ranks * cfg.batch_size:
        raise PlanError(f"--data {cfg.data}: {len(cams)} training cameras, but a step needs --ranks x --batch-size = "
                        f"{cfg.ranks * cfg.batch_size}")
    log = _logger(t0)
    try:
        layout, weight = store_layout(store, cfg.ranks, cams, MAX_SAMPLES)
    except StoreError as e:  # a corrupt or missing block
        raise PlanError(f"{e}") from e
    log(f"store: {len(layout.counts):,} blocks, {len(layout.splats['means']):,} samples of {weight} Gaussians, "
        f"{len(cams):,} training cameras")
    plan = plan_layout(layout, weight, cams, _steps(cfg, cams, scene.scene_scale), cfg.batch_size,
                       store.sh_degree, log)
    doc = plan_document(plan, cfg.network_gbps, cfg.cache_gb)
    doc["gaussians"] = int(sum(info.count for info in store.table.values()))  # exact, whatever the sampling
    doc["store"] = {"path": str(cfg.store), "step": int(store.state.get("step", 0)), "data": str(cfg.data),
                    "cameras": len(cams), "width": cams[0].width, "height": cams[0].height}
    doc["config"] = _jsonable(cfg)
    doc["seconds"] = {"total": round(time.perf_counter() - t0, 2)}
    if as_json:
        print(json.dumps(doc, indent=1))
        return 0
    print_plan(doc, [
        f"store: {cfg.store} at step {doc['store']['step']}, {doc['gaussians']:,} Gaussians in {doc['blocks']:,} blocks "
        f"(samples of {weight}); SH degree {store.sh_degree}: {doc['bytes_per_gaussian']} B of state a Gaussian",
        f"cameras: {len(cams):,} training views of {cfg.data} at {cams[0].width}x{cams[0].height}",
        _schedule_line(cfg),
    ])
    print(f"\nplanned in {doc['seconds']['total']:.1f} s")
    return 0


def _steps(cfg: PlanConfig, cams: list, scale: float | None = None) -> list:
    """The steps' camera indices, as the trainer's schedule draws them."""
    scale = scene_scale(cams) if scale is None else scale
    schedule = Schedule(cfg.seed, len(cams), cfg.ranks * cfg.batch_size, look_features(cams, scale),
                        cfg.locality_window)
    return [schedule.cameras(s) for s in range(cfg.steps)]


def _schedule_line(cfg: PlanConfig) -> str:
    return (f"schedule: {cfg.ranks} ranks x {cfg.batch_size} camera(s) a step, {cfg.steps} steps of the trainer's "
            f"schedule (seed {cfg.seed}, locality window {cfg.locality_window})")


def _logger(t0: float):
    def log(line: str) -> None:  # progress on stderr, so --json output stays one document
        print(f"[{time.perf_counter() - t0:7.1f} s] {line}", file=sys.stderr, flush=True)
    return log


def _jsonable(cfg: PlanConfig) -> dict:
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(cfg).items()}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
