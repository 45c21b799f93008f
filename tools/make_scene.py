"""python -m tools.make_scene {wall,city,object} OUT [options]: render a generated scene as a nerfstudio dataset."""
from __future__ import annotations

import argparse
import sys

import numpy as np

from tools.scenes import KINDS, SceneConfig, SceneError, SceneInfo, make_scene


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tools.make_scene",
        description="Write a generated scene as a nerfstudio dataset: transforms.json, images/*.png rendered "
        "with the CPU renderer, points3d.ply (a noisy subsample of the ground truth) and ground_truth.npz.",
    )
    p.add_argument("kind", choices=KINDS, help="wall: a 40 m facade seen by a row of cameras (tests, demos); "
                   "city: a 2 x 2-block street-level city (benchmarks); object: a cube and a ball seen from all "
                   "around (training from random points)")
    p.add_argument("out", help="dataset folder to create")
    p.add_argument("--seed", type=int, default=0, help="the same seed gives the same files")
    p.add_argument("--width", type=int, help="image width (wall and object 160, city 320)")
    p.add_argument("--height", type=int, help="image height (wall and object 120, city 180)")
    p.add_argument("--cameras", type=int, help="number of cameras (wall 24, object 32, city 64)")
    p.add_argument("--gaussians", type=int, help="ground-truth Gaussians (wall and object 30000, city about 125000)")
    p.add_argument("--sh-degree", type=int, default=SceneConfig.sh_degree, help="SH degree of the ground truth")
    p.add_argument("--wall-length", type=float, default=SceneConfig.wall_length,
                   help="wall: length in metres; each camera sees about 7 m of it")
    p.add_argument("--overwrite", action="store_true", help="replace a scene already at OUT")
    return p


def format_summary(info: SceneInfo) -> str:
    cam = info.cameras[0]
    lo, median, hi = np.percentile(info.visible * 100, [0, 50, 100])
    return "\n".join([
        f"scene         {info.kind}",
        f"dataset       {info.out_dir}",
        f"Gaussians     {info.gaussians:,}",
        f"points        {info.points:,}",
        f"cameras       {len(info.cameras)} ({len(info.test_names)} held out), {cam.width} x {cam.height}",
        f"visible       min {lo:.1f}% / median {median:.1f}% / max {hi:.1f}% of the Gaussians per camera",
        f"time          {info.seconds:.1f} s",
    ])


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        cfg = SceneConfig(seed=args.seed, width=args.width, height=args.height, cameras=args.cameras,
                          gaussians=args.gaussians, sh_degree=args.sh_degree, wall_length=args.wall_length,
                          overwrite=args.overwrite)
        info = make_scene(args.kind, args.out, cfg)
    except (SceneError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(format_summary(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
