"""`python -m tools.bench scale`: a generated city trained out of core under mpirun, and what it costs.

For the city and for smaller ones of `--fractions` of its size (the same density): `tools.make_scene
city` (its ground truth a store, rendered block by block; `--capture survey` flies a drone survey
whose views stay the same size as the city grows, where a street camera sees most of the city),
`tools.tile` of its noisy point cloud at SH degree 3, the held-out PSNR of that
initialisation (`--steps 0`), then `mpirun -n R python -m train --cache-mb B` for `--steps`
steps on a fresh copy. Per rank, from the trainer's own metrics lines: peak RSS (flat in the
scene's size if paging works), seconds per step, cache hit rate, bytes read and written per step,
the share of store I/O that prefetch hid, and the steps that paged their view in waves (views
larger than the cache: the second read of their blocks is the cost of waves). Every figure is
measured; nothing is extrapolated from the smaller cities.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

from tools.bench.train import (BenchError, TrainRun, python_module, run_child, scratch, store_size, tile, train,
                               warm_images)
from tools.scenes import SceneConfig
from tools.scenes.city import CAPTURES
from train.config import OptimConfig
from train.optim import ADAM_MODES
from train.cli import HelpFormatter

MiB = 2**20


def _fractions(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of shares, e.g. 1,0.25,0.0625") from None
    if not values or any(not 0 < v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: every share must lie in (0, 1]")
    return sorted(set(values), reverse=True)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.bench scale", formatter_class=HelpFormatter,
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--gaussians", type=float, default=2e6, help="ground-truth Gaussians of the largest city")
    p.add_argument("--fractions", type=_fractions, default="1,0.25,0.0625",
                   help="sizes of the cities to run, as shares of --gaussians")
    p.add_argument("--cameras", type=int, default=64, help="cameras of the largest city (scaled with its share)")
    p.add_argument("--capture", choices=CAPTURES, default=SceneConfig.capture,
                   help="the city's cameras (`tools.make_scene --capture`): a survey's images each see a bounded "
                   "patch, so its camera count grows with the city and --cameras is not used")
    p.add_argument("--altitude", type=float, default=SceneConfig.altitude, help="survey: flying height (m)")
    p.add_argument("--overlap", type=float, default=SceneConfig.overlap, help="survey: overlap of neighbouring images")
    p.add_argument("--point-fraction", type=float, default=SceneConfig.point_fraction,
                   help="share of the ground truth in the point cloud the store is tiled from")
    p.add_argument("--ranks", type=int, default=2, help="MPI ranks")
    p.add_argument("--cache-mb", type=float, default=1500.0, help="each rank's block cache")
    p.add_argument("--memory-mb", type=float, default=None,
                   help="each rank's resident-memory ceiling, the trainer's --memory-mb (default: --cache-mb + 1024, "
                   "the bound the run is held to; 0: none)")
    p.add_argument("--steps", type=int, default=300, help="training steps")
    p.add_argument("--strategy", choices=("none", "default", "mcmc"), default="none", help="densification")
    p.add_argument("--opacities-lr", type=float, default=0.2,
                   help="the trainer's --opacities-lr: a run over a large city sees each Gaussian a few dozen "
                   "times, and per-row Adam moves an opacity logit by about this much each time (the trainer's "
                   f"default is {OptimConfig.opacities_lr:g}; here %(default)s)")
    p.add_argument("--adam", choices=ADAM_MODES, default="contributed",
                   help="the trainer's --adam (its default is visible, corrected by the training step, whose "
                   "steps grow through a run for Gaussians a view rarely sees; contributed corrects each row "
                   "by its own count; here %(default)s)")
    p.add_argument("--max-per-block", type=int, default=32768, help="the tiler's leaf capacity")
    p.add_argument("--work", type=Path, help="keep the cities, stores and runs here (default: a temporary folder)")
    return p


def _per_step(run: TrainRun, name: str) -> np.ndarray:  # [R, steps] from a counter since the run's start
    counter = run.column(name, 0)
    return np.diff(np.concatenate([np.zeros((len(counter), 1)), counter], axis=1), axis=1)


def _report(share: float, gaussians: int, state: int, cache_mb: float, ranks: int, base: dict, run: TrainRun,
            strategy: str, opacities_lr: float, memory_mb: float, adam: str) -> None:
    job_cache = cache_mb * MiB * ranks
    print(f"\n{share:g} of the city: {gaussians:,} Gaussians, state {state / 2**30:.2f} GiB = "
          f"{state / job_cache:.1f}x the job's cache ({ranks} x {cache_mb:g} MiB); densification "
          f"{'off' if strategy == 'none' else strategy}; --adam {adam}; --opacities-lr {opacities_lr:g}; "
          f"--memory-mb {f'{memory_mb:g}' if memory_mb else 'none'}; {run.summary['steps']} steps in "
          f"{run.seconds:.0f} s")
    print(f"  held-out PSNR {base['test_psnr']:.3f} dB at the start -> {run.summary['test_psnr']:.3f} dB "
          f"({run.summary['test_psnr'] - base['test_psnr']:+.3f})")
    print(f"  rank 0's peak RSS with the final evaluation: {run.summary['peak_rss_mib']:,.0f} MiB "
          f"({run.summary['peak_rss_mib'] - cache_mb:+,.0f} over the cache)")
    seconds = np.diff(np.array([r["time"] for r in run.ranks[0]]))
    print(f"  seconds per step (rank 0's loop, first step left out): mean {seconds.mean():.3f}, "
          f"median {np.median(seconds):.3f}")
    read, written, waves = _per_step(run, "bytes_read"), _per_step(run, "bytes_written"), run.column("waves", 0)
    print(f"  {'rank':>4s} {'peak RSS MiB':>12s} {'over cache':>10s} {'hit rate':>8s} {'read MB/step':>12s} "
          f"{'written MB/step':>15s} {'I/O hidden':>10s} {'steps in waves':>14s} {'waves/step':>10s} "
          f"{'budget MiB at end':>17s}")
    for r, lines in enumerate(run.ranks):
        last = lines[-1]
        rss = max(line["peak_rss_mib"] for line in lines)
        hidden = 1 - last["io_wait_s"] / last["io_s"] if last["io_s"] else float("nan")
        in_waves = waves[r] > 0
        print(f"  {r:4d} {rss:12.0f} {rss - cache_mb:10.0f} {last['cache_hit_rate']:8.3f} {read[r].mean() / 1e6:12.1f} "
              f"{written[r].mean() / 1e6:15.1f} {hidden:10.1%} {int(in_waves.sum()):14d} "
              f"{waves[r][in_waves].mean() if in_waves.any() else 0:10.2f} {last.get('budget_mib', cache_mb):17.0f}")


def main(argv: list[str]) -> int:
    p = _parser()
    a = p.parse_args(argv)
    for name in ("cameras", "ranks", "steps", "max_per_block"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if not 1e3 <= a.gaussians <= 1e10:
        p.error(f"--gaussians {a.gaussians:g}: between 1e3 and 1e10")
    if a.cache_mb <= 0:
        p.error(f"--cache-mb {a.cache_mb:g}: must be positive")
    if a.memory_mb is None:
        a.memory_mb = a.cache_mb + 1024
    if not (np.isfinite(a.memory_mb) and a.memory_mb >= 0):
        p.error(f"--memory-mb {a.memory_mb:g}: must be a number >= 0")
    if not (np.isfinite(a.opacities_lr) and a.opacities_lr > 0):
        p.error(f"--opacities-lr {a.opacities_lr:g}: must be a positive number")
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (other processes share them)")
    with scratch(a.work) as work:
        for share in a.fractions:
            n, cams = a.gaussians * share, max(8, round(a.cameras * share))
            try:
                data = work / f"city-{n:g}"
                if not (data / "transforms.json").is_file():
                    capture = (["--capture", "survey", "--altitude", f"{a.altitude:g}", "--overlap", f"{a.overlap:g}"]
                               if a.capture == "survey" else ["--cameras", str(cams)])
                    run_child(python_module("tools.make_scene", "city", data, "--gaussians", f"{n:g}", *capture,
                                            "--point-fraction", f"{a.point_fraction:g}", "--sh-degree", "3",
                                            "--overwrite", "--clean"),
                              f"tools.make_scene city {n:g}")
                store = tile(data, work / f"city-{n:g}.zarr", a.max_per_block, "--sh-degree", "3")
                size = store_size(store)
                warm_images(data, 1)
                flags = ["--cache-mb", f"{a.cache_mb:g}", "--strategy", a.strategy, "--data-factor", "1",
                         "--opacities-lr", f"{a.opacities_lr:g}", "--adam", a.adam,
                         *(["--memory-mb", f"{a.memory_mb:g}"] if a.memory_mb else [])]
                base = train(data, store, work / f"base-{n:g}", 0, *flags, ranks=a.ranks).summary
                run = train(data, store, work / f"run-{n:g}", a.steps, *flags, ranks=a.ranks)
            except (BenchError, OSError, ValueError) as e:
                print(f"error: {e}", file=sys.stderr)
                return 1
            _report(share, size.gaussians, size.nbytes, a.cache_mb, a.ranks, base, run, a.strategy,
                    a.opacities_lr, a.memory_mb, a.adam)
    print(f"\nload average {os.getloadavg()[0]:.1f}")
    return 0
