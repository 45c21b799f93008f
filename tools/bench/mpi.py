"""`python -m tools.bench mpi {volume,scaling,planned}`: what the MPI exchange costs.

volume: bytes per step of our boundary exchange against gsplat's distributed mode on the
street-level synthetic city (`tools.scenes`), counted exactly from the splats every camera gets.
A splat is a Gaussian-camera pair that projection keeps (nonzero radius inside the image), found
with `train.render.project` (the trainer's projection, gsplat's semantics) on the Gaussians of the
blocks `octree.frustum_cull` keeps: the same pairs for both systems. Occlusion culls nothing in
either system, so it is not modelled.

  ours:   Gaussians are owned by space (octree blocks in Morton order, weight-balanced rank regions,
          `train.layout` as the trainer computes them); each camera is rendered by the rank
          `train.layout.assign_step` gives it (`python -m tools.plan` plans the same at any size).
          A splat travels when its owner is not the camera's rank: 12 floats forward
          (`Splats2D.pack`), 9 gradient floats and the contributed flag back (`train.mpi`).
  gsplat: `rasterization(packed=True, distributed=True)` in gsplat 1.5.3 deals Gaussians round robin
          (its trainer's `points[rank::world_size]`) and all-to-alls every projected pair to the
          camera's rank: radii 2 int32, means2d 2 + depths 1 + conics 3 + opacities 1 + colors 3
          float32, camera and Gaussian ids. Its differentiable all-to-all sends the gradient of the
          10 float columns back. The cameras go to the same ranks as ours.
  Control messages (counts: R x cameras integers per rank) are left out of both.

planned: `python -m tools.plan` against a real run. A generated city (`tools.make_scene city`) is
tiled and trained under `mpirun -n R` (`--strategy none`, a metrics line every step); the planner
plans the same store (`--store`, the trainer's regions, cameras and schedule) and, for the model
it uses at sizes nobody can train here, a sampled city of the same size and cameras (city mode).
Per step and rank: bytes sent and received as the trainer counts them (splat payloads, no control
messages) against the plans'. With `--run DIR --store STORE --data DATA` it compares an existing
run instead (e.g. the scale bench's, `--work` kept: its `run-N` folder, pristine `city-N.zarr` and
`city-N`), planning its store only (`--data-factor` as the run used; its schedule's settings read
from the run's config.json).

scaling: strong scaling of the trainer (`python -m train` under mpirun, real runs). Steps per second
of 2 ranks x batch 1 against 1 rank x batch 2 (the same global batch, hence the same parameters) on
lund_door at a size where rasterization dominates, one thread a rank; then 8 ranks x batch 1
(`--batch-size`) on the `tools.make_scene wall` scene, with the max/mean over ranks of each step's work read from the rank
metrics files: CPU seconds of each rank in the compute phases (project, render, backprop, adam; the
headline: a rank's own CPU time is its work, however the 8 ranks share the 2 cores and however long
it waits in collectives), splats projected and rasterized, the Gaussians each rank owns, and step
seconds (which mean little when 8 ranks share 2 cores, and which include waiting in collectives).
The imbalance training runs `--repeats` times with the same seed: identical work (checked on the
splat counts), so the mean of the runs' CPU seconds per rank and step is each rank's work with the
timing noise averaged down; the noise floor it prints is what equal work would read with the
noise left.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from octree import build_octree, extent_boxes, partition
from tools.bench.train import (DEFAULT_DATA, QUICK_WALL, REPO, BenchError, TrainRun, copy_dataset, python_module,
                               ratio, run_child, run_means, scratch, store_size, tile, train, warm_images)
from tools.scenes import CityConfig, CityError, generate_city, make_wall
from tools.tile import TileConfig
from train.camera import Camera
from train.cli import HelpFormatter
from train.layout import assign_step, block_ranks, ownership_weights, rank_affinity, visible_mask
from train.render import project
from train.render.splats2d import GRAD_FLOATS, WIRE_FLOATS
from train.schedule import step_cameras
from train.step import COMPUTE_PHASES

# Bytes per travelling splat.
OURS_FORWARD_FLOATS = WIRE_FLOATS  # 12; float32 or float16 on the wire
# At most: 9 float32 gradients (sent only where some is nonzero) and two bits (whether they come,
# and the contributed flag), a part's bits rounded up to whole bytes (at most a byte a splat).
OURS_BACKWARD_BYTES = GRAD_FLOATS * 4 + 1
GSPLAT_FORWARD_BYTES = 56  # 2 int32 radii, 10 float32, 2 int32 ids (the figure)
GSPLAT_FORWARD_BYTES_INT64_IDS = 64  # what 1.5.3's CUDA projection allocates: int64 camera/Gaussian ids
GSPLAT_BACKWARD_BYTES = 40  # gradients of the 10 float32 columns

POLICIES = ("in-order", "balanced-blocks", "balanced-splats")
_PROJECT_ROWS = 1 << 18  # Gaussians per projection call: bounds the temporaries to ~100 MB


@dataclass(frozen=True, eq=False)
class Layout:
    """Gaussians sorted into octree blocks (Morton order), blocks into contiguous rank regions."""

    splats: dict[str, Tensor]  # gsplat's parameters, rows in block order
    ids: np.ndarray  # [N] int64 each row's index in the input (round robin deals by it)
    starts: np.ndarray  # [B] int64 first row of each block
    counts: np.ndarray  # [B] int64 Gaussians per block
    extents: np.ndarray  # [B, 6] extent boxes (culling)
    work: np.ndarray  # [B] float64 what owning each block costs (`train.layout.ownership_weights`)
    bounds: np.ndarray  # [R + 1] int64 rank r owns blocks bounds[r]:bounds[r + 1]

    @property
    def ranks(self) -> int:
        return len(self.bounds) - 1

    @property
    def block_rank(self) -> np.ndarray:  # [B] int64
        return block_ranks(self.bounds)

    @property
    def owner(self) -> np.ndarray:  # [N] int64 rank of each row
        return np.repeat(self.block_rank, self.counts)

    def rank_gaussians(self) -> np.ndarray:  # [R] int64
        return np.bincount(self.block_rank, weights=self.counts, minlength=self.ranks).astype(np.int64)


def build_layout(splats: dict[str, np.ndarray], ranks: int, max_per_block: int,
                 cameras: list[Camera] | None = None) -> Layout:
    """The octree over the means, partitioned into `ranks` regions as the trainer does
    (`train.layout.ownership_weights` over the training cameras, by Gaussian count without)."""
    tree = build_octree(splats["means"], max_per_block)
    order = tree.order
    sorted_splats = {k: torch.from_numpy(np.ascontiguousarray(v[order])) for k, v in splats.items()}
    extents = extent_boxes(splats["means"][order], splats["scales"][order], tree.starts)
    work = ownership_weights(tree.counts, extents, cameras or [])
    return Layout(sorted_splats, order, tree.starts, tree.counts, extents, work, partition(work, ranks))


def _row_runs(layout: Layout, mask: np.ndarray) -> list[tuple[int, int]]:
    """Row ranges [a, b) of the blocks in `mask`, adjacent blocks merged, at most _PROJECT_ROWS long."""
    edges = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    first, stop = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)  # block index ranges
    ends = layout.starts + layout.counts
    runs = []
    for a, b in zip(layout.starts[first], ends[stop - 1]):
        runs.extend((s, min(s + _PROJECT_ROWS, int(b))) for s in range(int(a), int(b), _PROJECT_ROWS))
    return runs


@torch.no_grad()
def splat_rows(layout: Layout, camera: Camera,
               visible: np.ndarray | None = None) -> np.ndarray:  # [B] bool blocks it sees (default: culled here) -> [M] int64
    """Rows with a splat in `camera`."""
    parts = [np.zeros(0, dtype=np.int64)]
    visible = visible_mask(layout.extents, camera) if visible is None else visible
    for a, b in _row_runs(layout, visible):
        chunk = {k: v[a:b] for k, v in layout.splats.items()}
        parts.append(project(chunk, camera, sh_degree=0).ids.numpy() + a)
    return np.concatenate(parts)


def count_splats(layout: Layout, cameras: list[Camera]) -> tuple[np.ndarray, np.ndarray]:
    """Splats per camera and owning rank: (ours [C, R] by region, round_robin [C, R] by input index mod R)."""
    owner = layout.owner
    ours = np.zeros((len(cameras), layout.ranks), dtype=np.int64)
    round_robin = np.zeros_like(ours)
    for c, camera in enumerate(cameras):
        rows = splat_rows(layout, camera)
        ours[c] = np.bincount(owner[rows], minlength=layout.ranks)
        round_robin[c] = np.bincount(layout.ids[rows] % layout.ranks, minlength=layout.ranks)
    return ours, round_robin


def block_affinity(layout: Layout, cameras: list[Camera]) -> np.ndarray:  # [C, R]
    """What the trainer knows before projecting: each rank's Gaussians in blocks the camera may see."""
    visible = np.array([visible_mask(layout.extents, c) for c in cameras]).reshape(len(cameras), -1)
    return rank_affinity(layout.counts, layout.block_rank, layout.ranks, visible)


