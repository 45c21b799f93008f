"""`python -m tools.export STORE --out scene.ply [--format ply|ply_compressed] [--frame input|store]`

Streams the last commit of a store block by block (memory bounded by the largest block) into the
standard 3DGS PLY that `gsplat.export_splats` writes, or SuperSplat's compressed PLY, in the
input's original frame (the store keeps the normalising transform applied at tiling time).
"""
from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import numpy as np

from octree.keys import parse_key
from storage import Store, StoreError
from tools.frames import transform_gaussians
from tools.leftovers import LeftoverWarning
from tools.ply import CompressedPlyWriter, GaussianPlyWriter, PlyError
from train.cli import HelpFormatter


def export(store_path: str, out: str | Path, fmt: str = "ply", frame: str = "input") -> int:
    """Write the store's Gaussians to `out`; returns how many were written."""
    store = Store.open(store_path, mode="r")
    if store.head is None:
        raise StoreError(f"{store_path}: nothing committed yet, nothing to export")
    sh_degree = int(store.attrs["sh_degree"])
    T = np.asarray(store.attrs.get("world_transform", np.eye(4)), dtype=np.float64)
    to_output = np.linalg.inv(T) if frame == "input" else np.eye(4)
    keys = sorted(store.table, key=lambda k: parse_key(k).morton_rank())
    count = sum(store.table[k].count for k in keys)
    writer_type = CompressedPlyWriter if fmt == "ply_compressed" else GaussianPlyWriter
    with writer_type(out, count, sh_degree) as writer:
        for key in keys:
            writer.write(transform_gaussians(store.read_params(key), to_output, sh_degree))
    return count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(formatter_class=HelpFormatter, prog="python -m tools.export", description=__doc__.split("\n\n")[1])
    parser.add_argument("store", help="scene store (written by tools.tile, trained by train)")
    parser.add_argument("--out", required=True, help="output .ply path")
    parser.add_argument("--format", choices=("ply", "ply_compressed"), default="ply",
                        help="ply: the standard 3DGS PLY; ply_compressed: the SuperSplat/PlayCanvas compressed PLY")
    parser.add_argument("--frame", choices=("input", "store"), default="input",
                        help="coordinates of the input that was tiled (default) or the store's normalised frame")
    args = parser.parse_args(argv)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", LeftoverWarning)
            n = export(args.store, args.out, args.format, args.frame)
    except (StoreError, PlyError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for w in caught:  # one line each, as errors are
        print(f"warning: {w.message}", file=sys.stderr)
    print(f"wrote {n:,} Gaussians to {args.out} ({args.format}, {args.frame} frame)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
