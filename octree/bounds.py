"""Boxes of a block: the tight box of its means and the 3-sigma extent box used for culling; and
the same for many blocks at once, bit for bit."""
from __future__ import annotations

import numpy as np

from octree.semantics import RADIUS_SIGMAS

Box = tuple[float, float, float, float, float, float]  # (x0, y0, z0, x1, y1, z1)

EMPTY_BOX: Box = (np.inf, np.inf, np.inf, -np.inf, -np.inf, -np.inf)


def tight_box(means: np.ndarray) -> Box:  # means [N, 3]
    if len(means) == 0:
        return EMPTY_BOX
    return tuple(float(v) for v in tight_boxes(means, _ONE_BLOCK)[0])  # type: ignore[return-value]


# A box reaches as far as a splat can (`octree.semantics.RADIUS_SIGMAS`), so culling by boxes is exact.
EXTENT_SIGMA = RADIUS_SIGMAS

# A scale that overflows exp() (an exploding learning rate) reaches everywhere. Its box says so
# with the largest finite float, so it still culls conservatively and still fits a JSON commit.
BOX_LIMIT = float(np.finfo(np.float64).max)


def extent_box(means: np.ndarray, log_scales: np.ndarray, sigma: float = EXTENT_SIGMA) -> Box:
    """means [N, 3], log_scales [N, 3]: the box holding every Gaussian's sigma-ellipsoid.

    Uses the largest axis of each Gaussian, so it bounds any rotation of it.
    """
    if len(means) == 0:
        return EMPTY_BOX
    return tuple(float(v) for v in extent_boxes(means, log_scales, _ONE_BLOCK, sigma)[0])  # type: ignore[return-value]


# ---- many blocks at once: means and scales grouped by block, `starts` the first row of each ----

_ONE_BLOCK = np.zeros(1, dtype=np.int64)


def tight_boxes(means: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """means [N, 3] grouped by block, starts [B] of the (non-empty) groups -> boxes of the means [B, 6]."""
    return _boxes(means, 0.0, starts)


def extent_boxes(
    means: np.ndarray, log_scales: np.ndarray, starts: np.ndarray, sigma: float = EXTENT_SIGMA
) -> np.ndarray:
    """means [N, 3], log_scales [N, 3] grouped by block -> boxes of every sigma-ellipsoid [B, 6]."""
    with np.errstate(over="ignore"):
        r = sigma * np.exp(largest_axis(log_scales).astype(np.float64))  # [N]
    return np.clip(_boxes(means, r, starts), -BOX_LIMIT, BOX_LIMIT)


def _boxes(means: np.ndarray, r: np.ndarray | float, starts: np.ndarray) -> np.ndarray:  # -> [B, 6] float64
    """Per block the least of means - r and the greatest of means + r, a coordinate at a time:
    reduceat and broadcasting along axis 0 of an [N, 3] array walk it three values at a time
    (3-4x slower), and [N, 3] float64 temporaries are fresh pages every call."""
    out = np.empty((len(starts), 6), np.float64)
    for c in range(3):
        m = means[:, c].astype(np.float64)
        out[:, c] = np.minimum.reduceat(m - r, starts)
        out[:, 3 + c] = np.maximum.reduceat(np.add(m, r, out=m), starts)
    return out


def largest_axis(log_scales: np.ndarray) -> np.ndarray:  # [N, 3] -> [N]
    """The largest of each row's three values (`max(axis=1)` over three columns walks them a row at
    a time, some twenty times slower)."""
    return np.maximum(np.maximum(log_scales[:, 0], log_scales[:, 1]), log_scales[:, 2])

