"""Viewer benchmark: `python -m tools.bench view [--work DIR] [--frames N] [--cache-mb MB]`.

The server-side render of `python -m tools.view` (only the blocks in each camera's frustum,
paged through a params-only `BlockCache` under --cache-mb) against rendering the whole exported
PLY held in memory, on the synthetic city (`tools/city.py`, its benchmark defaults: 1.08 M
Gaussians, street-level cameras), at 640x480 and 1280x720. Each side runs in a fresh process, so
its peak RSS is its own; the frames are the first N city cameras after one warm-up frame.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # numba's and torch's pools share the cores (see bench render)

import argparse  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from train.cli import HelpFormatter
from tools.bench.train import python_module, run_child, scratch  # noqa: E402

SIZES = ((640, 480), (1280, 720))


@dataclass(frozen=True)
class ViewBenchConfig:
    frames: int = 5  # timed frames per size (after one warm-up)
    cache_mb: float = 16.0  # the viewer's cache: a fraction of the store, so frames really page
    max_per_block: int = 16384  # octree leaf capacity of the city store
    city_blocks: int = 6  # city blocks per side (6: the 1.08 M-Gaussian benchmark city)

    def __post_init__(self) -> None:
        if self.frames < 1 or self.cache_mb <= 0 or self.max_per_block < 1 or self.city_blocks < 1:
            raise ValueError(f"bench view: every figure must be positive, got {self}")


def _cameras_path(store: Path) -> Path:
    return store.with_suffix(".cameras.npz")


def _load_cameras(store: Path):
    """The city's cameras, saved by `_prepare` (generating the city again would cost a child its
    Gaussians' memory), moved into the store's frame as the trainer moves dataset cameras."""
    from storage import Store
    from train.camera import Camera

    saved = np.load(_cameras_path(store))
    with Store.open(store, mode="r", verify="table") as s:
        T = np.asarray(s.attrs.get("world_transform", np.eye(4)), dtype=np.float64)
    return [Camera(v, k, int(w), int(h)).transformed(T) for v, k, w, h in
            zip(saved["viewmats"], saved["Ks"], saved["widths"], saved["heights"])]


def _paths(work: Path, cfg: ViewBenchConfig) -> tuple[Path, Path, Path]:
    """The city's source PLY, its store and the store exported back to one PLY."""
    name = f"city{cfg.city_blocks}"
    return work / f"{name}.ply", work / f"{name}-{cfg.max_per_block}.zarr", work / f"{name}-export.ply"


def write_city(source: Path, cameras: Path, cfg: ViewBenchConfig) -> None:
    """In a child process: Linux keeps a process's peak RSS across fork and exec, so a parent that
    held the city would hand its peak to every measuring child."""
    from tools.scenes import CityConfig, generate_city
    from tools.ply import write_ply

    city = generate_city(CityConfig(blocks=cfg.city_blocks))
    write_ply(source, city.splats())
    np.savez(cameras, viewmats=np.stack([c.viewmat for c in city.cameras]), Ks=np.stack([c.K for c in city.cameras]),
             widths=[c.width for c in city.cameras], heights=[c.height for c in city.cameras])


def _prepare(work: Path, cfg: ViewBenchConfig) -> tuple[Path, Path]:
    source, store, exported = _paths(work, cfg)
    if not store.is_dir() or not _cameras_path(store).is_file():
        run_child(python_module("tools.bench", "view", "--child", "city", store, source, _cameras_path(store),
                                *_flags(cfg)), "generating the city")
        run_child(python_module("tools.tile", source, "--out", store, "--max-per-block", str(cfg.max_per_block),
                                "--overwrite"), "tiling the city")
    if not exported.is_file():
        run_child(python_module("tools.export", store, "--out", exported, "--frame", "store"), "exporting the city")
    return store, exported


def _flags(cfg: ViewBenchConfig) -> list[str]:
    return ["--frames", str(cfg.frames), "--cache-mb", str(cfg.cache_mb), "--max-per-block", str(cfg.max_per_block),
            "--city-blocks", str(cfg.city_blocks)]


def _frames(render_one, cameras) -> dict:
    """ms per frame at each size, median over the frames, after a warm-up frame."""
    from tools.view.cameras import resized

    out = {}
    for w, h in SIZES:
        cams = [resized(c, w, h) for c in cameras]
        render_one(cams[-1])  # warm-up: numba's cache load, first allocations
        times, extra = [], []
        for cam in cams[:-1]:
            start = time.perf_counter()
            info = render_one(cam)
            times.append(time.perf_counter() - start)
            extra.append(info)
        out[f"{w}x{h}"] = {"ms": 1e3 * float(np.median(times)), "ms_max": 1e3 * float(np.max(times)),
                           **{k: float(np.mean([e[k] for e in extra])) for k in extra[0]}}
    return out


