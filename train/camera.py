"""The Camera value type every layer passes around (dataset, render, culling, schedule)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np


@dataclass(frozen=True, eq=False)
class Camera:
    """A pinhole camera as gsplat takes it.

    viewmat is world-to-camera with OpenCV axes (x right, y down, z forward);
    K holds pixel focal lengths and principal point (pixel centres at +0.5).
    """

    viewmat: np.ndarray  # [4, 4] float64
    K: np.ndarray  # [3, 3] float64
    width: int
    height: int
    image_id: int = -1
    name: str = ""
    extra: dict = field(default_factory=dict, compare=False)  # e.g. image path, loader hints

    def __post_init__(self) -> None:
        vm = np.asarray(self.viewmat, dtype=np.float64)
        k = np.asarray(self.K, dtype=np.float64)
        if vm.shape != (4, 4) or k.shape != (3, 3):
            raise ValueError(f"camera {self.name!r}: viewmat must be 4x4 and K 3x3")
        if not (np.isfinite(vm).all() and np.isfinite(k).all()):
            raise ValueError(f"camera {self.name!r}: non-finite pose or intrinsics")
        if self.width <= 0 or self.height <= 0:
            raise ValueError(f"camera {self.name!r}: image size {self.width}x{self.height}")
        object.__setattr__(self, "viewmat", vm)
        object.__setattr__(self, "K", k)

    @property
    def camtoworld(self) -> np.ndarray:  # [4, 4]
        return np.linalg.inv(self.viewmat)

    @property
    def center(self) -> np.ndarray:  # [3] camera position in world space
        R, t = self.viewmat[:3, :3], self.viewmat[:3, 3]
        return -R.T @ t

    def scaled(self, factor: float) -> "Camera":
        """The same camera for an image downscaled by `factor` (width and height rounded as PIL does)."""
        w = max(1, int(round(self.width / factor)))
        h = max(1, int(round(self.height / factor)))
        k = self.K.copy()
        k[0, :] *= w / self.width
        k[1, :] *= h / self.height
        return replace(self, K=k, width=w, height=h)

    def transformed(self, world_transform: np.ndarray) -> "Camera":
        """The camera in a new world frame x' = T x, with T a similarity (rotation, uniform scale, shift)."""
        T = np.asarray(world_transform, dtype=np.float64)
        scale = np.linalg.norm(T[:3, 0])
        c2w = T @ self.camtoworld
        c2w[:3, :3] /= scale  # keep the rotation orthonormal; the scale lives in the translation
        return replace(self, viewmat=np.linalg.inv(c2w))