@dataclass
class Step:
    cameras: np.ndarray  # [R * per_rank] int64 indices into the camera list
    ranks: np.ndarray  # [R * per_rank] int64 the rank rendering each


def plan_steps(affinity: np.ndarray,  # [C, R] over all cameras; unused by "in-order"
               per_rank: int, steps: int, seed: int, policy: str) -> list[Step]:
    """The trainer's seeded schedule, each step's cameras given to ranks by `policy`:
    "in-order" (rank r renders the r-th share of the batch) or "balanced-*" (`train.layout.assign_step`)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown assignment policy {policy!r} (choose from {', '.join(POLICIES)})")
    n_cams, n_ranks = affinity.shape
    plan = []
    for s in range(steps):
        cams = step_cameras(seed, n_cams, n_ranks * per_rank, s)
        if policy == "in-order":
            ranks = np.repeat(np.arange(n_ranks), per_rank)
        else:
            ranks = assign_step(affinity[cams], per_rank)
        plan.append(Step(cams, ranks))
    return plan


@dataclass
class Volume:
    """Travelling splats summed over the steps of a plan."""

    steps: int
    splats: int  # Gaussian-camera pairs with a splat
    ours: int  # of which owned by a rank other than the camera's under our layout
    gsplat: int  # of which owned by another rank under round robin

    def per_step_bytes(self) -> dict[str, float]:
        """Bytes per step by system and payload."""
        o, g = self.ours / self.steps, self.gsplat / self.steps
        return {
            "ours fp32 fwd": o * OURS_FORWARD_FLOATS * 4,
            "ours fp16 fwd": o * OURS_FORWARD_FLOATS * 2,
            "ours fp32 fwd+bwd": o * (OURS_FORWARD_FLOATS * 4 + OURS_BACKWARD_BYTES),
            "ours fp16 fwd+bwd": o * (OURS_FORWARD_FLOATS * 2 + OURS_BACKWARD_BYTES),
            "gsplat fwd": g * GSPLAT_FORWARD_BYTES,
            "gsplat fwd+bwd": g * (GSPLAT_FORWARD_BYTES + GSPLAT_BACKWARD_BYTES),
            "gsplat fwd int64 ids": g * GSPLAT_FORWARD_BYTES_INT64_IDS,
        }

    def ratios(self) -> dict[str, float]:
        """Ours over gsplat's 56-byte packed forward (and its forward + backward)."""
        b = self.per_step_bytes()
        return {
            "fp32 fwd": b["ours fp32 fwd"] / b["gsplat fwd"],
            "fp16 fwd": b["ours fp16 fwd"] / b["gsplat fwd"],
            "fp32 fwd+bwd": b["ours fp32 fwd+bwd"] / b["gsplat fwd+bwd"],
            "fp16 fwd+bwd": b["ours fp16 fwd+bwd"] / b["gsplat fwd+bwd"],
        }


