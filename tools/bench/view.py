"""Viewer benchmark: `python -m tools.bench view [--work DIR] [--frames N] [--cache-mb MB] [--lod PX]`.

The server-side render of `python -m tools.view` (only the blocks in each camera's frustum,
paged through a params-only `BlockCache` under --cache-mb), exact, exact with occlusion culling
(`--occlusion on`: blocks hidden behind nearer ones are never paged) and with its level of detail
(`--lod` pixels), against rendering the whole exported PLY held in memory, on the synthetic city
(`tools/scenes/city.py`, its benchmark defaults: 1.08 M Gaussians), at 640x480 and 1280x720, from
two sets of cameras: street level (the city's first N cameras) and overview (N cameras 10 degrees
apart on an orbit round the whole city, 30 degrees above it). Each side runs in a fresh process, so its peak RSS is its
own; each set and size starts with one warm-up frame. The level of detail's frames are compared
with the exact viewer's (PSNR); the culled frames must equal them byte for byte.
"""
from __future__ import annotations

from train.pools import configure_pools

configure_pools()  # numba's and torch's pools share the cores (before either loads)

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
VIEWS = ("street", "overview")
MODES = ("viewer", "viewer-occlusion", "viewer-lod", "ply")


@dataclass(frozen=True)
class ViewBenchConfig:
    frames: int = 5  # timed frames per size (after one warm-up)
    cache_mb: float = 16.0  # the viewer's cache: a fraction of the store, so frames really page
    max_per_block: int = 16384  # octree leaf capacity of the city store
    city_blocks: int = 6  # city blocks per side (6: the 1.08 M-Gaussian benchmark city)
    lod: float = 1.0  # the viewer-lod side's --lod (pixels)

    def __post_init__(self) -> None:
        if self.frames < 1 or self.cache_mb <= 0 or self.max_per_block < 1 or self.city_blocks < 1 or not self.lod > 0:
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
            "--city-blocks", str(cfg.city_blocks), "--lod", str(cfg.lod)]


def _view_sets(store_path: Path, frames: int):
    """For an image size: the street cameras resized to it, and the overview orbit made at it;
    `frames` + 1 cameras each (the last one warms up)."""
    from storage import Store
    from tools.view.cameras import orbit, resized
    from tools.view.scene import load_blocks

    with Store.open(store_path, mode="r", verify="table") as store:
        scene = load_blocks(store, str(store_path), 1, [])
        bounds, up = scene.bounds(), scene.up
    street = _load_cameras(store_path)[: frames + 1]

    def at(w: int, h: int) -> dict[str, list]:
        # 10 degrees apart, as a browser's camera orbits: a merged block is reused while its level holds.
        return {"street": [resized(c, w, h) for c in street], "overview": orbit(bounds, 36, w, h, up)[: frames + 1]}
    return at


def _frames(render_one, sets) -> tuple[dict, dict[str, np.ndarray]]:
    """ms per frame at each size and set, median over the frames, after a warm-up frame; and the
    frames themselves ([F, H, W, 3] uint8 by size and set), for the parent to compare."""
    out, images = {}, {}
    for w, h in SIZES:
        for view, cams in sets(w, h).items():
            render_one(cams[-1])  # warm-up: numba's cache load, first allocations, the proxies of a level
            times, extra, frames = [], [], []
            for cam in cams[:-1]:
                start = time.perf_counter()
                rgb, info = render_one(cam)
                times.append(time.perf_counter() - start)
                extra.append(info)
                frames.append((rgb.numpy() * 255.0 + 0.5).astype(np.uint8))
            out[f"{view} {w}x{h}"] = {"ms": 1e3 * float(np.median(times)), "ms_max": 1e3 * float(np.max(times)),
                                      **{k: float(np.mean([e[k] for e in extra])) for k in extra[0]}}
            images[f"{view} {w}x{h}"] = np.stack(frames)
    return out, images


def child(mode: str, store_path: Path, ply: Path, result: Path, cfg: ViewBenchConfig) -> None:
    """One side of the comparison, in this (fresh) process; writes its figures to `result` and
    its frames beside it (`.npz`)."""
    import torch

    from storage import Store
    from tools.ply import open_ply
    from tools.view.render import FrustumRenderer
    from train.render import render

    sets = _view_sets(store_path, cfg.frames)
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if mode.startswith("viewer"):
        store = Store.open(store_path, mode="r", verify="table")
        lod = cfg.lod if mode == "viewer-lod" else 0.0
        renderer = FrustumRenderer(store, int(cfg.cache_mb * 2**20), lod_pixels=lod,
                                   occlusion=mode == "viewer-occlusion")

        def render_one(cam):
            rgb, stats = renderer.render(cam)
            return rgb, {"blocks": stats.blocks, "gaussians": stats.gaussians, "projected": stats.projected,
                         "merged": stats.lod.blocks, "paged_in": stats.paged_in, "mib_read": stats.bytes_read / 2**20,
                         "culled": len(stats.culled), "culled_gaussians": stats.culled_gaussians,
                         "waves": stats.waves}

        figures, images = _frames(render_one, sets)
        figures["store_blocks"] = len(store.table)
        figures["store_gaussians"] = sum(i.count for i in store.table.values())
    else:
        reader = open_ply(ply)
        splats = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in reader.read(0, reader.count).items()}
        sh = int(round(np.sqrt(splats["shN"].shape[1] + 1))) - 1

        def render_one(cam):
            rgb, _, _ = render(splats, cam, sh, None, "cpu")
            return rgb.clamp(0, 1), {"projected": reader.count}

        figures, images = _frames(render_one, sets)
    figures["base_rss_mib"] = base_rss
    result.write_text(json.dumps(figures))
    np.savez(result.with_suffix(".npz"), **images)


