"""python -m tools.tile SRC --out STORE [options]: build a scene store from points or trained Gaussians."""
from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from octree.keys import MAX_DEPTH
from storage import StoreError
from tools.leftovers import LeftoverWarning
from tools.ply import PlyError
from tools.tile.config import TileConfig, TileError
from tools.tile.pipeline import TileSummary, tile
from train.cli import HelpFormatter

_PROGRESS_ROWS = 1_000_000  # show progress bars from this many input rows (on a terminal)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        formatter_class=HelpFormatter,
        prog="python -m tools.tile",
        description="Build an OctoSplat scene store from a COLMAP or transforms.json dataset, a point-cloud "
        "PLY, a trained 3DGS PLY (standard or compressed) or an npz with means3d and colors.",
    )
    p.add_argument("src", type=Path, help="input: dataset folder, transforms.json, .ply or .npz")
    p.add_argument("--out", type=Path, required=True, help="store to create (a folder)")
    p.add_argument("--max-per-block", type=int, default=TileConfig.max_per_block, help="Gaussians per block at most")
    p.add_argument("--min-cell-size", type=float, help=f"do not split cells narrower than this (default: {MAX_DEPTH} levels)")
    p.add_argument("--sh-degree", type=int, help="SH degree (default: the trained PLY's, or 3 for points)")
    p.add_argument("--data-factor", type=int, default=1, help="image downscale factor for datasets")
    p.add_argument("--voxel-size", type=float, help="average point clouds in voxels of this size first (open3d; default: no averaging)")
    p.add_argument("--init-random", type=int, default=TileConfig.init_random, help="Gaussians for datasets without points")
    p.add_argument("--init-opacity", type=float, default=TileConfig.init_opacity,
                   help="opacity of Gaussians from points (gsplat's mcmc preset: 0.5)")
    p.add_argument("--init-scale", type=float, default=TileConfig.init_scale,
                   help="factor on their initial scale, the RMS distance to the 3 nearest points (gsplat's mcmc preset: 0.1)")
    p.add_argument("--seed", type=int, default=0, help="seed of random initialisation")
    p.add_argument("--memory-mb", type=float, default=TileConfig.memory_mb, help="working memory (bigger inputs: sort on disk)")
    p.add_argument("--scratch", type=Path, help="folder for the on-disk sort (default: next to --out)")
    p.add_argument("--allow-external-images", action="store_true",
                   help="follow image paths that lead out of the dataset (transforms.json file_path, COLMAP image names)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing store at --out")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, help="progress bars (default: large inputs on a tty)")
    return p


def format_summary(s: TileSummary) -> str:
    lo, median, hi = s.per_block
    lines = [
        f"source        {s.source}",
        f"store         {s.out}",
        f"Gaussians     {s.gaussians:,}" + (f"  ({s.dropped:,} rows with NaN/inf values dropped)" if s.dropped else ""),
        f"blocks        {s.blocks:,}  (depth {s.depths[0]}..{s.depths[1]})",
        f"per block     min {lo:,} / median {median:,.0f} / max {hi:,}",
        f"SH degree     {s.sh_degree}",
        f"sort          {'in memory' if s.runs == 1 else f'{s.runs} runs on disk'}",
        f"on disk       {s.bytes_on_disk / 2**20:,.1f} MiB  (raw float32 {s.raw_bytes / 2**20:,.1f} MiB: "
        f"compression {s.compression_ratio:.2f}x)",
        f"time          {s.seconds:.1f} s  (octree build {s.build_seconds:.2f} s)",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    caught: list[warnings.WarningMessage] = []
    try:
        cfg = TileConfig(
            max_per_block=args.max_per_block,
            min_cell_size=args.min_cell_size,
            sh_degree=args.sh_degree,
            memory_mb=args.memory_mb,
            overwrite=args.overwrite,
            voxel_size=args.voxel_size,
            init_random=args.init_random,
            data_factor=args.data_factor,
            init_opacity=args.init_opacity,
            init_scale=args.init_scale,
            seed=args.seed,
            scratch=args.scratch,
            allow_external_images=args.allow_external_images,
        )
        progress = args.progress if args.progress is not None else sys.stderr.isatty() and _large(args.src)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", UserWarning)
            summary = tile(args.src, args.out, cfg, progress=progress)
    except (TileError, PlyError, StoreError, OSError) as e:
        # Other warnings of a failed run are about input it refused; what it removed is said anyway.
        _print_warnings([w for w in caught if issubclass(w.category, LeftoverWarning)])
        print(f"error: {e}", file=sys.stderr)
        return 1
    _print_warnings(caught)
    print(format_summary(summary))
    return 0


def _print_warnings(caught: list[warnings.WarningMessage]) -> None:
    for w in caught:  # one line each, as errors are, not Python's two-line format
        print(f"warning: {w.message}", file=sys.stderr)


def _large(src: Path) -> bool:
    """Whether the input looks big enough for progress bars (by file size: ~50 bytes a row)."""
    try:
        return src.is_file() and src.stat().st_size > 50 * _PROGRESS_ROWS
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main())
