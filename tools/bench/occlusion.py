"""`python -m tools.bench occlusion [SCENE ...] [--steps N] [--repeats R] [--ranks R]`: exact occlusion culling.

Each scene is trained with `--occlusion off` and `--occlusion on` in one bench run (real
`python -m train` children, each on a fresh copy of the same store, the same seed and camera
schedule, `--strategy none`, a metrics line every step; the pairs alternated `--repeats` times),
and per step, after `--warmup` steps:

* Gaussians in the frustum (what the step pages and projects without culling) and kept;
* Gaussians rasterized (local + received splats: a splat per projected Gaussian and camera);
* blocks paged (the step's blocks), bytes read by the cache over the whole run, and the bytes of
  frustum blocks the step did not page (`occ_bytes_not_read`);
* seconds per step (gaps between consecutive metrics lines: the whole loop), and the culling
  pass's own seconds (`t_occlusion`, the slowest rank's);
* with `--ranks R` (each run under `mpirun -n R`, one camera per rank and step): the bytes every
  rank sent to others in the step (splats out, gradients back, and with culling the pass's
  rounds, `occ_bytes_sent`, also shown alone), the splats the pass carried to a camera's rank
  that the step did not send again (`occ_splats_reused`), and for reference what gsplat's distributed mode
  would send for the same cameras: every projected splat of the run without culling whose
  Gaussian another rank holds under gsplat's round robin, counted as (R - 1) / R of them, at 56
  bytes forward and 40 back (`tools/bench/mpi.py`); and the splats a rank rendered for another's
  Gaussians that some pixel blended (`grad_rows_sent`), which any exact exchange of splats under
  the same ownership carries out and back: the least such an exchange can send.

Every figure is summed over the ranks.

It then compares the two stores' blocks: parameters and Adam state must be bit for bit the same
(the densification statistics differ by design: see `docs/architecture.md`).

Scenes: `walled` (`tools/scenes/walled.py`: an opaque wall with a gap, eight cameras, two
clusters of 300 Gaussians behind it that no camera sees and one seen through the gap, the tests'
scene), `walled-deep` (the same with 20,000 Gaussians in each hidden cluster: most of what the
frustum holds is hidden, as in a street of a city), `lund_door` (12 photos of a door in a wall,
tiled from its SfM points at opacity 0.1: nothing saturates, so nothing is culled) and `city`
(`python -m tools.make_scene city` with 24 street-level cameras, 320x180, its ground-truth
Gaussians tiled at 300 a block: trained-looking opacities, the issue's kind of scene, small).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from storage import Store
from storage.schema import PARAM_NAMES
from tools.scenes.walled import make_walled
from tools.bench import data_dir
from tools.bench.mpi import GSPLAT_BACKWARD_BYTES, GSPLAT_FORWARD_BYTES
from tools.bench.train import (
    BenchError,
    TrainRun,
    copy_dataset,
    python_module,
    run_child,
    scratch,
    store_size,
    tile,
    train,
    warm_images,
)
from train.cli import HelpFormatter
from train.render.splats2d import GRAD_FLOATS, WIRE_FLOATS

SCENES = ("walled", "walled-deep", "lund_door", "city")
DEEP_HIDDEN = 20_000  # Gaussians in each hidden cluster of walled-deep
MiB = 2**20


@dataclass(frozen=True)
class BenchConfig:
    steps: int = 40  # training steps of each run
    warmup: int = 5  # first steps left out of the per-step figures
    repeats: int = 2  # off / on pairs, alternated
    lund_factor: int = 4  # lund_door's image downscale
    ranks: int = 0  # mpirun -n ranks (0: one process, no mpirun)


def _scene(work: Path, name: str, cfg: BenchConfig) -> tuple[Path, Path, list[str]]:
    """(dataset, pristine store, trainer options) of a scene, made once in `work`."""
    if name.startswith("walled"):
        root = work / name
        if not (root / "walled.zarr").exists():
            make_walled(root, hidden=DEEP_HIDDEN if name == "walled-deep" else 300)
        return root / "data", root / "walled.zarr", []
    if name == "city":
        return _city(work), work / "city.zarr", []
    data = copy_dataset(data_dir() / "lund_door", work / "lund_door")
    warm_images(data, cfg.lund_factor)
    return data, tile(data, work / "lund_door.zarr", 600), ["--data-factor", str(cfg.lund_factor)]


def _city(work: Path) -> Path:
    """`tools.make_scene city` (24 street cameras), its ground-truth store exported and tiled into
    small blocks (the generator's store has one block per generation tile)."""
    data = work / "city"
    if not (work / "city.zarr").exists():
        run_child(python_module("tools.make_scene", "city", data, "--cameras", "24", "--aerial", "0",
                                "--work", work / "city.work", "--overwrite"), "tools.make_scene city")
        truth = json.loads((data / "scene.json").read_text())["ground_truth"]
        run_child(python_module("tools.export", truth, "--out", work / "city.ply"), "tools.export city")
        tile(work / "city.ply", work / "city.zarr", 300)
    return data


def _per_step(run: TrainRun, name: str, warmup: int, default: float = 0.0) -> float:
    """A metric summed over the ranks, averaged over the steps after `warmup`."""
    lines = [ls[warmup:] for ls in run.ranks]
    return float(np.mean([sum(ls[i].get(name, default) for ls in lines) for i in range(len(lines[0]))]))


def _row(label: str, runs: list[TrainRun], cfg: BenchConfig, frustum: float) -> str:
    r, warmup = runs[0], cfg.warmup
    rasterized = _per_step(r, "local", warmup) + _per_step(r, "received", warmup)
    kept = _per_step(r, "occ_kept_gaussians", warmup, frustum / len(r.ranks))
    t_occ = float(np.mean([max(ls[i].get("t_occlusion", 0.0) for ls in r.ranks)
                           for i in range(warmup, len(r.ranks[0]))]))
    seconds = np.mean([run.loop_seconds(warmup).mean() for run in runs])
    spread = " ".join(f"{run.loop_seconds(warmup).mean():.3f}" for run in runs)
    read = sum(ls[-1]["bytes_read"] for ls in r.ranks) / MiB
    sent = ""
    if cfg.ranks > 1:
        sent = (f" {_per_step(r, 'bytes_sent', warmup) / MiB:>9.3f} "
                f"{_per_step(r, 'occ_bytes_sent', warmup) / MiB:>9.3f} "
                f"{_per_step(r, 'occ_splats_reused', warmup):>8,.0f}")
    return (f"  {label:<4} {frustum:>10,.0f} {kept:>10,.0f} {_per_step(r, 'projected', warmup):>10,.0f} "
            f"{rasterized:>11,.0f} {_per_step(r, 'blocks', warmup):>7.1f} "
            f"{read:>9.2f} {_per_step(r, 'occ_bytes_not_read', warmup) / MiB:>10.3f}{sent} {seconds:>8.3f} "
            f"{t_occ:>7.3f}   ({spread})")


def _same_but_statistics(a: Path, b: Path) -> bool:
    sa, sb = Store.open(a, mode="r"), Store.open(b, mode="r")
    if sa.table.keys() != sb.table.keys():
        return False
    for k in sa.table:
        x, y = sa.read_block(k), sb.read_block(k)
        names = [n for n in x if n in PARAM_NAMES or n.startswith("exp_avg") or n == "adam_step"]
        if not all(np.array_equal(x[n], y[n]) for n in names):
            return False
    return True


def bench_scene(work: Path, name: str, cfg: BenchConfig) -> None:
    data, store, options = _scene(work, name, cfg)
    size = store_size(store)
    options = [*options, "--strategy", "none", "--adam", "contributed", "--max-eval-images", "1", "--commit-every", str(cfg.steps)]
    runs: dict[str, list[TrainRun]] = {"off": [], "on": []}
    for i in range(cfg.repeats):
        for mode, done in runs.items():
            done.append(train(data, store, work / f"{name}-{mode}-{i}", cfg.steps, *options, "--occlusion", mode,
                              ranks=cfg.ranks, keep_store=i == 0))
    ranks = f" on {cfg.ranks} ranks" if cfg.ranks > 1 else ""
    print(f"{name}: {size.gaussians:,} Gaussians in {size.blocks} blocks ({size.nbytes / MiB:.2f} MiB), "
          f"{cfg.steps} steps{ranks}, per step after {cfg.warmup}:")
    sent = f" {'sent MiB':>9} {'pass MiB':>9} {'reused':>8}" if cfg.ranks > 1 else ""
    print(f"  {'':<4} {'frustum':>10} {'kept':>10} {'projected':>10} {'rasterized':>11} {'blocks':>7} "
          f"{'read MiB':>9} {'unread MiB':>10}{sent} {'s/step':>8} {'t_occ':>7}   (s/step of each run)")
    frustum = _per_step(runs["on"][0], "occ_frustum_gaussians", cfg.warmup)  # the same cameras, off or on
    for mode, rs in runs.items():
        print(_row(mode, rs, cfg, frustum))
    if cfg.ranks > 1:
        crossing = _per_step(runs["off"][0], "projected", cfg.warmup) * (cfg.ranks - 1) / cfg.ranks
        gsplat = crossing * (GSPLAT_FORWARD_BYTES + GSPLAT_BACKWARD_BYTES)
        on, off = (_per_step(runs[m][0], "bytes_sent", cfg.warmup) for m in ("on", "off"))
        print(f"  gsplat distributed, same cameras: {gsplat / MiB:.3f} MiB a step; ours off {off / gsplat:.3f}x, "
              f"on {on / gsplat:.3f}x of it")
        # What no exact exchange of splats under this ownership can leave off: the splats a rank
        # renders for another's Gaussians that some pixel blends (their gradient rows), each once
        # out and once back. Culling drops only splats no pixel blends, so on and off count the same.
        blended = {m: _per_step(runs[m][0], "grad_rows_sent", cfg.warmup) for m in ("off", "on")}
        floor = blended["off"] * 4 * (WIRE_FLOATS + GRAD_FLOATS)
        print(f"  blended splats of another rank's Gaussians: {blended['off']:,.0f} a step off, {blended['on']:,.0f} on; "
              f"at {4 * WIRE_FLOATS} bytes out and {4 * GRAD_FLOATS} back, the least an exact splat exchange sends: "
              f"{floor / MiB:.3f} MiB a step, {floor / gsplat:.3f}x of gsplat's")
    same = _same_but_statistics(work / f"{name}-off-0.zarr", work / f"{name}-on-0.zarr")
    print(f"  parameters and Adam state after {cfg.steps} steps, on against off: "
          f"{'bit for bit the same' if same else 'DIFFERENT'}")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.bench occlusion", formatter_class=HelpFormatter,
                                description=__doc__.split("\n\n")[0])
    p.add_argument("scenes", nargs="*", metavar="SCENE",
                   help=f"scenes to run, of {', '.join(SCENES)} (default: all)")
    p.add_argument("--steps", type=int, default=BenchConfig.steps, help="training steps of each run")
    p.add_argument("--warmup", type=int, default=BenchConfig.warmup, help="first steps left out of the figures")
    p.add_argument("--repeats", type=int, default=BenchConfig.repeats, help="off / on pairs, alternated")
    p.add_argument("--ranks", type=int, default=0, help="run each training under mpirun -n RANKS (0: one process)")
    p.add_argument("--work", type=Path, help="keep stores and runs in this folder (default: a temporary one)")
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    unknown = [s for s in args.scenes if s not in SCENES]
    if unknown:
        print(f"error: unknown scene {unknown[0]!r} (choose from {', '.join(SCENES)})", file=sys.stderr)
        return 1
    if args.steps <= args.warmup or args.repeats < 1 or args.ranks < 0:
        print(f"error: --steps {args.steps} must exceed --warmup {args.warmup}, --repeats {args.repeats} be at least 1 "
              f"and --ranks {args.ranks} at least 0", file=sys.stderr)
        return 1
    cfg = BenchConfig(args.steps, args.warmup, args.repeats, ranks=args.ranks)
    try:
        with scratch(args.work) as work:
            for name in args.scenes or SCENES:
                bench_scene(work, name, cfg)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