def psnr(a: np.ndarray, b: np.ndarray) -> float:  # uint8 frames of one shape
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def _parser() -> argparse.ArgumentParser:
    d = ViewBenchConfig()
    p = argparse.ArgumentParser(prog="python -m tools.bench view", description=__doc__.splitlines()[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--work", type=Path, default=None, help="keep the city, its store and PLY here (default: a temp folder)")
    p.add_argument("--frames", type=int, default=d.frames, help="timed frames per size")
    p.add_argument("--cache-mb", type=float, default=d.cache_mb, help="the viewer's block cache budget")
    p.add_argument("--max-per-block", type=int, default=d.max_per_block, help="octree leaf capacity of the city store")
    p.add_argument("--city-blocks", type=int, default=d.city_blocks, help="city blocks per side")
    p.add_argument("--lod", type=float, default=d.lod, help="the level-of-detail side's --lod (pixels)")
    p.add_argument("--child", nargs=4, metavar=("MODE", "STORE", "PLY", "RESULT"), help=argparse.SUPPRESS)
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    cfg = ViewBenchConfig(args.frames, args.cache_mb, args.max_per_block, args.city_blocks, args.lod)
    if args.child:
        mode, store, ply, result = args.child
        if mode == "city":
            write_city(Path(ply), Path(result), cfg)
        else:
            child(mode, Path(store), Path(ply), Path(result), cfg)
        return 0
    with scratch(args.work) as work:
        store, ply = _prepare(work, cfg)
        results, frames = {}, {}
        for mode in MODES:
            out = work / f"view-{mode}.json"
            run = run_child(python_module("tools.bench", "view", "--child", mode, store, ply, out, *_flags(cfg)),
                            f"bench view {mode}")
            results[mode] = {**json.loads(out.read_text()), "peak_rss_mib": run.max_rss / 2**20}
            frames[mode] = dict(np.load(out.with_suffix(".npz")))
    v, occ, lod, p = (results[m] for m in MODES)
    print(f"city: {v['store_gaussians']:,} Gaussians in {v['store_blocks']} blocks (--max-per-block "
          f"{cfg.max_per_block}); viewer cache {cfg.cache_mb:g} MiB; median of {cfg.frames} frames; "
          f"level of detail --lod {cfg.lod:g}")
    print(f"| | viewer: frustum-paged store | viewer, --occlusion on | viewer, --lod {cfg.lod:g} | "
          "whole PLY in memory |")
    print("|---|---|---|---|---|")
    for w, h in SIZES:
        for view in VIEWS:
            key = f"{view} {w}x{h}"
            a, o, b, c = v[key], occ[key], lod[key], p[key]
            print(f"| {key} ms/frame (max) | {a['ms']:.0f} ({a['ms_max']:.0f}) | {o['ms']:.0f} ({o['ms_max']:.0f}) | "
                  f"{b['ms']:.0f} ({b['ms_max']:.0f}) | {c['ms']:.0f} ({c['ms_max']:.0f}) |")
            print(f"| {key} blocks (merged; culled) / Gaussians projected | {a['blocks']:.1f} / {a['projected']:,.0f} | "
                  f"{o['blocks']:.1f} ({o['culled']:.1f} culled in {o['waves']:.1f} waves) / {o['projected']:,.0f} | "
                  f"{b['blocks']:.1f} ({b['merged']:.1f}) / {b['projected']:,.0f} of {b['gaussians']:,.0f} | "
                  f"all / {c['projected']:,.0f} |")
            print(f"| {key} blocks / MiB paged in | {a['paged_in']:.1f} / {a['mib_read']:.1f} | "
                  f"{o['paged_in']:.1f} / {o['mib_read']:.1f} | {b['paged_in']:.1f} / {b['mib_read']:.1f} | - |")
            exact = [psnr(x, y) for x, y in zip(frames["viewer"][key], frames["ply"][key])]
            culled = [psnr(x, y) for x, y in zip(frames["viewer-occlusion"][key], frames["viewer"][key])]
            merged = [psnr(x, y) for x, y in zip(frames["viewer-lod"][key], frames["viewer"][key])]
            print(f"| {key} PSNR dB against the exact viewer (min) | - | {np.mean(culled):.1f} ({min(culled):.1f}) | "
                  f"{np.mean(merged):.1f} ({min(merged):.1f}) | {np.mean(exact):.1f} ({min(exact):.1f}) |")
            if not all(np.array_equal(x, y) for x, y in zip(frames["viewer-occlusion"][key], frames["viewer"][key])):
                print(f"| {key}: the culled frames DIFFER from the exact viewer's |")
    rss = " | ".join(f"{r['peak_rss_mib']:.0f} ({r['base_rss_mib']:.0f})" for r in (v, occ, lod, p))
    print(f"| peak RSS MiB (after imports) | {rss} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