def exchange_volume(ours: np.ndarray,  # [C, R] splats per camera by owning rank, our layout
                    round_robin: np.ndarray,  # [C, R] the same under round robin
                    plan: list[Step]) -> Volume:
    total = crossing_ours = crossing_gsplat = 0
    for step in plan:
        local = ours[step.cameras, step.ranks]
        local_rr = round_robin[step.cameras, step.ranks]
        pairs = ours[step.cameras].sum(axis=1)
        total += int(pairs.sum())
        crossing_ours += int((pairs - local).sum())
        crossing_gsplat += int((pairs - local_rr).sum())
    return Volume(len(plan), total, crossing_ours, crossing_gsplat)


# ---- volume: the command ----

def _volume_args(p: argparse.ArgumentParser) -> None:
    d = CityConfig()
    p.add_argument("--blocks", type=int, default=d.blocks, help="city blocks per side")
    p.add_argument("--density", type=float, default=d.density, help="Gaussians per square metre of surface")
    p.add_argument("--cameras", type=int, default=d.cameras, help="street-level cameras")
    p.add_argument("--width", type=int, default=d.width, help="image width, pixels")
    p.add_argument("--height", type=int, default=d.height, help="image height, pixels")
    p.add_argument("--fov", type=float, default=d.fov_x, help="horizontal field of view, degrees")
    p.add_argument("--seed", type=int, default=d.seed, help="the city's and cameras' seed")
    p.add_argument("--ranks", type=int, default=8, help="ranks the city is split over")
    p.add_argument("--per-rank", type=int, default=4, help="cameras each rank renders per step")
    p.add_argument("--steps", type=int, default=None, help="default: one pass over the cameras")
    p.add_argument("--max-per-block", type=int, default=TileConfig.max_per_block,
                   help="octree leaf capacity (the tiler's default)")


def _print_layout(layout: Layout) -> None:
    gauss = layout.rank_gaussians()
    blocks = np.diff(layout.bounds)
    print(f"octree: {len(layout.counts)} blocks over {layout.ranks} ranks")
    print("rank  Gaussians   share  blocks")
    for r in range(layout.ranks):
        print(f"{r:4d} {gauss[r]:10,d} {gauss[r] / gauss.sum():7.2%} {blocks[r]:7d}")
    print(f"imbalance (max/mean): Gaussians {gauss.max() / gauss.mean():.3f}, blocks {blocks.max() / blocks.mean():.3f}")


