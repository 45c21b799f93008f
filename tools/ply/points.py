"""Point-cloud PLYs (x, y, z and optional colours), as photogrammetry and lidar tools write them."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from tools.ply.format import PlyError, PlyHeader, columns, element_data

_COLOR_NAMES = (("red", "green", "blue"), ("r", "g", "b"), ("diffuse_red", "diffuse_green", "diffuse_blue"))
DEFAULT_GREY = 128  # colour of points from a cloud without colours


class PointPly:
    """A point cloud opened for reading rows in ranges: positions and uint8 colours."""

    def __init__(self, header: PlyHeader) -> None:
        self.path: Path = header.path
        vertex = header.element("vertex")
        names = vertex.names if vertex else ()
        missing = [axis for axis in "xyz" if axis not in names]
        if missing:
            raise PlyError(self.path, f"point cloud lacks properties {', '.join(missing)} of its 'vertex' element")
        self._rows = element_data(header, "vertex")
        self.count = len(self._rows)
        self.color_names = next((c for c in _COLOR_NAMES if all(n in names for n in c)), None)

    def read(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:  # [n, 3] float64, [n, 3] uint8
        rows = self._rows[start:stop]
        points = columns(rows, ("x", "y", "z"), np.float64)
        if self.color_names is None:
            return points, np.full((len(rows), 3), DEFAULT_GREY, dtype=np.uint8)
        raw = rows[list(self.color_names)]
        kind = raw.dtype[0]
        values = columns(rows, self.color_names, np.float64)
        if kind.kind == "f":  # floats in [0, 1]
            values = values * 255.0
        elif kind.itemsize > 1:  # 16-bit (or wider) integer colours
            values = values * (255.0 / np.iinfo(kind).max)
        return points, np.clip(np.round(values), 0, 255).astype(np.uint8)
