"""`python -m tools.bench opensplat --opensplat PATH [--sizes N ...] [--pairs P] [--steps S]`: the CPU
step against OpenSplat's CPU trainer, side by side on one dataset.

Dataset: lund_door's 12 photos and COLMAP cameras made into one nerfstudio transforms.json folder per
size, photos resized once to 270 x 480 (fl_x, fl_y, cx, cy scaled per axis; its small SIMPLE_RADIAL
distortion is left out, so both programs train the same pinhole cameras on the same pixels), with a
fixed point cloud (`ply_file_path`, binary PLY: float x y z, uchar red green blue) of exactly N points:
below the scene's 11,384 SfM points a seeded subsample, above them every SfM point plus seeded jittered
copies (a random SfM point moved by a normal offset of the cloud's median nearest-neighbour spacing).

A: OpenSplat, `--cpu -n S --densify-from 100000 --densify-until 15000 --refine-every 100000`: no
    densification, and its optimizers step every step (the SH-rest one every 16th), as they do
    up to --densify-until; past it they would step only every 32nd. It prints no timings: the
    bench timestamps its `Step N` lines as they arrive.
B: `python -m tools.tile FOLDER` once per size, then `python -m train --strategy none --steps S
    --log-every 1` on a fresh copy of the store; its metrics.jsonl `time` of each step (the
    trainer's clock, written as the step's line is logged) gives the same kind of figure as A's line
    times: the whole loop from one step's line to the next.
s/iter = (t_S - t_10) / (S - 10), both; runs alternate A B A B, `--pairs` pairs per size, medians.
CPU cores busy: utime + stime of the child (/proc/PID/stat, which counts all its threads, ended
ones too) at its step-10 and step-S lines, over the wall time between them. Once the step-S line
is in, the child is stopped: saving and evaluation are no part of the comparison.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

import numpy as np
from PIL import Image
from scipy.spatial import cKDTree

from tools.bench import data_dir
from tools.bench.train import REPO, BenchError, fresh_copy, python_module, scratch, store_size, tile
from tools.scenes.files import write_points
from tools.tile import TileConfig
from train.cli import HelpFormatter
from train.data.colmap_scene import read_colmap_scene
from train.data.transforms import OPENGL_TO_OPENCV
from train.data.views import RawScene

WIDTH, HEIGHT = 270, 480
SIZES = (10_000, 50_000, 200_000, 1_000_000)
FIRST = 10  # the window starts at this step's line: start-up and the first steps are left out
OPENSPLAT_FLAGS = ("--cpu", "--densify-from", "100000", "--densify-until", "15000", "--refine-every", "100000")
STEP_LINE = re.compile(r"^Step (\d+):")
POINTS_LINE = re.compile(r"^Reading (\d+) points")
# Seconds between looks at the trainer's metrics file. Its steps are timed by the trainer's own
# clock (`time`), so a look may come late; looking every 2 ms took 2.7% of a core from the run.
POLL = 0.02
HOW_TO_BUILD = ("OpenSplat is needed: pass --opensplat PATH/TO/opensplat, an executable built from "
                "github.com/WebODM/OpenSplat with -DGPU_RUNTIME=CPU (the exact steps: docs/benchmarks.md, "
                "section `opensplat`); nothing was run")


# ---- the dataset ----

def frames(raw: RawScene, width: int, height: int) -> list[dict]:
    """nerfstudio frames of the views at width x height: camera-to-world in OpenGL axes (what
    transforms.json holds), intrinsics scaled per axis, no distortion."""
    out = []
    for view in sorted(raw.views, key=lambda v: v.name):
        k = view.intrinsics
        sx, sy = width / k.width, height / k.height
        c2w = np.linalg.inv(view.viewmat) @ OPENGL_TO_OPENCV
        out.append({"file_path": f"images/{Path(view.image_name).stem}.png", "w": width, "h": height,
                    "fl_x": k.fx * sx, "fl_y": k.fy * sy, "cx": k.cx * sx, "cy": k.cy * sy,
                    "transform_matrix": c2w.tolist()})
    return out


def write_images(raw: RawScene, folder: Path, width: int, height: int) -> None:
    """The photos resized once (PNG: no second lossy encoding), shared by every size's folder."""
    folder.mkdir(parents=True, exist_ok=True)
    for view in raw.views:
        out = folder / f"{Path(view.image_name).stem}.png"
        if not out.is_file():
            with Image.open(view.image_path) as im:
                im.convert("RGB").resize((width, height), Image.LANCZOS).save(out)