def _print_volumes(volumes: dict[str, Volume]) -> None:
    first = next(iter(volumes.values()))
    print(f"\nsplats (Gaussian-camera pairs) per step: {first.splats / first.steps:,.0f}; "
          "those owned by a rank other than the camera's travel")
    print(f"{'assignment':16s} {'ours':>22s} {'gsplat round robin':>22s}")
    for name, v in volumes.items():
        print(f"{name:16s} {v.ours / v.steps:14,.0f} ({v.ours / v.splats:5.1%}) {v.gsplat / v.steps:14,.0f} "
              f"({v.gsplat / v.splats:5.1%})")
    print(f"\nMB per step {'':17s} ours fp32  ours fp16  gsplat  |  ratio fp32  ratio fp16")
    for name, v in volumes.items():
        b, r = v.per_step_bytes(), v.ratios()
        for label, key in (("forward", "fwd"), ("fwd+bwd", "fwd+bwd")):
            print(f"{name if key == 'fwd' else '':16s} {label:8s}{b[f'ours fp32 {key}'] / 1e6:13.1f}"
                  f"{b[f'ours fp16 {key}'] / 1e6:11.1f}{b[f'gsplat {key}'] / 1e6:8.1f}  |"
                  f"{r[f'fp32 {key}']:11.3f}x{r[f'fp16 {key}']:11.3f}x")
    print(f"\nbytes a travelling splat: ours {OURS_FORWARD_FLOATS * 4} (fp32) / {OURS_FORWARD_FLOATS * 2} (fp16) "
          f"forward + {OURS_BACKWARD_BYTES} back; gsplat {GSPLAT_FORWARD_BYTES} forward + {GSPLAT_BACKWARD_BYTES} back "
          f"({GSPLAT_FORWARD_BYTES_INT64_IDS} forward with the int64 ids 1.5.3's CUDA code allocates: forward ratios "
          f"x {GSPLAT_FORWARD_BYTES / GSPLAT_FORWARD_BYTES_INT64_IDS:.3f})")


