"""Errors for bad input data: each names the file and, where it applies, the line or record."""
from __future__ import annotations

from pathlib import Path


class DatasetError(ValueError):
    """A dataset that cannot be used as it is.

    `path` is the offending file (or folder), `where` the line or record inside it (or None), and
    `problem` what is wrong; str(error) joins them as "path: where: problem".
    """

    def __init__(self, path: str | Path, problem: str, where: str | None = None) -> None:
        self.path = Path(path)
        self.where = where
        self.problem = problem
        super().__init__(f"{self.path}: {where}: {problem}" if where else f"{self.path}: {problem}")


class ColmapError(DatasetError):
    """A COLMAP model (cameras, images, points3D; text or binary) that is malformed or inconsistent."""


class TransformsError(DatasetError):
    """A transforms.json (nerfstudio / instant-ngp) that is not JSON or lacks what a scene needs."""


class ImageError(DatasetError):
    """An image file that is missing, unreadable, or not the size its camera says."""
