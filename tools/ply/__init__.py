"""3DGS and point-cloud PLY files: reading (standard, compressed, point clouds) and writing.

`open_ply(path)` looks at the header and returns a reader with `count`, and `read(start, stop)`
giving rows in ranges, so files larger than memory stream.
"""
from __future__ import annotations

import os

from tools.ply.compressed import CompressedPly, CompressedPlyWriter
from tools.ply.format import PlyError, PlyWarning, read_header
from tools.ply.points import PointPly
from tools.ply.standard import GAUSSIAN_MARKERS, GaussianPly, GaussianPlyWriter, Splats, check_splats

__all__ = [
    "CompressedPly",
    "CompressedPlyWriter",
    "GaussianPly",
    "GaussianPlyWriter",
    "PlyError",
    "PlyWarning",
    "PointPly",
    "Splats",
    "open_ply",
    "write_ply",
]


def open_ply(path: str | os.PathLike) -> GaussianPly | CompressedPly | PointPly:
    """A reader for a 3DGS PLY (standard or compressed) or a point cloud, told apart by their properties."""
    header = read_header(path)
    if header.element("chunk") is not None:
        return CompressedPly(header)
    vertex = header.element("vertex")
    if vertex is None:
        raise PlyError(header.path, "no 'vertex' element: neither a point cloud nor 3DGS PLY")
    if any(name in vertex.names for name in GAUSSIAN_MARKERS):
        return GaussianPly(header)
    return PointPly(header)


def write_ply(path: str | os.PathLike, splats: Splats, compressed: bool = False) -> None:
    """Write Gaussians to a standard (byte for byte as gsplat.export_splats) or compressed PLY."""
    count, sh_degree = check_splats(splats, f"writing {path}")
    writer = CompressedPlyWriter if compressed else GaussianPlyWriter
    with writer(path, count, sh_degree) as out:
        out.write(splats)