def volume(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench mpi volume", formatter_class=HelpFormatter,
                                description="bytes per step of the splat exchange, ours vs gsplat distributed")
    _volume_args(p)
    a = p.parse_args(argv)
    for name in ("ranks", "per_rank", "max_per_block", "steps"):
        if getattr(a, name) is not None and getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    steps = a.steps if a.steps is not None else max(1, a.cameras // (a.ranks * a.per_rank))
    try:
        cfg = CityConfig(blocks=a.blocks, density=a.density, cameras=a.cameras, width=a.width, height=a.height,
                         fov_x=a.fov, seed=a.seed)
    except CityError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    city = generate_city(cfg)
    print(f"city: {cfg.blocks}x{cfg.blocks} blocks, {cfg.extent:.0f} m square, {len(city):,} Gaussians, "
          f"{len(city.buildings)} buildings; {cfg.cameras} cameras {cfg.width}x{cfg.height} "
          f"fov {cfg.fov_x:g} deg at {cfg.eye_height} m")
    layout = build_layout(city.splats(), a.ranks, a.max_per_block, city.cameras)
    _print_layout(layout)
    print(f"schedule: {a.ranks} ranks x {a.per_rank} cameras per step, {steps} steps (seed {cfg.seed})")
    ours, round_robin = count_splats(layout, city.cameras)
    affinity = {"in-order": ours, "balanced-blocks": block_affinity(layout, city.cameras), "balanced-splats": ours}
    volumes = {pol: exchange_volume(ours, round_robin, plan_steps(affinity[pol], a.per_rank, steps, cfg.seed, pol))
               for pol in POLICIES}
    _print_volumes(volumes)
    return 0


# ---- scaling ----

@dataclass(frozen=True)
class ScalingConfig:
    """Strong scaling (1 rank x batch 2 against 2 ranks x batch 1) and the work balance at 8 ranks."""

    data_factor: int = 4  # lund_door at 324 x 484: every camera sees all 11k Gaussians, a render-heavy step
    steps: int = 24
    warmup: int = 4  # left out of steps per second (numba's cache, first page-ins, first exchange)
    repeats: int = 2  # 1-rank / 2-rank pairs, alternated
    max_per_block: int = 1024  # enough blocks for two balanced regions (the tiler's default gives one)
    wall: tuple[str, ...] = ()  # `tools.make_scene wall` options of the 8-rank scene
    wide_steps: int = 24
    wide_warmup: int = 4
    wide_ranks: int = 8
    wide_max_per_block: int = 1024  # about four blocks a rank of the default wall
    wide_batch: int = 1  # cameras per rank per step of the imbalance run
    wide_repeats: int = 4  # identical imbalance runs: their mean per rank and step averages timing noise out


SCALING_TARGET = 1.7
IMBALANCE_TARGET = 1.15


def _strong_scaling(work: Path, data_root: Path, cfg: ScalingConfig) -> None:
    data = copy_dataset(data_root / "lund_door", work / "lund_door")
    store = tile(data, work / f"lund_door-{cfg.max_per_block}.zarr", cfg.max_per_block)
    warm_images(data, cfg.data_factor)
    size = store_size(store)
    print(f"[scaling] lund_door at --data-factor {cfg.data_factor}, {size.gaussians:,} Gaussians in {size.blocks} "
          f"blocks; global batch 2, {cfg.steps} steps (the first {cfg.warmup} left out), one thread a rank "
          f"(OMP_NUM_THREADS=NUMBA_NUM_THREADS=1); {cfg.repeats} alternated pair(s) of runs")
    layouts = {1: 2, 2: 1}  # ranks -> per-rank batch
    runs: dict[int, list[TrainRun]] = {ranks: [] for ranks in layouts}
    for rep in range(cfg.repeats):
        for ranks, batch in layouts.items():
            runs[ranks].append(train(data, store, work / f"scaling-{ranks}-{rep}", cfg.steps, "--batch-size", str(batch),
                                     "--data-factor", str(cfg.data_factor), "--max-eval-images", "1", ranks=ranks))
    seconds = {ranks: np.concatenate([r.loop_seconds(cfg.warmup) for r in rs]) for ranks, rs in runs.items()}
    print(f"{'':28s} {'ours: 2 ranks':>14s} {'ref: 1 rank':>12s} {'ratio':>8s}")
    for label, fn in (("steps/s (1 / mean s/step)", lambda x: 1.0 / x.mean()),
                      ("steps/s (1 / median)", lambda x: 1.0 / float(np.median(x)))):
        a, b = fn(seconds[2]), fn(seconds[1])
        print(f"{label:28s} {a:>14.3f} {b:>12.3f} {ratio(a, b):>8s}")
    print(f"{'s/step, mean of each run':28s} {run_means(runs[2], cfg.warmup):>14s} {run_means(runs[1], cfg.warmup):>12s}")
    received = runs[2][0].column("received", cfg.warmup).sum(axis=0)
    rasterized = received + runs[2][0].column("local", cfg.warmup).sum(axis=0)
    print(f"{'splats crossing ranks':28s} {received.sum() / rasterized.sum():>14.1%} {0:>12.1%}")
    psnrs = {ranks: rs[0].summary["test_psnr"] for ranks, rs in runs.items()}
    print(f"{'held-out PSNR':28s} {psnrs[2]:>14.4f} {psnrs[1]:>12.4f}   "
          f"(same parameters: {'yes' if abs(psnrs[2] - psnrs[1]) < 1e-3 else 'NO'})")
    speedup = seconds[1].mean() / seconds[2].mean()
    print(f"2-rank speed-up {speedup:.3f}x (target >= {SCALING_TARGET}x): {'met' if speedup >= SCALING_TARGET else 'MISSED'}")


def _max_over_mean(x: np.ndarray) -> np.ndarray:  # [R, ...] -> [...]
    return x.max(axis=0) / np.maximum(x.mean(axis=0), 1e-12)


def _work_balance(work: Path, cfg: ScalingConfig) -> None:
    data = make_wall(work, cfg.wall)
    store = tile(data, work / f"{data.name}-{cfg.wide_max_per_block}.zarr", cfg.wide_max_per_block)
    size = store_size(store)
    r, k = cfg.wide_ranks, cfg.wide_repeats
    print(f"\n[imbalance] {r} ranks x batch {cfg.wide_batch} on the wall scene, {size.gaussians:,} Gaussians in {size.blocks} "
          f"blocks, {cfg.wide_steps} steps (the first {cfg.wide_warmup} left out), {k} identical runs (same seed, "
          f"same plan); work counts are exact, CPU seconds are not ({r} ranks share {os.cpu_count()} cores)")
    runs = [train(data, store, work / f"imbalance-{r}-{i}", cfg.wide_steps, "--max-eval-images", "1",
                  "--batch-size", str(cfg.wide_batch), ranks=r) for i in range(k)]
    run, warm = runs[0], cfg.wide_warmup
    counts = ("projected", "local", "received")
    same = all(np.array_equal(x.column(c, warm), run.column(c, warm)) for x in runs[1:] for c in counts)
    owned = run.column("owned", 0)[:, 0]  # [R] Gaussians each rank owns (the trainer's `owned_blocks`)
    rasterized = run.column("local", warm) + run.column("received", warm)  # [R, steps]
    projected = run.column("projected", warm)
    cpu = {phase: np.mean([x.column(f"cpu_{phase}", warm) for x in runs], axis=0) for phase in COMPUTE_PHASES}
    compute_runs = np.stack([sum(x.column(f"cpu_{phase}", warm) for phase in COMPUTE_PHASES) for x in runs])
    compute = compute_runs.mean(axis=0)  # [R, steps]
    measures = {"Gaussians owned": owned[:, None], "splats rasterized": rasterized, "splats projected": projected,
                "projected + rasterized": projected + rasterized, "step seconds": run.column("seconds", warm),
                **{f"CPU s, {phase}": c for phase, c in cpu.items()}, "CPU s, compute": compute}
    print(f"work counts identical in the {k} runs: {'yes' if same else 'NO'}; CPU seconds below: mean of the runs")
    print(f"{'max / mean over ranks':26s} {'per step (mean)':>16s} {'per step (max)':>15s} {'whole run':>10s}")
    for label, x in measures.items():
        step = _max_over_mean(x)
        print(f"{label:26s} {step.mean():>16.3f} {step.max():>15.3f} {_max_over_mean(x.sum(axis=1)):>10.3f}")
    print(f"(the trainer's own fields, rank 0, per step: `imbalance` {run.column('imbalance', warm)[0].mean():.3f} "
          f"(compute CPU seconds of one run), `imbalance_seconds` {run.column('imbalance_seconds', warm)[0].mean():.3f})")
    print("rank  Gaussians  rasterized/step  projected/step  compute CPU ms/step")
    for rank in range(r):
        print(f"{rank:4d} {owned[rank]:10,.0f} {rasterized[rank].mean():16,.0f} {projected[rank].mean():15,.0f} "
              f"{compute[rank].mean() * 1e3:20.1f}")
    singles = " ".join(f"{_max_over_mean(c).mean():.3f}" for c in compute_runs)
    print(f"compute CPU max/mean per step of each run alone: {singles}")
    if k > 1:
        _noise_floor(compute_runs)
    headline = _max_over_mean(compute).mean()
    print(f"work imbalance (compute CPU seconds of each rank, mean of {k} identical runs, max/mean per step) "
          f"{headline:.3f} (target <= {IMBALANCE_TARGET}): {'met' if headline <= IMBALANCE_TARGET else 'MISSED'}")


def _noise_floor(runs: np.ndarray, draws: int = 2000) -> None:  # [K, R, steps] CPU s of K identical runs
    """Print how much of the per-step imbalance is timing noise. The runs do identical work, so
    their spread around their mean per (rank, step) is noise. Only the part that differs between
    ranks moves max/mean (a step that every rank ran slower, because of other load, does not), so
    the spread common to all ranks of a run's step is taken out. Ranks with exactly equal work
    and that much noise would show the simulated max/mean printed as the floor."""
    k, r, steps = runs.shape
    spread = runs - runs.mean(axis=0)
    spread -= spread.mean(axis=1, keepdims=True)
    noise = float(np.sqrt((spread ** 2).sum() / ((k - 1) * (r - 1) * steps)))
    rng = np.random.default_rng(0)
    level = runs.mean(axis=(0, 1))  # [steps] every rank at the step's mean work

    def floor(std: float) -> float:
        equal = level + rng.normal(0.0, std, size=(draws, r, steps))
        return float((equal.max(axis=1) / equal.mean(axis=1)).mean())

    print(f"timing noise between ranks: {noise * 1e3:.1f} ms CPU per rank and step (of {runs.mean() * 1e3:.1f} ms); "
          f"equal work with that noise reads {floor(noise):.3f} per step in one run, {floor(noise / np.sqrt(k)):.3f} "
          f"in the mean of {k}")


def scaling(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench mpi scaling", formatter_class=HelpFormatter,
                                description="steps/s of 2 ranks against 1 rank, and the work balance at 8 ranks")
    p.add_argument("--quick", action="store_true", help="smaller images, fewer steps (a smoke run)")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="the shared data folder (lund_door)")
    p.add_argument("--work", type=Path, help="keep datasets, stores and runs here (default: a temporary folder)")
    p.add_argument("--skip", nargs="*", default=[], choices=("scaling", "imbalance"), help="parts to leave out")
    p.add_argument("--ranks", type=int, default=ScalingConfig.wide_ranks, help="ranks of the imbalance run")
    p.add_argument("--batch-size", type=int, default=ScalingConfig.wide_batch,
                   help="cameras per rank per step of the imbalance run")
    p.add_argument("--repeats", type=int, default=ScalingConfig.wide_repeats,
                   help="identical runs of the imbalance part, averaged per rank and step")
    a = p.parse_args(argv)
    if a.repeats < 1:
        p.error("--repeats must be at least 1")
    if a.ranks < 2:
        p.error("--ranks must be at least 2")
    if a.batch_size < 1:
        p.error("--batch-size must be at least 1")
    if not (a.data / "lund_door").is_dir():
        print(f"error: {a.data}: no lund_door folder (pass --data)", file=sys.stderr)
        return 2
    cfg = (ScalingConfig(data_factor=8, steps=8, warmup=3, repeats=1, wall=QUICK_WALL, wide_steps=5,
                         wide_ranks=a.ranks, wide_max_per_block=256, wide_batch=a.batch_size, wide_repeats=min(a.repeats, 2))
           if a.quick else ScalingConfig(wide_ranks=a.ranks, wide_batch=a.batch_size, wide_repeats=a.repeats))
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (other processes share them)")
    with scratch(a.work) as work:
        try:
            if "scaling" not in a.skip:
                _strong_scaling(work, a.data, cfg)
            if "imbalance" not in a.skip:
                _work_balance(work, cfg)
        except BenchError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    print(f"\nload average {os.getloadavg()[0]:.1f}")
    return 0