def jitter_sigma(points: np.ndarray) -> float:
    """The cloud's median nearest-neighbour spacing: jittered copies stay on its surfaces."""
    distances, _ = cKDTree(points).query(points, k=2)
    return float(np.median(distances[:, 1]))


def cloud(points: np.ndarray, colors: np.ndarray, size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Exactly `size` points: a seeded subsample (no repeats) below the SfM count, else all SfM
    points then jittered copies of random ones. float32 / uint8, as the PLY stores them."""
    rng = np.random.default_rng(seed)
    if size <= len(points):
        keep = np.sort(rng.choice(len(points), size, replace=False))
        return points[keep].astype(np.float32), colors[keep]
    extra = size - len(points)
    src = rng.integers(0, len(points), extra)
    moved = points[src] + rng.normal(0.0, jitter_sigma(points), (extra, 3))
    return (np.concatenate([points, moved]).astype(np.float32),
            np.concatenate([colors, colors[src]]).astype(np.uint8))


def make_dataset(source: Path, work: Path, size: int, seed: int = 0) -> Path:
    """WORK/lund_door-WxH-N: transforms.json, points.ply and a link to the shared resized photos
    (made once per work folder)."""
    out = work / f"lund_door-{WIDTH}x{HEIGHT}-{size}"
    if (out / "transforms.json").is_file():
        return out
    raw = read_colmap_scene(source)
    images = work / f"lund_door-{WIDTH}x{HEIGHT}-images"
    write_images(raw, images, WIDTH, HEIGHT)
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "images").exists():
        os.symlink(images.resolve(), out / "images")
    write_points(out / "points.ply", *cloud(raw.points, raw.colors, size, seed))
    meta = {"camera_model": "OPENCV", "ply_file_path": "points.ply", "frames": frames(raw, WIDTH, HEIGHT)}
    (out / "transforms.json").write_text(json.dumps(meta, indent=1))  # last: it marks the folder complete
    return out


# ---- timing a child ----

def cpu_seconds(pid: int) -> float:
    """utime + stime of a process: every thread it has run, ended ones included."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # the name, in parentheses, may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def step_of(line: str) -> int | None:
    m = STEP_LINE.match(line)
    return int(m.group(1)) if m else None


def step_times(lines: Iterable[tuple[float, str]]) -> dict[int, float]:
    """Arrival time of each `Step N:` line, from (time, line) pairs."""
    return {step: t for t, line in lines if (step := step_of(line)) is not None}


def seconds_per_iter(times: dict[int, float], first: int, last: int) -> float:
    if first not in times or last not in times:
        raise BenchError(f"no step {first} or step {last} line (steps seen: {len(times)})")
    return (times[last] - times[first]) / (last - first)


def marginal_ms_per_1k(points: list[tuple[int, float]]) -> list[tuple[int, int, float]]:
    """Between consecutive (Gaussians, s/step) points: the extra milliseconds a step takes per
    1,000 Gaussians more."""
    return [(n0, n1, 1e6 * (t1 - t0) / (n1 - n0)) for (n0, t0), (n1, t1) in pairwise(sorted(points))]


@dataclass
class Window:
    """CPU seconds of a child at the window's first and last step lines, and when they came."""

    pid: int
    first: int
    last: int
    marks: dict[int, tuple[float, float]] = field(default_factory=dict)  # step -> (wall, cpu)

    def saw(self, step: int) -> None:
        if step in (self.first, self.last) and step not in self.marks:
            self.marks[step] = (time.perf_counter(), cpu_seconds(self.pid))

    @property
    def done(self) -> bool:
        return self.last in self.marks

    def cores(self) -> float:
        (w0, c0), (w1, c1) = self.marks[self.first], self.marks[self.last]
        return (c1 - c0) / (w1 - w0)


@dataclass
class Run:
    seconds_per_step: float
    cores: float
    gaussians: int


def _stop(proc: subprocess.Popen) -> None:
    """The window is over: what the child does after it (saving, evaluating) is not timed."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def _failure(what: str, proc: subprocess.Popen, err) -> BenchError:
    err.seek(0)
    lines = [ln for ln in err.read().decode(errors="replace").splitlines() if ln.strip()]
    return BenchError(f"{what} exited {proc.returncode} before its last timed step: " + " | ".join(lines[-3:]))


def _lines(stream) -> Iterator[tuple[float, str]]:
    for raw in iter(stream.readline, b""):
        yield time.perf_counter(), raw.decode(errors="replace").rstrip("\n")


def run_opensplat(binary: Path, data: Path, out: Path, steps: int) -> Run:
    """A: its Step lines timestamped as they arrive (it flushes each one)."""
    out.mkdir(parents=True, exist_ok=True)
    args = [str(binary), str(data), "-o", str(out / "splat.ply"), "-n", str(steps), *OPENSPLAT_FLAGS]
    os.sync()  # earlier runs' dirty pages would be written back during this one
    with tempfile.TemporaryFile() as err:
        with subprocess.Popen(args, cwd=out, stdout=subprocess.PIPE, stderr=err) as proc:
            window, seen = Window(proc.pid, FIRST, steps), []
            try:
                for t, line in _lines(proc.stdout):
                    seen.append((t, line))
                    step = step_of(line)
                    if step is not None:
                        window.saw(step)
                    if window.done:
                        break
            finally:
                _stop(proc)
        if not window.done:
            raise _failure("opensplat", proc, err)
    counts = [int(m.group(1)) for _, line in seen if (m := POINTS_LINE.match(line))]
    return Run(seconds_per_iter(step_times(seen), FIRST, steps), window.cores(), counts[0] if counts else -1)


def _new_records(metrics: Path, offset: int) -> tuple[list[dict], int]:
    """Whole lines written since `offset` (a line still being written waits for the next look)."""
    try:
        with open(metrics, "rb") as f:
            f.seek(offset)
            chunk = f.read()
    except FileNotFoundError:
        return [], offset
    whole = chunk[: chunk.rfind(b"\n") + 1]
    return [json.loads(ln) for ln in whole.splitlines()], offset + len(whole)


def run_ours(data: Path, store: Path, out: Path, steps: int) -> Run:
    """B: the trainer's own per-step `time`, its CPU sampled when the window's lines appear."""
    shutil.rmtree(out, ignore_errors=True)
    work = fresh_copy(store, out.with_name(out.name + ".zarr"))
    args = python_module("train", "--data", data, "--store", work, "--out", out, "--steps", str(steps),
                         "--strategy", "none", "--device", "cpu", "--log-every", "1", "--no-progress")
    os.sync()
    times, offset = {}, 0
    with tempfile.TemporaryFile() as err:
        with subprocess.Popen([os.fspath(a) for a in args], cwd=REPO, stdout=subprocess.DEVNULL, stderr=err) as proc:
            window = Window(proc.pid, FIRST, steps)
            try:
                while not window.done and proc.poll() is None:
                    records, offset = _new_records(out / "metrics.jsonl", offset)
                    for r in (r for r in records if r["kind"] == "train"):
                        times[r["step"]] = r["time"]
                        window.saw(r["step"])
                    time.sleep(POLL)
            finally:
                _stop(proc)
        if not window.done:
            raise _failure("python -m train", proc, err)
    shutil.rmtree(work)
    return Run(seconds_per_iter(times, FIRST, steps), window.cores(), store_size(store).gaussians)


def alternate(binary: Path, data: Path, store: Path, work: Path, size: int, pairs: int,
              steps: int) -> tuple[dict[str, list[Run]], bool]:
    """A B A B ...: each program's runs, and whether none failed (a failure is reported, the rest go on)."""
    runs: dict[str, list[Run]] = {"A": [], "B": []}
    ok = True
    for pair in range(pairs):
        for side in ("A", "B"):
            try:
                if side == "A":
                    run = run_opensplat(binary, data, work / f"opensplat-{size}", steps)
                else:
                    run = run_ours(data, store, work / f"ours-{size}", steps)
            except BenchError as e:
                print(f"error: {size:,} Gaussians, pair {pair + 1}, {side}: {e}", file=sys.stderr)
                ok = False
                continue
            runs[side].append(run)
            # a long run's progress (and what the bench had before a failure or an interruption)
            print(f"  {size:,} pair {pair + 1} {side}: {run.seconds_per_step:.4f} s/step, {run.cores:.2f} cores, "
                  f"{_load()}", flush=True)
    return runs, ok


# ---- the report ----

def _median(runs: list[Run], attr: str) -> float:
    return float(np.median([getattr(r, attr) for r in runs])) if runs else float("nan")


def report(size: int, a: list[Run], b: list[Run]) -> tuple[float, float]:
    """One size's line; returns the two medians."""
    ta, tb = _median(a, "seconds_per_step"), _median(b, "seconds_per_step")
    print(f"\n[{size:,} Gaussians] counts read: OpenSplat {sorted({r.gaussians for r in a})} (its 'Reading N "
          f"points' line), ours {sorted({r.gaussians for r in b})} (the store)")
    print(f"  OpenSplat s/iter runs: {' '.join(f'{r.seconds_per_step:.4f}' for r in a)}; "
          f"cores {' '.join(f'{r.cores:.2f}' for r in a)}")
    print(f"  ours s/step runs:      {' '.join(f'{r.seconds_per_step:.4f}' for r in b)}; "
          f"cores {' '.join(f'{r.cores:.2f}' for r in b)}")
    print(f"  medians: OpenSplat {ta:.4f} s/iter, ours {tb:.4f} s/step, ratio {ta / tb:.2f}x, "
          f"cores busy {_median(a, 'cores'):.2f} / {_median(b, 'cores'):.2f}")
    if len(a) == len(b):  # each pair ran close in time: its ratio shares its load, the medians' may not
        ratios = [x.seconds_per_step / y.seconds_per_step for x, y in zip(a, b)]
        print(f"  ratio of each pair: {' '.join(f'{r:.2f}x' for r in ratios)} (median {np.median(ratios):.2f}x)")
    return ta, tb


def summary(medians: dict[int, tuple[float, float]]) -> None:
    print("\n| Gaussians | OpenSplat s/iter | ours s/step | ratio |")
    print("|---|---|---|---|")
    for n, (ta, tb) in sorted(medians.items()):
        print(f"| {n:,} | {ta:.4f} | {tb:.4f} | {ta / tb:.2f}x |")
    a = marginal_ms_per_1k([(n, m[0]) for n, m in medians.items()])
    b = marginal_ms_per_1k([(n, m[1]) for n, m in medians.items()])
    if a:
        print("\n| from -> to | OpenSplat ms per 1k Gaussians | ours ms per 1k Gaussians |")
        print("|---|---|---|")
        for (n0, n1, ma), (_, _, mb) in zip(a, b):
            print(f"| {n0:,} -> {n1:,} | {ma:.3f} | {mb:.3f} |")


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} cores"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(formatter_class=HelpFormatter, prog="python -m tools.bench opensplat",
                                description="the CPU step against OpenSplat's CPU trainer, alternated runs")
    p.add_argument("--opensplat", type=Path, help="the opensplat executable (default: none: the bench says how "
                   "to build one and exits)")
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="Gaussians of each dataset")
    p.add_argument("--pairs", type=int, default=3, help="A B pairs of runs per size")
    p.add_argument("--steps", type=int, default=200, help=f"steps of every run; timed from step {FIRST} to the last")
    p.add_argument("--seed", type=int, default=0, help="seed of the subsampled / jittered point clouds")
    p.add_argument("--data", type=Path, default=data_dir(), help="the shared data folder (lund_door inside)")
    p.add_argument("--work", type=Path, help="keep datasets, stores and runs here (default: a temporary folder)")
    return p


