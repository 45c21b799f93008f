"""A walled scene for the occlusion tests and benchmark: an opaque wall with a square gap, a row of
cameras in front of it, and clusters of Gaussians behind it. Two clusters lie where no camera can
see them through the gap (`HIDDEN`); one lies right behind the gap, seen by every camera (`SEEN`).

`make_walled(root)` writes a transforms.json dataset (images rendered from the ground truth with
the CPU renderer) and the Gaussians as a 3DGS PLY, and tiles the PLY into a store; the store's
Gaussians are the ground truth with perturbed colours, so training changes them.
"""
from __future__ import annotations

import contextlib
import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from octree.semantics import SH_C0
from tools.ply import write_ply
from tools.tile.__main__ import main as tile_main
from train.camera import Camera
from train.data.transforms import OPENGL_TO_OPENCV
from train.render import render

WIDTH, HEIGHT, FOV_X = 64, 48, 60.0
WALL_Y = 0.0
GAP = (0.3, 1.5, 1.3, 2.5)  # x0, z0, x1, z1 of the hole in the wall
# Clusters behind the wall as boxes (x0, y0, z0, x1, y1, z1): the rays through the gap from the
# cameras (x in [-1, 1], y = -6, z = 2) meet y = 3 within x in [-0.05, 2.45], z in [1.25, 2.75].
HIDDEN = ((-4.0, 2.5, 1.5, -3.0, 3.5, 2.5), (4.0, 2.5, 1.5, 5.0, 3.5, 2.5))
SEEN = (0.9, 2.8, 1.7, 1.5, 3.2, 2.3)


@dataclass
class Walled:
    data: Path  # transforms.json dataset
    store: Path  # tiled store (copy it before training)
    cameras: list[Camera]


def walled_cameras(n: int = 8) -> list[Camera]:
    """n cameras at y = -6, z = 2, x in [-1, 1], looking along +y (OpenCV axes: z forward, y down)."""
    f = 0.5 * WIDTH / np.tan(np.radians(FOV_X) / 2)
    K = np.array([[f, 0.0, WIDTH / 2], [0.0, f, HEIGHT / 2], [0.0, 0.0, 1.0]])
    R = np.array([[1.0, 0.0, 0.0], [0.0, 0.0, -1.0], [0.0, 1.0, 0.0]])  # rows: right, down, forward
    cams = []
    for i, x in enumerate(np.linspace(-1.0, 1.0, n)):
        viewmat = np.eye(4)
        viewmat[:3, :3], viewmat[:3, 3] = R, -R @ np.array([x, -6.0, 2.0])
        cams.append(Camera(viewmat, K, WIDTH, HEIGHT, i, f"cam_{i:03d}.png"))
    return cams


def walled_gaussians(seed: int = 0, hidden: int = 300) -> dict[str, np.ndarray]:
    """Gaussians (gsplat's names, SH degree 0): two layers of an opaque wall, and the clusters
    (`hidden` Gaussians in each hidden one, 300 in the one behind the gap)."""
    rng = np.random.default_rng(seed)
    xs, zs = np.meshgrid(np.arange(-5.5, 5.5, 0.2), np.arange(-1.2, 5.2, 0.2), indexing="ij")
    xs, zs = xs.ravel(), zs.ravel()
    in_gap = (xs > GAP[0]) & (xs < GAP[2]) & (zs > GAP[1]) & (zs < GAP[3])
    xs, zs = xs[~in_gap], zs[~in_gap]
    wall = np.concatenate([np.stack([xs, np.full_like(xs, WALL_Y + dy), zs], 1) for dy in (0.0, 0.05)])
    boxes = [*HIDDEN, SEEN]
    clusters = [rng.uniform(b[:3], b[3:], (hidden if b in HIDDEN else 300, 3)) for b in boxes]
    means = np.concatenate([wall, *clusters]).astype(np.float32)
    n, n_wall = len(means), len(wall)
    log_scales = np.full((n, 3), np.log(0.2), np.float32)
    log_scales[n_wall:] = np.log(0.06)
    opacity = np.full(n, 0.98, np.float32)
    opacity[n_wall:] = 0.9
    rgb = rng.uniform(0.1, 0.9, (n, 3)).astype(np.float32)
    return {
        "means": means,
        "scales": log_scales + rng.uniform(-0.1, 0.1, (n, 3)).astype(np.float32),
        "quats": rng.standard_normal((n, 4)).astype(np.float32),
        "opacities": np.log(opacity / (1 - opacity)).astype(np.float32),
        "sh0": ((rgb - 0.5) / SH_C0)[:, None, :].astype(np.float32),
        "shN": np.zeros((n, 0, 3), np.float32),
    }


def make_walled(root: Path, max_per_block: int = 300, hidden: int = 300) -> Walled:
    data, store = root / "data", root / "walled.zarr"
    (data / "images").mkdir(parents=True)
    gt = walled_gaussians(hidden=hidden)
    cams = walled_cameras()
    splats = {k: torch.from_numpy(v) for k, v in gt.items()}
    frames = []
    with torch.no_grad():
        for cam in cams:
            rgb, _, _ = render(splats, cam, 0, None, backend="cpu")
            pixels = np.round(rgb.clamp(0.0, 1.0).numpy() * 255.0).astype(np.uint8)
            Image.fromarray(pixels, "RGB").save(data / "images" / cam.name)
            frames.append({"file_path": f"images/{cam.name}",
                           "transform_matrix": (cam.camtoworld @ OPENGL_TO_OPENCV).tolist()})
    K = cams[0].K
    (data / "transforms.json").write_text(json.dumps({
        "camera_model": "PINHOLE", "fl_x": K[0, 0], "fl_y": K[1, 1], "cx": K[0, 2], "cy": K[1, 2],
        "w": WIDTH, "h": HEIGHT, "frames": frames}))
    start = dict(gt)
    rng = np.random.default_rng(1)
    start["sh0"] = (gt["sh0"] + rng.normal(0.0, 0.3, gt["sh0"].shape)).astype(np.float32)
    write_ply(root / "start.ply", start)
    with contextlib.redirect_stdout(io.StringIO()):  # the tiler's summary
        assert tile_main([str(root / "start.ply"), "--out", str(store), "--max-per-block", str(max_per_block)]) == 0
    return Walled(data, store, cams)


def blocks_within(table: dict, box: tuple) -> list[str]:
    """Keys of the blocks whose Gaussians' means all lie in `box` (x0, y0, z0, x1, y1, z1)."""
    lo, hi = np.array(box[:3]), np.array(box[3:])
    return sorted(k for k, info in table.items()
                  if (np.array(info.tight[:3]) >= lo).all() and (np.array(info.tight[3:]) <= hi).all())


def blocks_meeting(table: dict, box: tuple) -> list[str]:
    """Keys of the blocks whose means' box meets `box`."""
    lo, hi = np.array(box[:3]), np.array(box[3:])
    return sorted(k for k, info in table.items()
                  if (np.array(info.tight[:3]) <= hi).all() and (np.array(info.tight[3:]) >= lo).all())