# ---- planned ----

def _planner(*args: str | os.PathLike) -> dict:
    """`python -m tools.plan ... --json` in a child process, its document."""
    proc = subprocess.run(python_module("tools.plan", *args, "--json"), cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BenchError(f"python -m tools.plan: exit {proc.returncode}: {proc.stderr.strip()[-500:]}")
    return json.loads(proc.stdout)


def _relative(planned: np.ndarray, measured: np.ndarray) -> str:
    return f"{(planned.sum() - measured.sum()) / measured.sum():+.2%}" if measured.sum() else "n/a"


def planned(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench mpi planned", formatter_class=HelpFormatter,
                                description="the planner's bytes per step and rank against a real mpirun run")
    p.add_argument("--gaussians", type=float, default=2e5, help="ground-truth Gaussians of the city")
    p.add_argument("--cameras", type=int, default=64, help="the city's cameras")
    p.add_argument("--ranks", type=int, default=4, help="MPI ranks")
    p.add_argument("--steps", type=int, default=20, help="training steps")
    p.add_argument("--max-per-block", type=int, default=4096, help="the tiler's leaf capacity")
    p.add_argument("--work", type=Path, help="keep the city, store and runs here (default: a temporary folder)")
    p.add_argument("--run", type=Path, help="an existing run's --out folder to compare instead, with --store and "
                                             "--data (default: none: generate a city and train it)")
    p.add_argument("--store", type=Path, help="with --run: the store it trained, as it was before the run (default: none)")
    p.add_argument("--data", type=Path, help="with --run: its dataset (default: none)")
    p.add_argument("--data-factor", type=int, default=1, help="with --run: the run's --data-factor")
    a = p.parse_args(argv)
    for name in ("cameras", "ranks", "steps", "max_per_block", "data_factor"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if (a.run is None) != (a.store is None) or (a.run is None) != (a.data is None):
        p.error("--run, --store and --data go together")
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (other processes share them)")
    if a.run is not None:
        return _planned_run(a.run, a.store, a.data, a.ranks, a.steps, a.data_factor)
    with scratch(a.work) as work:
        try:
            data = work / f"city-{a.gaussians:g}"
            if not (data / "transforms.json").is_file():
                run_child(python_module("tools.make_scene", "city", data, "--gaussians", f"{a.gaussians:g}",
                                        "--cameras", str(a.cameras), "--overwrite", "--clean"), "tools.make_scene city")
            store = tile(data, work / f"city-{a.gaussians:g}-{a.max_per_block}.zarr", a.max_per_block)
            warm_images(data, 1)
            run = train(data, store, work / "run", a.steps, "--strategy", "none", ranks=a.ranks)
            flags = ["--ranks", str(a.ranks), "--steps", str(a.steps)]
            of_store = _planner("--store", store, "--data", data, *flags)
            size = of_store["store"]  # the dataset's cameras as the trainer loads them
            of_city = _planner("--gaussians", f"{a.gaussians:g}", "--cameras", str(a.cameras), "--width",
                               str(size["width"]), "--height", str(size["height"]), "--max-per-block",
                               str(a.max_per_block), *flags)
        except (BenchError, OSError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    print(f"\ncity of {a.gaussians:g} ground-truth Gaussians; the store tiled from its point cloud holds "
          f"{of_store['gaussians']:,} in {of_store['blocks']} blocks; {a.ranks} ranks x 1 camera, {a.steps} steps")
    _compare(run.ranks, of_store, a.ranks, a.steps)
    real_step = sum(sum(r["bytes_sent"] for r in lines[:a.steps]) for lines in run.ranks) / a.steps
    city_step = of_city["per_step"]["bytes_ours_fwd_bwd"]  # every travelling splat, both ways (back: at most)
    print(f"city mode ({of_city['gaussians']:,} Gaussians, the ground truth's model): {city_step:,.0f} B a step "
          f"against the run's {real_step:,.0f} ({(city_step - real_step) / real_step:+.1%}); splats a step "
          f"{of_city['per_step']['splats']:,.0f} planned")
    print(f"\nload average {os.getloadavg()[0]:.1f}")
    return 0


def _compare(ranks: list[list[dict]], of_store: dict, n_ranks: int, steps: int) -> None:
    """Print the run's splat bytes per step and rank beside the store plan's."""
    # the splats' bytes: what the exchange sent and received less the gradients' return
    measured = {f"splat_{k}": np.array([[r[k] - r[f"grad_{k}"] for r in lines[:steps]] for lines in ranks],
                                       dtype=np.float64).T for k in ("bytes_sent", "bytes_received")}
    by_store = {k: np.array([s[k] for s in of_store["steps"]]) for k in measured}
    print(f"{'step':>4s} {'rank':>4s} {'sent (real)':>14s} {'planned':>14s} {'received (real)':>16s} {'planned':>14s}")
    for step in range(steps):
        for r in range(n_ranks):
            print(f"{step + 1:4d} {r:4d} {measured['splat_bytes_sent'][step, r]:14,.0f} "
                  f"{by_store['splat_bytes_sent'][step, r]:14,.0f} "
                  f"{measured['splat_bytes_received'][step, r]:16,.0f} {by_store['splat_bytes_received'][step, r]:14,.0f}")
    exact = sum(int((by_store[k] == measured[k]).sum()) for k in measured)
    worst = max(float(np.abs(by_store[k] - measured[k]).max() / max(measured[k].max(), 1)) for k in measured)
    each = np.concatenate([np.abs(by_store[k] - measured[k]).ravel() / np.maximum(measured[k].ravel(), 1)
                           for k in measured])
    owned = [lines[0]["owned"] for lines in ranks]
    planned_owned = of_store["per_rank"]["gaussians"]
    print("Gaussians owned per rank, run (step 1) / plan: "
          + ", ".join(f"{a:,} / {b:,.0f} ({(b - a) / max(a, 1):+.2%})" for a, b in zip(owned, planned_owned)))
    print(f"\n--store plan: {exact} of {2 * measured['splat_bytes_sent'].size} (step, rank, direction) splat byte "
          f"figures exact; total sent {_relative(by_store['splat_bytes_sent'], measured['splat_bytes_sent'])}, "
          f"received {_relative(by_store['splat_bytes_received'], measured['splat_bytes_received'])} against the "
          f"run; largest "
          f"difference {worst:.2%} of the largest figure; each figure within {each.max():.2%} of its own "
          f"(median {np.median(each):.2%})")


def _planned_run(run_dir: Path, store: Path, data: Path, n_ranks: int, steps: int, data_factor: int) -> int:
    """The store plan against a run that exists (its metrics lines, one a step)."""
    files = [run_dir / "metrics.jsonl"] if n_ranks == 1 else [run_dir / f"metrics.rank{r}.jsonl" for r in range(n_ranks)]
    try:
        ranks = [[r for r in map(json.loads, f.read_text().splitlines()) if r["kind"] == "train"] for f in files]
        config = json.loads((run_dir / "config.json").read_text())
        same = [x for key in ("locality_window", "seed", "batch_size", "test_every")
                for x in (f"--{key.replace('_', '-')}", str(config[key]))]
        t0 = time.perf_counter()
        of_store = _planner("--store", store, "--data", data, "--ranks", str(n_ranks), "--steps", str(steps),
                            "--data-factor", str(data_factor), *same)
        seconds = time.perf_counter() - t0
    except (BenchError, OSError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if min(len(lines) for lines in ranks) < steps:
        print(f"error: {run_dir} logged {min(len(lines) for lines in ranks)} steps, fewer than --steps {steps}",
              file=sys.stderr)
        return 1
    print(f"\n{run_dir}: the store holds {of_store['gaussians']:,} Gaussians in {of_store['blocks']} blocks; "
          f"{n_ranks} ranks, {steps} steps; the plan took {seconds:.0f} s")
    _compare(ranks, of_store, n_ranks, steps)
    print(f"\nload average {os.getloadavg()[0]:.1f}")
    return 0


SUBCOMMANDS = {"volume": volume, "scaling": scaling, "planned": planned}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in SUBCOMMANDS:
        print(f"usage: python -m tools.bench mpi {{{','.join(SUBCOMMANDS)}}} [options]", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return SUBCOMMANDS[argv[0]](argv[1:])
