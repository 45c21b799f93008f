"""Options for loading a dataset."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class DataConfig:
    """How `load_scene` reads a dataset.

    data_factor: images are downscaled by this integer factor; intrinsics follow. Downscaled (and
        undistorted) images are cached on disk, see `cache_dir`.
    test_every: every `test_every`-th image (in name order, starting with the first) is held out for
        evaluation; 0 holds out nothing.
    normalize: move the world into gsplat's normalised frame (`SceneData.world_transform` says how);
        False keeps the input frame (the trainer does this and applies a store's own transform).
    cache_dir: where downscaled / undistorted images go. None: next to the images (`images_4/`) when
        that folder is writable, else under ~/.cache/octosplat/. A path: under it, one folder per dataset.
    prefetch: how many upcoming images `SceneData.prefetcher` keeps loaded ahead of training.
    image_memory_mb: decoded images kept in memory, in MiB (least recently used dropped first), so
        that training decodes each image once and not once an epoch; 0 keeps none.
    background: RGB in [0, 1] on which RGBA images are composited (their alpha is also kept as a mask).
    check_images: read every image's header while loading the scene, so a missing, unreadable or
        wrongly sized image fails at once and not hours into training. Headers only, no pixels.
    random_points: how many points a scene without a point cloud starts from (uniform in its bounds).
    seed: seeds that random initialisation.
    point_cloud: False for cameras only (the trainer, whose store holds the Gaussians): a
        transforms.json's point cloud is not read (2.2 GB of transient memory at 44 M points) and
        no random points are made; COLMAP's points3D is still read, as part of the model it checks,
        but not returned.
    allow_external_images: follow image paths that lead out of the dataset (a transforms.json's
        file_path or ply_file_path outside its folder, a COLMAP image name outside images/:
        absolute, or climbing out with '..'); refused by default.
    """

    data_factor: int = 1
    test_every: int = 8
    normalize: bool = True
    cache_dir: Path | None = None
    prefetch: int = 4
    image_memory_mb: float = 256.0
    background: tuple[float, float, float] = (0.0, 0.0, 0.0)
    check_images: bool = True
    random_points: int = 100_000
    seed: int = 0
    allow_external_images: bool = False
    point_cloud: bool = True

    def __post_init__(self) -> None:
        if int(self.data_factor) != self.data_factor or self.data_factor < 1:
            raise ValueError(f"data_factor must be a positive integer, got {self.data_factor!r}")
        if self.test_every < 0 or self.test_every == 1:
            raise ValueError(f"test_every must be 0 (no test split) or at least 2, got {self.test_every}")
        if not 0.0 <= self.image_memory_mb < float("inf"):
            raise ValueError(f"image_memory_mb must be a finite number >= 0, got {self.image_memory_mb!r}")
        if self.prefetch < 1:
            raise ValueError(f"prefetch must be at least 1, got {self.prefetch}")
        if len(self.background) != 3 or not all(0.0 <= c <= 1.0 for c in self.background):
            raise ValueError(f"background must be three values in [0, 1], got {self.background!r}")
        if self.random_points < 1:
            raise ValueError(f"random_points must be positive, got {self.random_points}")
