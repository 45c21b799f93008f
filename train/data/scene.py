"""`load_scene`: a dataset folder (COLMAP or transforms.json) as cameras, points and a lazy image loader."""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from train.camera import Camera
from train.data.colmap import find_sparse_dir
from train.data.colmap_scene import read_colmap_scene
from train.data.config import DataConfig
from train.data.errors import DatasetError
from train.data.images import ImageLoader, ImageSource, cache_folder, check_size, image_size
from train.data.intrinsics import undistorted_intrinsics
from train.data.normalize import normalize_world, transform_points
from train.data.prefetch import ImagePrefetcher
from train.data.transforms import read_transforms_scene, transforms_file
from train.data.views import RawScene, View


@dataclass(frozen=True, eq=False)
class SceneData:
    """A dataset ready for training. Cameras are pinhole (undistorted), at the data factor, in the frame
    `world_transform` leads to; images are read only when asked for."""

    train_cameras: list[Camera]
    test_cameras: list[Camera]
    points: np.ndarray  # [P, 3] float64, same frame as the cameras (P may be 0)
    colors: np.ndarray  # [P, 3] uint8
    world_transform: np.ndarray  # [4, 4] similarity: input frame -> this frame
    scene_scale: float  # 1.1 x the largest distance of a camera centre from their mean, as gsplat
    image_loader: ImageLoader
    kind: str  # "colmap-text", "colmap-binary" or "transforms"
    source: Path  # the model folder or transforms.json read
    random_points: bool  # the points were drawn at random (the input had no point cloud)
    prefetch: int = 4  # default depth of `prefetcher`

    @property
    def cameras(self) -> list[Camera]:  # all cameras, in name order
        return sorted(self.train_cameras + self.test_cameras, key=lambda c: c.name)

    def load_image(self, camera: Camera) -> torch.Tensor:  # [H, W, 3] float32 in [0, 1]
        return self.image_loader.load_image(camera)

    def load_rgba(self, camera: Camera) -> tuple[torch.Tensor, torch.Tensor | None]:  # [H, W, 3], [H, W, 1]
        return self.image_loader.load_rgba(camera)

    def prefetcher(self, cameras: list[Camera], depth: int | None = None) -> ImagePrefetcher:
        return ImagePrefetcher(self.image_loader, cameras, depth or self.prefetch)

    def with_transform(self, T: np.ndarray) -> "SceneData":
        """The same scene moved by the similarity `T` (e.g. a store's stored world_transform applied to a
        scene loaded with normalize=False); world_transform becomes T @ world_transform."""
        T = np.asarray(T, dtype=np.float64)
        _check_similarity(T)
        train = [c.transformed(T) for c in self.train_cameras]
        test = [c.transformed(T) for c in self.test_cameras]
        return replace(self, train_cameras=train, test_cameras=test, points=transform_points(T, self.points),
                       world_transform=T @ self.world_transform, scene_scale=_scene_scale(train + test))


def _check_similarity(T: np.ndarray) -> None:
    if T.shape != (4, 4) or not np.isfinite(T).all():
        raise ValueError(f"world transform must be a finite 4x4 matrix, got shape {T.shape}")
    s = np.linalg.norm(T[:3, 0])
    R = T[:3, :3] / s if s > 0 else T[:3, :3]
    if s <= 0 or np.abs(R.T @ R - np.eye(3)).max() > 1e-6 or np.linalg.det(R) < 0 or \
            np.abs(T[3] - [0, 0, 0, 1]).max() > 1e-12:
        raise ValueError("world transform must be a similarity (rotation, uniform scale, translation)")


def _scene_scale(cameras: list[Camera]) -> float:
    centres = np.array([c.center for c in cameras])
    radius = float(np.linalg.norm(centres - centres.mean(axis=0), axis=1).max())
    return 1.1 * radius if radius > 0 else 1.0  # one camera (or all at one spot): no spread to measure


