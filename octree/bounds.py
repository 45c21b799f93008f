"""Boxes of a block: the tight box of its means and the 3-sigma extent box used for culling."""
from __future__ import annotations

import numpy as np

from octree.semantics import RADIUS_SIGMAS

Box = tuple[float, float, float, float, float, float]  # (x0, y0, z0, x1, y1, z1)

EMPTY_BOX: Box = (np.inf, np.inf, np.inf, -np.inf, -np.inf, -np.inf)


def tight_box(means: np.ndarray) -> Box:  # means [N, 3]
    if len(means) == 0:
        return EMPTY_BOX
    lo = means.min(axis=0)
    hi = means.max(axis=0)
    return tuple(float(v) for v in (*lo, *hi))  # type: ignore[return-value]


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
    with np.errstate(over="ignore"):
        r = sigma * np.exp(log_scales.max(axis=1, keepdims=True).astype(np.float64))  # [N, 1]
    lo = np.maximum((means - r).min(axis=0), -BOX_LIMIT)
    hi = np.minimum((means + r).max(axis=0), BOX_LIMIT)
    return tuple(float(v) for v in (*lo, *hi))  # type: ignore[return-value]
