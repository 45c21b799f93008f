"""nerfstudio / instant-ngp transforms.json as views in the input frame (OpenGL camera axes converted to OpenCV).

Intrinsics may be global or per frame (`fl_x fl_y cx cy w h`, or `camera_angle_x/y`), with OpenCV
distortion `k1 k2 k3 p1 p2`. Frames whose image is missing are skipped with one warning. A
`ply_file_path` (nerfstudio) gives the point cloud; without one the scene starts from random points
inside `aabb_scale` (instant-ngp's box) or else the cameras' bounds.
"""
from __future__ import annotations

import json
import math
import sys
import warnings
from pathlib import Path

import numpy as np

from train.data.errors import TransformsError
from train.data.fileio import inside, read_text
from train.data.images import image_size
from train.data.intrinsics import Intrinsics, image_size_problem
from train.data.views import RawScene, View, camera_box

_INTRINSIC_KEYS = ("fl_x", "fl_y", "cx", "cy", "w", "h", "camera_angle_x", "camera_angle_y",
                   "k1", "k2", "k3", "p1", "p2")
_PINHOLE_MODELS = ("OPENCV", "PINHOLE", "SIMPLE_PINHOLE")
_IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".PNG", ".JPG", ".JPEG")
OPENGL_TO_OPENCV = np.diag([1.0, -1.0, -1.0, 1.0])  # flips the camera's y and z axes; its own inverse
_NGP_SCALE = 0.33  # instant-ngp's default world-to-unit-cube scale
_FLOAT_MAX = sys.float_info.max


class DatasetWarning(UserWarning):
    """A dataset usable only in part (frames skipped)."""


def transforms_file(path: Path) -> Path:
    return path if path.suffix == ".json" else path / "transforms.json"


def _number(file: Path, where: str, key: str, value) -> float:
    # NaN and inf fail the comparison, and so does an int too large for a float (which would make
    # math.isfinite raise)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not -_FLOAT_MAX <= value <= _FLOAT_MAX:
        raise TransformsError(file, f"{key} must be a finite number, got {value!r:.40}", where)
    return float(value)


def _check_inside(file: Path, where: str, key: str, name: str, allow_external: bool) -> None:
    if not allow_external and not inside(file.parent, name):
        raise TransformsError(file, f"{key} {name!r} lies outside the dataset folder {file.parent} "
                              "(pass --allow-external-images to follow it)", where)


def _image_path(file: Path, where: str, file_path: str) -> Path | None:
    path = file.parent / file_path
    candidates = [path] if path.suffix else [path, *(path.with_suffix(s) for s in _IMAGE_SUFFIXES)]
    try:  # a suffix-less name: instant-ngp's Blender scenes name frames without their extension
        return next((c for c in candidates if c.is_file()), None)
    except OSError as e:  # is_file() lets a name too long for the file system through
        raise TransformsError(file, f"file_path {file_path!r:.80}: {e.strerror or e}", where) from None


def _pose(file: Path, where: str, frame: dict) -> np.ndarray:  # -> [4, 4] world-to-camera, OpenCV
    try:
        c2w = np.array(frame["transform_matrix"], dtype=np.float64)
    except KeyError:
        raise TransformsError(file, "frame has no transform_matrix", where) from None
    except (TypeError, ValueError, OverflowError):  # Overflow: an integer too large for a float
        raise TransformsError(file, "transform_matrix is not a matrix of numbers", where) from None
    if c2w.shape == (3, 4):
        c2w = np.vstack([c2w, [0.0, 0.0, 0.0, 1.0]])
    if c2w.shape != (4, 4):
        raise TransformsError(file, f"transform_matrix has shape {c2w.shape}, not 4x4", where)
    if not np.isfinite(c2w).all():
        raise TransformsError(file, "transform_matrix holds NaN or infinite values", where)
    R = c2w[:3, :3]
    if np.abs(R.T @ R - np.eye(3)).max() > 1e-3 or np.linalg.det(R) < 0:
        raise TransformsError(file, "transform_matrix's rotation is not a rotation (scaled, sheared or mirrored)", where)
    if np.abs(c2w[3] - [0.0, 0.0, 0.0, 1.0]).max() > 1e-6:  # else no rigid pose (and maybe singular)
        raise TransformsError(file, "transform_matrix's last row is not [0, 0, 0, 1]", where)
    return np.linalg.inv(c2w @ OPENGL_TO_OPENCV)


