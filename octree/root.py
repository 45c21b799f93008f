"""The root cube of an octree and the mapping between points, integer cells and cell boxes."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from octree import morton
from octree.bounds import Box
from octree.keys import MAX_DEPTH, BlockKey

_FINEST = 1 << MAX_DEPTH  # cells per axis at MAX_DEPTH
_PAD = 2.0**-20  # relative growth of the cube so the largest point lies strictly inside
_NEAR_FACE = 1e-6  # in finest cells: far above float64 rounding of the scaled coordinates
_CHUNK = 1 << 15  # rows per piece when coding many points


@dataclass(frozen=True)
class RootCube:
    """The cube the octree subdivides: cell (depth d, integer coords k) spans lo + size * k / 2**d.

    Every cell edge is computed as ``lo + size * (k / 2**d)``; k / 2**d is exact in float64, so a
    cell and its children share bit-identical faces and the cells of a depth tile the cube.
    """

    lo: tuple[float, float, float]  # the cube's minimum corner
    size: float  # edge length

    def __post_init__(self) -> None:
        lo = tuple(float(v) for v in self.lo)
        if len(lo) != 3 or not all(np.isfinite(lo)) or not (np.isfinite(self.size) and self.size > 0):
            raise ValueError(f"root cube needs a finite 3D corner and a positive size, got lo={self.lo} size={self.size}")
        object.__setattr__(self, "lo", lo)
        object.__setattr__(self, "size", float(self.size))

    @classmethod
    def around(cls, lo: np.ndarray, hi: np.ndarray) -> "RootCube":  # lo [3], hi [3]: bounds of the points
        """The cube with corner `lo` that holds every point of the bounds strictly inside."""
        lo = np.asarray(lo, dtype=np.float64)
        hi = np.asarray(hi, dtype=np.float64)
        if not (np.isfinite(lo).all() and np.isfinite(hi).all() and (hi >= lo).all()):
            raise ValueError(f"cannot place a root cube around bounds {lo.tolist()} .. {hi.tolist()}")
        extent = float((hi - lo).max())
        # A cloud of coincident points still needs a cube of some size; scale it to the coordinates.
        size = extent * (1.0 + _PAD) if extent > 0 else max(float(np.abs(lo).max()) * _PAD, 1.0)
        while not (lo + size > hi).all():
            size = size * (1.0 + _PAD)
        return cls(tuple(lo.tolist()), size)

    @classmethod
    def of_points(cls, points: np.ndarray) -> "RootCube":  # points [N, 3]
        # Column by column: a reduction over axis 0 of an [N, 3] array is several times slower.
        columns = [points[:, axis] for axis in range(3)]
        return cls.around(np.array([c.min() for c in columns]), np.array([c.max() for c in columns]))

    def to_attrs(self) -> dict:
        return {"root_lo": list(self.lo), "root_size": self.size}

    @classmethod
    def from_attrs(cls, attrs: dict) -> "RootCube":
        return cls(tuple(attrs["root_lo"]), attrs["root_size"])

    def max_depth(self, min_cell_size: float | None) -> int:
        """Deepest level whose cells are still at least `min_cell_size` wide (MAX_DEPTH if None)."""
        if min_cell_size is None:
            return MAX_DEPTH
        if not (np.isfinite(min_cell_size) and min_cell_size > 0):
            raise ValueError(f"min_cell_size must be a positive number, got {min_cell_size}")
        depth = 0
        while depth < MAX_DEPTH and self.size / 2.0 ** (depth + 1) >= min_cell_size:
            depth += 1
        return depth

    def edges(self, k: np.ndarray, depth: np.ndarray | int) -> np.ndarray:  # k [...,3] int -> [...,3] float64
        """Minimum corners of cells with integer coordinates k at `depth` (k may be one past the last)."""
        frac = k.astype(np.float64) / np.power(2.0, depth)  # exact: a dyadic rational
        return np.asarray(self.lo) + self.size * frac

    def quantize(self, points: np.ndarray) -> np.ndarray:  # points [N, 3] -> [N, 3] int64
        """Finest-level cell coordinates of points, exact against `edges`; points outside clamp to the border."""
        p = np.asarray(points, dtype=np.float64)
        v = (p - np.asarray(self.lo)) * (_FINEST / self.size)
        np.clip(v, 0, _FINEST - 1, out=v)
        q = v.astype(np.int64)
        # The multiply can round across a cell face only for points within rounding of one;
        # settle those few against the exact edges.
        frac = v - q
        near = (frac < _NEAR_FACE) | (frac > 1 - _NEAR_FACE)
        rows = np.unique(np.flatnonzero(near) // 3)
        if len(rows):
            qr, pr = q[rows], p[rows]
            qr -= pr < self.edges(qr, MAX_DEPTH)
            qr += pr >= self.edges(qr + 1, MAX_DEPTH)
            q[rows] = np.clip(qr, 0, _FINEST - 1)
        return q

    def codes(self, points: np.ndarray) -> np.ndarray:  # points [N, 3] -> [N] int64
        """Morton codes of the finest cells holding the points."""
        out = np.empty(len(points), dtype=np.int64)
        # Cache-sized pieces: the dozens of elementwise passes then never leave the CPU cache.
        for s in range(0, len(points), _CHUNK):
            out[s : s + _CHUNK] = morton.encode(self.quantize(points[s : s + _CHUNK]))
        return out

    def contains(self, points: np.ndarray) -> np.ndarray:  # points [N, 3] -> [N] bool
        p = np.asarray(points, dtype=np.float64)
        return ((p >= np.asarray(self.lo)) & (p < self.edges(np.full(3, _FINEST), MAX_DEPTH))).all(axis=1)

    def cells(self, depths: np.ndarray, codes: np.ndarray) -> np.ndarray:  # [B], [B] -> [B, 6]
        """Boxes (x0, y0, z0, x1, y1, z1) of cells given by depth and Morton code."""
        k = morton.decode(codes)
        d = np.asarray(depths)[:, None]
        return np.concatenate([self.edges(k, d), self.edges(k + 1, d)], axis=1)

    def cell(self, key: BlockKey) -> Box:
        box = self.cells(np.array([key.depth]), np.array([key.code], dtype=np.int64))[0]
        return tuple(float(v) for v in box)  # type: ignore[return-value]