def _read_raw(path: Path, cfg: DataConfig) -> RawScene:
    if transforms_file(path).is_file():
        return read_transforms_scene(path, cfg.allow_external_images, cfg.point_cloud)
    if path.suffix == ".json":
        raise DatasetError(path, "transforms file is missing")
    if not path.is_dir():
        raise DatasetError(path, "no such dataset folder")
    try:
        find_sparse_dir(path)
    except DatasetError:
        raise DatasetError(path, "neither a COLMAP dataset (sparse/0/, sparse/) nor a transforms.json") from None
    return read_colmap_scene(path, cfg.allow_external_images)


def _image_source(view: View, cfg: DataConfig) -> ImageSource:
    target = undistorted_intrinsics(view.intrinsics)
    distorted = view.intrinsics.distorted
    if cfg.data_factor == 1 and not distorted:
        return ImageSource(view.image_path, view.intrinsics, target)
    if not distorted:  # a downscaled copy the dataset ships (as Mip-NeRF 360 does) is used as it is
        shipped = view.image_root.with_name(f"{view.image_root.name}_{cfg.data_factor}") / view.image_name
        if shipped.is_file():
            return ImageSource(view.image_path, view.intrinsics, target, shipped)
    folder = cache_folder(view.image_root, cfg.data_factor, distorted, cfg.cache_dir)
    return ImageSource(view.image_path, view.intrinsics, target, folder / Path(view.image_name).with_suffix(".png"))


def _camera(view: View, cfg: DataConfig) -> Camera:
    src = _image_source(view, cfg)
    t = src.target
    cam = Camera(view.viewmat, t.K, t.width, t.height, view.image_id, view.name,
                 {"image": src, "image_path": str(view.image_path)})
    return cam.scaled(cfg.data_factor) if cfg.data_factor > 1 else cam


def _check_image(camera: Camera) -> None:
    src: ImageSource = camera.extra["image"]
    check_size(src.path, image_size(src.path), (src.source.width, src.source.height), f"camera {camera.name!r}")
    if src.cache is not None and src.cache.is_file():
        check_size(src.cache, image_size(src.cache), (camera.width, camera.height),
                   f"camera {camera.name!r} at data factor (delete the copy to rebuild it)")


def load_scene(path: str | Path, cfg: DataConfig = DataConfig()) -> SceneData:
    """Read the dataset at `path` (COLMAP text or binary, or transforms.json) into a `SceneData`.

    Raises a `DatasetError` subclass naming the file (and line or record) for any bad input.
    """
    raw = _read_raw(Path(path), cfg)
    views = sorted(raw.views, key=lambda v: v.name)
    cameras = [_camera(v, cfg) for v in views]
    if cfg.check_images:
        for cam in cameras:
            _check_image(cam)
    points, colors, random_points = raw.points, raw.colors, len(raw.points) == 0 and cfg.point_cloud
    if random_points:
        rng = np.random.default_rng(cfg.seed)
        lo, hi = raw.init_box
        points = lo + rng.random((cfg.random_points, 3)) * (hi - lo)
        colors = rng.integers(0, 256, (cfg.random_points, 3), dtype=np.uint8)
    if cfg.normalize:
        c2w = np.stack([np.linalg.inv(v.viewmat) for v in views])
        T = normalize_world(c2w, None if random_points else raw.points)
    else:
        T = np.eye(4)
    if not cfg.point_cloud:  # cameras only; a COLMAP model's points were read to check it, and go here
        points, colors = np.zeros((0, 3)), np.zeros((0, 3), np.uint8)
    is_test = [cfg.test_every > 0 and i % cfg.test_every == 0 for i in range(len(cameras))]
    scene = SceneData(
        train_cameras=[c for c, t in zip(cameras, is_test) if not t],
        test_cameras=[c for c, t in zip(cameras, is_test) if t],
        points=points, colors=colors, world_transform=np.eye(4), scene_scale=_scene_scale(cameras),
        image_loader=ImageLoader(cfg.background, int(cfg.image_memory_mb * 2**20)), kind=raw.kind, source=raw.source,
        random_points=random_points, prefetch=cfg.prefetch,
    )
    return scene.with_transform(T) if cfg.normalize else scene
