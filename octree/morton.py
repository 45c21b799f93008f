"""Morton (Z-order) codes: interleave the bits of integer cell coordinates.

Bit 3*i of a code is bit i of x, 3*i+1 of y, 3*i+2 of z, so the low three bits of a
cell's code are its octant inside its parent (x is bit 0, as in gsplat's exporter).
"""
from __future__ import annotations

import numpy as np

from octree.keys import MAX_DEPTH

# Masks that spread 21 bits two zeros apart in five shift-and-mask steps.
_SPREAD = (
    (32, 0x001F00000000FFFF),
    (16, 0x001F0000FF0000FF),
    (8, 0x100F00F00F00F00F),
    (4, 0x10C30C30C30C30C3),
    (2, 0x1249249249249249),
)
_COORD_MASK = (1 << MAX_DEPTH) - 1


def _spread(v: np.ndarray) -> np.ndarray:  # [N] -> [N] uint64
    x = v.astype(np.uint64) & np.uint64(_COORD_MASK)
    for shift, mask in _SPREAD:
        x = (x | (x << np.uint64(shift))) & np.uint64(mask)
    return x


def _compact(x: np.ndarray) -> np.ndarray:  # [N] uint64 -> [N] int64
    shifts = [shift for shift, _ in reversed(_SPREAD)]
    masks = [mask for _, mask in reversed(_SPREAD[:-1])] + [_COORD_MASK]
    x = x & np.uint64(_SPREAD[-1][1])
    for shift, mask in zip(shifts, masks):
        x = (x | (x >> np.uint64(shift))) & np.uint64(mask)
    return x.astype(np.int64)


def encode(ijk: np.ndarray) -> np.ndarray:  # [N, 3] integer cell coordinates -> [N] int64
    """Morton codes of cells given by integer coordinates in [0, 2**MAX_DEPTH)."""
    code = _spread(ijk[:, 0]) | (_spread(ijk[:, 1]) << np.uint64(1)) | (_spread(ijk[:, 2]) << np.uint64(2))
    return code.astype(np.int64)


def decode(codes: np.ndarray) -> np.ndarray:  # [N] int64 -> [N, 3] int64
    """Integer cell coordinates of Morton codes (the inverse of `encode`)."""
    c = np.asarray(codes).astype(np.uint64)
    return np.stack([_compact(c >> np.uint64(axis)) for axis in range(3)], axis=1)
