"""What a reader hands to `load_scene`: views in the input's own frame, before split, normalisation and scaling."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from train.data.intrinsics import Intrinsics


@dataclass(frozen=True, eq=False)
class View:
    name: str  # unique; the split orders views by it
    image_id: int
    viewmat: np.ndarray  # [4, 4] world-to-camera, OpenCV axes, input frame
    intrinsics: Intrinsics  # at the size of the image in image_root
    image_root: Path  # the folder image paths are relative to (downscaled copies go beside it)
    image_name: str  # path of the image relative to image_root

    @property
    def image_path(self) -> Path:
        return self.image_root / self.image_name


@dataclass(frozen=True, eq=False)
class RawScene:
    kind: str  # "colmap-text", "colmap-binary" or "transforms"
    source: Path  # the model folder or the transforms.json
    views: list[View]
    points: np.ndarray  # [P, 3] float64, input frame (P may be 0)
    colors: np.ndarray  # [P, 3] uint8
    init_box: np.ndarray  # [2, 3] min and max corner, input frame: where random points go when P == 0


def camera_box(views: list[View]) -> np.ndarray:  # [2, 3]
    """The box around the camera centres, thickened so a planar or single-camera rig still spans a volume."""
    centres = np.array([-v.viewmat[:3, :3].T @ v.viewmat[:3, 3] for v in views])
    lo, hi = centres.min(axis=0), centres.max(axis=0)
    half = np.maximum((hi - lo) / 2.0, 0.1 * (hi - lo).max())
    if not (half > 0).all():
        half = np.ones(3)
    mid = (lo + hi) / 2.0
    return np.stack([mid - half, mid + half])
