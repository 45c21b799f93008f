"""Boxes of a block: the tight box of its means and the 3-sigma extent box used for culling; and
the same for many blocks at once, bit for bit."""
from __future__ import annotations

import numpy as np
from numba import njit, prange

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


def extent_boxes(
    means: np.ndarray, log_scales: np.ndarray, starts: np.ndarray, sigma: float = EXTENT_SIGMA
) -> np.ndarray:
    """means [N, 3], log_scales [N, 3] grouped by block -> boxes of every sigma-ellipsoid [B, 6].

    One compiled pass over the rows, split into pieces of at most `_PIECE` rows over the cores
    (a trained block's boxes are taken every step: numpy's passes over a 50k-row block, a dozen of
    them on one core, cost 0.3 ms of a 35 ms step). A piece's least and greatest values are exact,
    so the boxes do not depend on how the rows were split."""
    n = len(means)
    ends = np.append(starts[1:], n).astype(np.int64)
    starts = np.asarray(starts, dtype=np.int64)
    per_block = np.maximum(1, -(-(ends - starts) // _PIECE))
    first = np.cumsum(per_block) - per_block  # each block's first piece
    block = np.repeat(np.arange(len(starts)), per_block)
    lo = starts[block] + (np.arange(len(block)) - first[block]) * _PIECE
    hi = np.minimum(lo + _PIECE, ends[block])
    pieces = _extent_pieces(np.ascontiguousarray(means), np.ascontiguousarray(log_scales), lo, hi, float(sigma))
    boxes = np.concatenate([np.minimum.reduceat(pieces[:, :3], first), np.maximum.reduceat(pieces[:, 3:], first)],
                           axis=1)
    return np.clip(boxes, -BOX_LIMIT, BOX_LIMIT)


_PIECE = 16384  # rows a thread takes at a time


@njit(parallel=True, cache=True, nogil=True)
def _extent_pieces(means, log_scales, lo, hi, sigma):  # -> [P, 6] float64 the box of rows [lo, hi) of each piece
    """As numpy computed it: r = sigma exp(largest log scale) in float64, then the least of
    mean - r and the greatest of mean + r per coordinate, NaN propagating (np.minimum's rules)."""
    out = np.empty((lo.size, 6), np.float64)
    for i in prange(lo.size):
        box = np.empty(6, np.float64)
        box[:3], box[3:] = np.inf, -np.inf
        for row in range(lo[i], hi[i]):
            r = sigma * np.exp(np.float64(np.maximum(np.maximum(log_scales[row, 0], log_scales[row, 1]),
                                                     log_scales[row, 2])))
            for c in range(3):
                m = np.float64(means[row, c])
                box[c] = np.minimum(box[c], m - r)
                box[3 + c] = np.maximum(box[3 + c], m + r)
        out[i] = box
    return out


def tight_boxes(means: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """means [N, 3] grouped by block, starts [B] of the (non-empty) groups -> boxes of the means [B, 6]."""
    return _boxes(means, starts)


def _boxes(means: np.ndarray, starts: np.ndarray) -> np.ndarray:  # -> [B, 6] float64
    """Per block the least and the greatest of the means, a coordinate at a time: reduceat along
    axis 0 of an [N, 3] array walks it three values at a time (3-4x slower)."""
    out = np.empty((len(starts), 6), np.float64)
    for c in range(3):
        m = means[:, c].astype(np.float64)
        out[:, c] = np.minimum.reduceat(m, starts)
        out[:, 3 + c] = np.maximum.reduceat(m, starts)
    return out