def child(mode: str, store_path: Path, ply: Path, result: Path, cfg: ViewBenchConfig) -> None:
    """One side of the comparison, in this (fresh) process; writes its figures to `result`."""
    import torch

    from storage import Store
    from tools.ply import open_ply
    from tools.view.render import FrustumRenderer
    from train.render import render

    cameras = _load_cameras(store_path)[: cfg.frames + 1]
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if mode == "viewer":
        store = Store.open(store_path, mode="r", verify="table")
        renderer = FrustumRenderer(store, int(cfg.cache_mb * 2**20))

        def render_one(cam):
            _, stats = renderer.render(cam)
            return {"blocks": stats.blocks, "gaussians": stats.gaussians, "paged_in": stats.paged_in,
                    "mib_read": stats.bytes_read / 2**20}

        figures = _frames(render_one, cameras)
        figures["store_blocks"] = len(store.table)
        figures["store_gaussians"] = sum(i.count for i in store.table.values())
    else:
        reader = open_ply(ply)
        splats = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in reader.read(0, reader.count).items()}
        sh = int(round(np.sqrt(splats["shN"].shape[1] + 1))) - 1

        def render_one(cam):
            render(splats, cam, sh, None, "cpu")
            return {"gaussians": reader.count}

        figures = _frames(render_one, cameras)
    figures["base_rss_mib"] = base_rss
    result.write_text(json.dumps(figures))


def _parser() -> argparse.ArgumentParser:
    d = ViewBenchConfig()
    p = argparse.ArgumentParser(prog="python -m tools.bench view", description=__doc__.splitlines()[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--work", type=Path, default=None, help="keep the city, its store and PLY here (default: a temp folder)")
    p.add_argument("--frames", type=int, default=d.frames, help="timed frames per size")
    p.add_argument("--cache-mb", type=float, default=d.cache_mb, help="the viewer's block cache budget")
    p.add_argument("--max-per-block", type=int, default=d.max_per_block, help="octree leaf capacity of the city store")
    p.add_argument("--city-blocks", type=int, default=d.city_blocks, help="city blocks per side")
    p.add_argument("--child", nargs=4, metavar=("MODE", "STORE", "PLY", "RESULT"), help=argparse.SUPPRESS)
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    cfg = ViewBenchConfig(args.frames, args.cache_mb, args.max_per_block, args.city_blocks)
    if args.child:
        mode, store, ply, result = args.child
        if mode == "city":
            write_city(Path(ply), Path(result), cfg)
        else:
            child(mode, Path(store), Path(ply), Path(result), cfg)
        return 0
    with scratch(args.work) as work:
        store, ply = _prepare(work, cfg)
        results = {}
        for mode in ("viewer", "ply"):
            out = work / f"view-{mode}.json"
            run = run_child(python_module("tools.bench", "view", "--child", mode, store, ply, out, *_flags(cfg)),
                            f"bench view {mode}")
            results[mode] = {**json.loads(out.read_text()), "peak_rss_mib": run.max_rss / 2**20}
    v, p = results["viewer"], results["ply"]
    print(f"city: {v['store_gaussians']:,} Gaussians in {v['store_blocks']} blocks (--max-per-block "
          f"{cfg.max_per_block}); viewer cache {cfg.cache_mb:g} MiB; median of {cfg.frames} frames")
    print("| | viewer: frustum-paged store | whole PLY in memory |")
    print("|---|---|---|")
    for w, h in SIZES:
        key = f"{w}x{h}"
        print(f"| {key} ms/frame (max) | {v[key]['ms']:.0f} ({v[key]['ms_max']:.0f}) | {p[key]['ms']:.0f} ({p[key]['ms_max']:.0f}) |")
        print(f"| {key} blocks / Gaussians rendered per frame | {v[key]['blocks']:.1f} / {v[key]['gaussians']:,.0f} | "
              f"all / {p[key]['gaussians']:,.0f} |")
        print(f"| {key} blocks / MiB paged in per frame | {v[key]['paged_in']:.1f} / {v[key]['mib_read']:.1f} | - |")
    print(f"| peak RSS MiB (after imports) | {v['peak_rss_mib']:.0f} ({v['base_rss_mib']:.0f}) | "
          f"{p['peak_rss_mib']:.0f} ({p['base_rss_mib']:.0f}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