def _intrinsics(file: Path, where: str, meta: dict, frame: dict, image: Path) -> Intrinsics:
    values = {k: _number(file, where, k, frame.get(k, meta.get(k))) for k in _INTRINSIC_KEYS
              if frame.get(k, meta.get(k)) is not None}
    if "w" in values and "h" in values:
        w, h = int(values["w"]), int(values["h"])
    else:
        w, h = image_size(image)
    problem = image_size_problem(w, h)
    if problem:
        raise TransformsError(file, problem, where)
    for key in ("camera_angle_x", "camera_angle_y"):
        if key in values and not 0.0 < values[key] < math.pi:
            raise TransformsError(file, f"{key} must be a field of view in (0, pi) radians, got {values[key]!r}", where)
    if "fl_x" in values:
        fx = values["fl_x"]
    elif "camera_angle_x" in values:
        fx = 0.5 * w / math.tan(0.5 * values["camera_angle_x"])
    else:
        raise TransformsError(file, "no focal length (fl_x or camera_angle_x)", where)
    if "fl_y" in values:
        fy = values["fl_y"]
    elif "camera_angle_y" in values:
        fy = 0.5 * h / math.tan(0.5 * values["camera_angle_y"])
    else:
        fy = fx
    if fx <= 0 or fy <= 0:
        raise TransformsError(file, f"focal length ({fx}, {fy}) is not positive", where)
    dist = tuple(values.get(k, 0.0) for k in ("k1", "k2", "p1", "p2", "k3"))
    return Intrinsics(fx, fy, values.get("cx", w / 2.0), values.get("cy", h / 2.0), w, h, dist)


def _read_ply(file: Path, ply_path: Path) -> tuple[np.ndarray, np.ndarray]:  # [P, 3] float64, [P, 3] uint8
    from plyfile import PlyData

    try:
        vertex = PlyData.read(str(ply_path))["vertex"]
        xyz = np.stack([vertex[c] for c in "xyz"], axis=1).astype(np.float64)
        names = vertex.data.dtype.names
        rgb = (np.stack([vertex[c] for c in ("red", "green", "blue")], axis=1).astype(np.uint8)
               if all(c in names for c in ("red", "green", "blue")) else np.full((len(xyz), 3), 128, np.uint8))
    except Exception as e:  # plyfile raises many types for bad files; all mean the same to the user
        raise TransformsError(ply_path, f"point cloud named by {file.name} is unreadable ({e})") from None
    if not np.isfinite(xyz).all():
        raise TransformsError(ply_path, "point cloud holds NaN or infinite positions")
    return xyz, rgb


def read_transforms_scene(path: Path, allow_external: bool = False, point_cloud: bool = True) -> RawScene:
    """allow_external: follow file_path / ply_file_path values outside the dataset folder.
    point_cloud False: cameras only, the ply_file_path is neither read nor checked."""
    file = transforms_file(path)
    try:
        meta = json.loads(read_text(file, TransformsError))
    except json.JSONDecodeError as e:
        raise TransformsError(file, f"not JSON: {e.msg}", f"line {e.lineno} column {e.colno}") from None
    except (ValueError, RecursionError) as e:  # a number of over 4300 digits; arrays nested too deep
        raise TransformsError(file, f"not JSON that can be read: {e}") from None
    frames = meta.get("frames") if isinstance(meta, dict) else None
    if not isinstance(frames, list) or not frames:
        raise TransformsError(file, "no frames (expected a non-empty list under \"frames\")")
    model = meta.get("camera_model", "OPENCV")
    if model not in _PINHOLE_MODELS:
        raise TransformsError(file, f"camera_model {model!r} is not supported (supported: {', '.join(_PINHOLE_MODELS)})")
    views, missing = [], []
    for i, frame in enumerate(frames):
        where = f"frames[{i}]"
        if not isinstance(frame, dict) or not isinstance(frame.get("file_path"), str):
            raise TransformsError(file, "frame is not an object with a file_path string", where)
        where = f"frames[{i}] ({frame['file_path']})"
        viewmat = _pose(file, where, frame)
        _check_inside(file, where, "file_path", frame["file_path"], allow_external)
        image = _image_path(file, where, frame["file_path"])
        if image is None:
            missing.append(frame["file_path"])
            continue
        views.append(View(frame["file_path"], i, viewmat, _intrinsics(file, where, meta, frame, image),
                          image.parent, image.name))
    if not views:
        raise TransformsError(file, f"none of the {len(frames)} frames has its image file")
    if missing:  # stacklevel: the caller of load_scene
        warnings.warn(f"{file}: skipped {len(missing)} of {len(frames)} frames whose image is missing "
                      f"(first: {missing[0]})", DatasetWarning, stacklevel=4)
    names = [v.name for v in views]
    if len(set(names)) != len(names):
        raise TransformsError(file, "two frames name the same file_path")
    if "ply_file_path" in meta and point_cloud:
        _check_inside(file, "ply_file_path", "ply_file_path", str(meta["ply_file_path"]), allow_external)
        points, colors = _read_ply(file, file.parent / str(meta["ply_file_path"]))
    else:
        points, colors = np.zeros((0, 3)), np.zeros((0, 3), np.uint8)
    if "aabb_scale" in meta:
        scale = _number(file, "scale", "scale", meta.get("scale", _NGP_SCALE))
        aabb_scale = _number(file, "aabb_scale", "aabb_scale", meta["aabb_scale"])
        if not (aabb_scale > 0 and scale > 0):
            raise TransformsError(file, f"aabb_scale {aabb_scale!r} and scale {scale!r} must be positive "
                                  "(random points fill a box aabb_scale / scale wide)")
        half = aabb_scale / (2.0 * scale)
        box = np.array([[-half] * 3, [half] * 3])
    else:
        box = camera_box(views)
    return RawScene("transforms", file, views, points, colors, box)
