"""`python -m train.data PATH`: check a dataset and print what training would see."""
from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import numpy as np

from train.cli import HelpFormatter
from train.data.config import DataConfig
from train.data.errors import DatasetError
from train.data.scene import SceneData, load_scene


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _test_every(text: str) -> int:
    value = int(text)
    if value < 0 or value == 1:
        raise argparse.ArgumentTypeError(f"must be 0 (no test split) or at least 2, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(formatter_class=HelpFormatter, prog="python -m train.data", description=__doc__)
    p.add_argument("path", type=Path, help="dataset folder (COLMAP sparse/ + images/, or transforms.json)")
    p.add_argument("--data-factor", type=_positive, default=1, help="downscale images by this factor")
    p.add_argument("--test-every", type=_test_every, default=8, help="hold out every Nth image (0: none)")
    p.add_argument("--no-normalize", action="store_true", help="keep the input's world frame")
    p.add_argument("--allow-external-images", action="store_true",
                   help="follow image paths that lead out of the dataset (transforms.json file_path, COLMAP image names)")
    p.add_argument("--cache-dir", type=Path, default=None, help="where downscaled/undistorted images go (default: images_<N>/ beside images/, or ~/.cache/octosplat/ where the dataset is read-only)")
    p.add_argument("--load-images", action="store_true",
                   help="load every image once (fills the cache and proves every image decodes)")
    return p


def summary(scene: SceneData) -> str:
    cams = scene.cameras
    sizes = sorted({(c.width, c.height) for c in cams})
    focals = np.array([[c.K[0, 0], c.K[1, 1]] for c in cams])
    kind = "random (no point cloud in the input)" if scene.random_points else "from the input"
    return "\n".join([
        f"dataset      {scene.source} ({scene.kind})",
        f"cameras      {len(cams)}: {len(scene.train_cameras)} train, {len(scene.test_cameras)} test "
        f"({', '.join(c.name for c in scene.test_cameras[:5])}{' ...' if len(scene.test_cameras) > 5 else ''})",
        f"image sizes  {', '.join(f'{w}x{h}' for w, h in sizes[:4])}{' ...' if len(sizes) > 4 else ''}",
        f"focal (px)   {focals.min():.2f} .. {focals.max():.2f}",
        f"points       {len(scene.points)} {kind}",
        f"scene scale  {scene.scene_scale:.4f}",
        "world transform (input -> scene frame)",
        np.array2string(scene.world_transform, precision=6, suppress_small=True),
    ])


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    cfg = DataConfig(data_factor=args.data_factor, test_every=args.test_every, normalize=not args.no_normalize,
                     cache_dir=args.cache_dir, allow_external_images=args.allow_external_images)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            scene = load_scene(args.path, cfg)
        for w in caught:
            print(f"warning: {w.message}", file=sys.stderr)
        print(summary(scene))
        if args.load_images:
            with scene.prefetcher(scene.cameras) as images:
                count = sum(1 for _ in images)
            print(f"loaded       {count} images")
    except DatasetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
