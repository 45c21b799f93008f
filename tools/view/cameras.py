"""Cameras the viewer renders from: the dataset's (in the store's frame), an orbit around the
scene, or the browser's; all as the pinhole `Camera` the renderer and culling take."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from storage import Store
from train.camera import Camera
from train.config import TrainConfig
from train.trainer import TrainError, load_cameras
from tools.view.config import ViewError


@dataclass(frozen=True)
class DatasetCameras:
    train: list[Camera]
    test: list[Camera]

    @property
    def all(self) -> list[Camera]:
        return self.train + self.test


def dataset_cameras(data: str, store_path: str, store: Store) -> DatasetCameras:
    """The dataset's cameras moved into the frame the store was tiled in, as the trainer loads them."""
    try:
        scene = load_cameras(TrainConfig(data=data, store=store_path), store)
    except (TrainError, OSError, ValueError) as e:  # DatasetError is a ValueError
        raise ViewError(f"--data {data}: {e}") from e
    return DatasetCameras(scene.train, scene.test)


def pinhole(c2w: np.ndarray, fov_y: float, width: int, height: int, name: str = "") -> Camera:  # c2w [4, 4], OpenCV axes
    """A camera with square pixels, the principal point at the centre and a vertical field of view."""
    f = 0.5 * height / math.tan(0.5 * fov_y)
    K = np.array([[f, 0.0, 0.5 * width], [0.0, f, 0.5 * height], [0.0, 0.0, 1.0]])
    return Camera(np.linalg.inv(c2w), K, width, height, name=name)


def look_at(eye: np.ndarray, target: np.ndarray, up: np.ndarray) -> np.ndarray:  # [3] x 3 -> c2w [4, 4]
    """Camera-to-world with OpenCV axes: +z towards target, -y as close to `up` as it can be."""
    z = target - eye
    z = z / np.linalg.norm(z)
    x = np.cross(z, up)
    if np.linalg.norm(x) < 1e-9:  # looking along up: any right vector will do
        x = np.cross(z, np.array([1.0, 0.0, 0.0]) if abs(z[0]) < 0.9 else np.array([0.0, 1.0, 0.0]))
    x = x / np.linalg.norm(x)
    y = np.cross(z, x)
    c2w = np.eye(4)
    c2w[:3, 0], c2w[:3, 1], c2w[:3, 2], c2w[:3, 3] = x, y, z, eye
    return c2w


def orbit(bounds: np.ndarray, n: int, width: int, height: int, up: tuple[int, int] = (2, 1),
          fov_y: float = math.radians(60)) -> list[Camera]:  # bounds [6]
    """n cameras on a circle around the scene, 30 degrees above it (`up` = (axis, sign) of the
    world's up, `BlockScene.up`), each seeing the whole bounding box."""
    lo, hi = bounds[:3], bounds[3:]
    centre, radius = (lo + hi) / 2, float(np.linalg.norm(hi - lo)) / 2 or 1.0
    distance = radius / math.sin(0.5 * min(fov_y, fov_y * width / height)) * 1.05
    axes = np.eye(3)
    vertical, e1, e2 = axes[up[0]] * up[1], axes[(up[0] + 1) % 3], axes[(up[0] + 2) % 3]
    cams = []
    for i in range(n):
        a = 2 * math.pi * i / n
        around = math.cos(a) * e1 + math.sin(a) * e2
        eye = centre + distance * (math.cos(math.pi / 6) * around + math.sin(math.pi / 6) * vertical)
        cams.append(pinhole(look_at(eye, centre, vertical), fov_y, width, height, name=f"orbit_{i:03d}"))
    return cams


def resized(camera: Camera, width: int | None, height: int | None) -> Camera:
    """The camera at another image size (the same field of view; one side alone keeps the aspect)."""
    if width is None and height is None:
        return camera
    w = width if width is not None else max(1, round(camera.width * height / camera.height))
    h = height if height is not None else max(1, round(camera.height * width / camera.width))
    K = camera.K.copy()
    K[0] *= w / camera.width
    K[1] *= h / camera.height
    return replace(camera, K=K, width=w, height=h)


def select(spec: str, bounds: np.ndarray, up: tuple[int, int], data: DatasetCameras | None, width: int | None,
           height: int | None) -> list[tuple[str, Camera]]:
    """(file stem, camera) for `--cameras`: all | train | test | i,j,... (indices into train then test) | orbit:N."""
    if spec.startswith("orbit:"):
        return [(c.name, c) for c in orbit(bounds, int(spec[6:]), width or 640, height or 480, up)]
    if data is None:
        raise ViewError(f"--cameras {spec}: dataset cameras need --data (or use --cameras orbit:N)")
    everything = data.all
    if spec in ("all", "train", "test"):
        chosen = {"all": range(len(everything)), "train": range(len(data.train)),
                  "test": range(len(data.train), len(everything))}[spec]
    else:
        chosen = [int(i) for i in spec.split(",")]
        bad = [i for i in chosen if i >= len(everything)]
        if bad:
            raise ViewError(f"--cameras {spec}: camera {bad[0]} out of range: the dataset has {len(everything)} "
                            f"cameras (0..{len(everything) - 1}: {len(data.train)} training, then {len(data.test)} held out)")
    return [(f"{i:04d}_{_stem(everything[i].name) or 'camera'}", resized(everything[i], width, height)) for i in chosen]


def _stem(name: str) -> str:
    return name.rsplit("/", 1)[-1].rsplit(".", 1)[0]
