"""Writing a generated dataset: nerfstudio's transforms.json, the initial point cloud as a binary PLY
(whole, or streamed in pieces), the wall and object kinds' ground_truth.npz, and the output folder
that appears complete or not at all."""
from __future__ import annotations

import json
import os
import shutil
import zipfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from PIL import Image

from tools.scenes.config import SceneError
from train.camera import Camera
from train.data.transforms import OPENGL_TO_OPENCV

GROUND_TRUTH = "ground_truth.npz"  # the wall's and the object's ground truth
SCENE_JSON = "scene.json"  # the city's: what was made, and where its ground-truth store is
POINTS = "points3d.ply"
_ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)  # fixed member timestamps, so the same scene gives the same npz bytes
POINT_DTYPE = np.dtype([(c, "<f4") for c in "xyz"] + [(c, "u1") for c in ("red", "green", "blue")])


def check_output(out: Path, overwrite: bool) -> None:
    if not out.exists():
        return
    if not overwrite:
        raise SceneError(f"{out}: already exists (pass overwrite / --overwrite to replace it)")
    # Replacing a folder is destructive: only a scene this tool wrote (or nothing at all) goes.
    ours = (out / GROUND_TRUTH).is_file() or (out / SCENE_JSON).is_file()
    if not out.is_dir() or (any(out.iterdir()) and not ours):
        raise SceneError(f"{out}: exists and is not a generated scene (no {GROUND_TRUTH} or {SCENE_JSON}); "
                         f"not replacing it")


def partial_dir(out: Path) -> Path:
    return out.with_name(f".{out.name}.partial-{os.getpid()}")


def replace_dir(partial: Path, out: Path) -> None:
    """Move the finished `partial` folder to `out`, setting an old scene aside until the move is done."""
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        os.replace(out, old)
    try:
        os.replace(partial, out)
    except OSError:
        if old.exists():
            os.replace(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def save_png(rgb: np.ndarray, path: Path) -> None:  # rgb [H, W, 3] float in [0, 1]
    pixels = np.round(np.clip(rgb, 0.0, 1.0) * 255.0).astype(np.uint8)
    Image.fromarray(pixels, "RGB").save(path, format="PNG")


def write_transforms(path: Path, cameras: list[Camera]) -> None:
    """nerfstudio's layout: shared pinhole intrinsics (every camera of a scene has the same K) and
    camera-to-world matrices in OpenGL camera axes (x right, y up, z backwards)."""
    cam = cameras[0]
    K = cam.K
    meta = {
        "camera_model": "PINHOLE",
        "fl_x": K[0, 0], "fl_y": K[1, 1], "cx": K[0, 2], "cy": K[1, 2], "w": cam.width, "h": cam.height,
        "ply_file_path": POINTS,
        "frames": [{"file_path": c.name, "transform_matrix": (c.camtoworld @ OPENGL_TO_OPENCV).tolist()}
                   for c in cameras],
    }
    path.write_text(json.dumps(meta, indent=1))


def point_rows(xyz: np.ndarray, rgb: np.ndarray) -> np.ndarray:  # xyz [P, 3] float32, rgb [P, 3] uint8
    rows = np.empty(len(xyz), dtype=POINT_DTYPE)
    for j, c in enumerate("xyz"):
        rows[c] = xyz[:, j]
    for j, c in enumerate(("red", "green", "blue")):
        rows[c] = rgb[:, j]
    return rows


def _ply_header(count: int) -> bytes:
    """What plyfile writes for a binary little-endian `vertex` element of POINT_DTYPE."""
    lines = ["ply", "format binary_little_endian 1.0", f"element vertex {count}"]
    lines += [f"property float {c}" for c in "xyz"] + [f"property uchar {c}" for c in ("red", "green", "blue")]
    return ("\n".join(lines + ["end_header"]) + "\n").encode("ascii")


def write_points(path: Path, xyz: np.ndarray, rgb: np.ndarray) -> None:  # xyz [P, 3] float32, rgb [P, 3] uint8
    with open(path, "wb") as f:
        f.write(_ply_header(len(xyz)))
        f.write(point_rows(xyz, rgb).tobytes())


class PointSpool:
    """A point cloud written in pieces: rows go to a scratch file, and `finish` writes the PLY
    (its header needs the count) by copying them after it. Memory: one piece."""

    def __init__(self, scratch: Path) -> None:
        self.scratch = scratch
        self.count = 0
        self._file = open(scratch, "wb")

    def add(self, xyz: np.ndarray, rgb: np.ndarray) -> None:
        self._file.write(point_rows(xyz, rgb).tobytes())
        self.count += len(xyz)

    def finish(self, path: Path) -> None:
        self._file.close()
        with open(path, "wb") as out, open(self.scratch, "rb") as rows:
            out.write(_ply_header(self.count))
            shutil.copyfileobj(rows, out, 1 << 22)
        self.scratch.unlink()

    def close(self) -> None:
        self._file.close()


def write_npz(path: Path, arrays: Mapping[str, np.ndarray]) -> None:
    # np.savez stamps members with the current time; fixed stamps keep a scene's bytes reproducible.
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, array in arrays.items():
            info = zipfile.ZipInfo(f"{name}.npy", date_time=_ZIP_EPOCH)
            info.compress_type = zipfile.ZIP_DEFLATED
            with archive.open(info, "w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.asarray(array), allow_pickle=False)
