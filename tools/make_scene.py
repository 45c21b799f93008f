"""python -m tools.make_scene {wall,city,object} OUT [options]: render a generated scene as a nerfstudio dataset."""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import NoReturn

import numpy as np

from tools.scenes import KINDS, SceneConfig, SceneError, SceneInfo, make_scene
from tools.scenes.city import CAPTURES
from train.cli import HelpFormatter


class _Parser(argparse.ArgumentParser):
    """Bad flags are bad input like any other: one `error:` line and exit 1, before any work."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {message}", file=sys.stderr)
        sys.exit(1)


def parse_count(text: str) -> int:
    """A positive whole number, also written as 2e6 or 2_000_000."""
    try:
        value = float(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of Gaussians, got {text!r}") from None
    if not math.isfinite(value) or value != int(value) or value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive whole number, got {text!r}")
    return int(value)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m tools.make_scene",
        formatter_class=HelpFormatter,
        description="Write a generated scene as a nerfstudio dataset: transforms.json, images/*.png rendered "
        "with the CPU renderer, points3d.ply (a noisy subsample of the ground truth) and the ground truth "
        "(wall, object: ground_truth.npz; city: a scene store under --work, named in scene.json).",
    )
    p.add_argument("kind", choices=KINDS, help="wall: a 60 m facade seen by a row of cameras (tests, demos); "
                   "city: a street-level city of any size, generated and rendered block by block; object: a cube "
                   "and a ball seen from all around (training from random points)")
    p.add_argument("out", type=Path, help="dataset folder to create")
    p.add_argument("--seed", type=int, default=0, help="the same seed gives the same files")
    p.add_argument("--width", type=int, help="image width (default: wall and object 160, city 320)")
    p.add_argument("--height", type=int, help="image height (default: wall and object 120, city 180)")
    p.add_argument("--cameras", type=int, help="number of cameras (default: wall 24, object 32, city 64)")
    p.add_argument("--gaussians", type=parse_count, help="ground-truth Gaussians, e.g. 2e6; the city makes about "
                   "this many, growing in city blocks (default: wall and object 30000, city 2 x 2 blocks, "
                   "about 126000)")
    p.add_argument("--sh-degree", type=int, default=SceneConfig.sh_degree, help="SH degree of the ground truth")
    p.add_argument("--point-fraction", type=float, default=SceneConfig.point_fraction,
                   help="share of the ground-truth means that become the initial point cloud")
    p.add_argument("--wall-length", type=float, default=SceneConfig.wall_length,
                   help="wall: length in metres; each camera sees about 7 m of it")
    p.add_argument("--work", type=Path, help="city: folder for the ground-truth store and scratch files "
                   "(default: OUT.work beside OUT)")
    p.add_argument("--clean", action="store_true", help="city: remove what the run made under --work (the "
                   "ground-truth store included) once the dataset is written")
    p.add_argument("--cache-mb", type=float, default=SceneConfig.cache_mb,
                   help="city: block cache for rendering the images by paging the ground-truth store")
    p.add_argument("--aerial", type=float, default=SceneConfig.aerial, help="city: share of aerial cameras")
    p.add_argument("--capture", choices=CAPTURES, default=SceneConfig.capture,
                   help="city: street cameras plus the --aerial share, or a drone's double-grid oblique survey "
                   "whose images each see a bounded patch of the city (its camera count follows from the city's "
                   "size, --altitude and --overlap)")
    p.add_argument("--altitude", type=float, default=SceneConfig.altitude, help="city survey: flying height (m)")
    p.add_argument("--pitch", type=float, default=SceneConfig.pitch,
                   help="city survey: camera pitch in degrees, negative is down; the image's top must look below "
                   "the horizon")
    p.add_argument("--overlap", type=float, default=SceneConfig.overlap,
                   help="city survey: overlap of neighbouring images, along and across the flight lines")
    p.add_argument("--block-gaussians", type=int, default=SceneConfig.block_gaussians,
                   help="city: expected Gaussians per generation tile (what one tile holds in memory)")
    p.add_argument("--overwrite", action="store_true", help="replace a scene already at OUT")
    return p


def scene_request(argv: list[str] | None = None) -> tuple[str, Path, SceneConfig]:
    """The kind, output folder and config the command line asks for (SceneError for a bad config;
    exit 1 for bad flags)."""
    a = _parser().parse_args(argv)
    cfg = SceneConfig(seed=a.seed, width=a.width, height=a.height, cameras=a.cameras, gaussians=a.gaussians,
                      sh_degree=a.sh_degree, point_fraction=a.point_fraction, wall_length=a.wall_length,
                      overwrite=a.overwrite, work=a.work, clean=a.clean, cache_mb=a.cache_mb, aerial=a.aerial,
                      block_gaussians=a.block_gaussians,
                      capture=a.capture, altitude=a.altitude, pitch=a.pitch, overlap=a.overlap)
    return a.kind, a.out, cfg


def format_summary(info: SceneInfo) -> str:
    cam = info.cameras[0]
    lo, median, hi = np.percentile(info.visible * 100, [0, 50, 100])
    lines = [
        f"scene         {info.kind}",
        f"dataset       {info.out_dir}",
        f"Gaussians     {info.gaussians:,}",
        f"points        {info.points:,}",
        f"cameras       {len(info.cameras)} ({len(info.test_names)} held out), {cam.width} x {cam.height}",
        f"visible       min {lo:.1f}% / median {median:.1f}% / max {hi:.1f}% of the Gaussians per camera",
    ]
    time = f"time          {info.seconds:.1f} s"
    if info.kind == "city":
        lines.append(f"ground truth  {info.blocks:,} blocks, {info.ground_truth or 'removed (--clean)'}")
        lines.append(f"largest view  {info.largest_view:,} splats")
        lines.append(f"peak RSS      {info.peak_rss['ground_truth'] / 2**20:,.0f} MiB after the ground truth, "
                     f"{info.peak_rss['images'] / 2**20:,.0f} MiB after the images")
        time += f" (ground truth {info.phases['ground_truth']:.1f} s, images {info.phases['images']:.1f} s)"
    return "\n".join(lines + [time])


def main(argv: list[str] | None = None) -> int:
    try:
        kind, out, cfg = scene_request(argv)
        info = make_scene(kind, out, cfg)
    except (SceneError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(format_summary(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
