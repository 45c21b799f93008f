"""Datasets made of copies of the wall dataset (the trainer benchmarks' scenes that grow without a
camera seeing more of them)."""
from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from plyfile import PlyData, PlyElement

WALL_GAP = 10.0  # metres between neighbouring walls of a grid: no camera sees past its own wall


def make_wall(work: Path, options: Sequence[str]) -> Path:
    """The `tools.make_scene wall` dataset with `options` (its command-line flags), made once per
    work folder (named after them). Raises SceneError for bad options."""
    from tools.make_scene import scene_request  # the CLI's parsing of the flags
    from tools.scenes.make import make_scene

    out = work / "-".join(["wall", *(o.lstrip("-") for o in options)])
    if not (out / "transforms.json").is_file():
        kind, _, cfg = scene_request(["wall", str(out), "--overwrite", *options])
        make_scene(kind, out, cfg)
    return out


def wall_grid(base: Path, out: Path, copies: int) -> Path:
    """`copies` of the wall dataset `base` as one dataset: walls side by side along x and stacked
    along z (storeys in the air), WALL_GAP apart; frames and points shifted, images linked (a
    camera's photo is the same at every wall). A grid, not one long row: the tiler normalises the
    scene to a few units across and the renderer drops what is nearer than 0.01 units, so a
    3 km row would put the wall in front of every camera inside the near plane."""
    if (out / "transforms.json").is_file():
        return out
    meta = json.loads((base / "transforms.json").read_text())
    points = PlyData.read(str(base / meta["ply_file_path"]))["vertex"].data
    pitch = {axis: float(points[axis].max() - points[axis].min()) + WALL_GAP for axis in "xz"}
    columns = int(np.ceil(np.sqrt(copies)))
    (out / "images").mkdir(parents=True)
    parts, frames = [], []
    for k in range(copies):
        offset = {"x": (k % columns) * pitch["x"], "z": (k // columns) * pitch["z"]}
        shifted = points.copy()
        for axis, d in offset.items():
            shifted[axis] += d
        parts.append(shifted)
        for frame in meta["frames"]:
            name = f"images/c{k:03d}_{Path(frame['file_path']).name}"
            os.symlink((base / frame["file_path"]).resolve(), out / name)
            c2w = np.array(frame["transform_matrix"], dtype=np.float64)
            c2w[[0, 2], 3] += [offset["x"], offset["z"]]
            frames.append({**frame, "file_path": name, "transform_matrix": c2w.tolist()})
    PlyData([PlyElement.describe(np.concatenate(parts), "vertex")], byte_order="<").write(str(out / "points3d.ply"))
    (out / "transforms.json").write_text(json.dumps({**meta, "frames": frames, "ply_file_path": "points3d.ply"}))
    return out


def wall_points(base: Path) -> int:
    """Points (hence initial Gaussians) of one wall of a grid."""
    return int(PlyData.read(str(base / "points3d.ply"))["vertex"].count)