def main(argv: list[str]) -> int:
    p = _parser()
    a = p.parse_args(argv)
    if a.steps <= FIRST or a.pairs <= 0 or min(a.sizes) <= 0:
        p.error(f"--steps must exceed {FIRST}; --pairs and --sizes must be positive")
    binary = a.opensplat
    if binary is None or not binary.is_file() or not os.access(binary, os.X_OK):
        print(HOW_TO_BUILD if binary is None else f"{binary}: not an executable file. {HOW_TO_BUILD}")
        return 0
    if not (a.data / "lund_door").is_dir():
        print(f"error: {a.data / 'lund_door'}: no such data folder (pass --data)", file=sys.stderr)
        return 2
    print(f"start: {_load()} (other processes share them)")
    print(f"{a.steps} steps a run, timed from step {FIRST}; {a.pairs} A B pair(s) per size; {WIDTH}x{HEIGHT}")
    failed, medians = False, {}
    with scratch(a.work) as work:
        for size in a.sizes:
            try:
                data = make_dataset(a.data / "lund_door", work, size, a.seed)
                store = tile(data, work / f"{data.name}.zarr", TileConfig.max_per_block)
            except BenchError as e:
                print(f"error: {size:,}: {e}", file=sys.stderr)
                failed = True
                continue
            runs, ok = alternate(binary.resolve(), data, store, work, size, a.pairs, a.steps)
            failed |= not ok
            if runs["A"] and runs["B"]:
                medians[size] = report(size, runs["A"], runs["B"])
        if medians:
            summary(medians)
    print(f"\nend: {_load()}")
    return 1 if failed else 0
