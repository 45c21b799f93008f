"""Per-block boxes for many blocks at once, and distances to boxes.

Values match `octree.bounds.tight_box` / `extent_box` applied block by block, bit for bit.
"""
from __future__ import annotations

import numpy as np

from octree.bounds import BOX_LIMIT, EXTENT_SIGMA


def _reduce(lo: np.ndarray, hi: np.ndarray, starts: np.ndarray) -> np.ndarray:  # [N, 3], [N, 3], [B] -> [B, 6]
    return np.concatenate([np.minimum.reduceat(lo, starts, axis=0), np.maximum.reduceat(hi, starts, axis=0)], axis=1)


def tight_boxes(means: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """means [N, 3] grouped by block, starts [B] of the (non-empty) groups -> boxes of the means [B, 6]."""
    return _reduce(means, means, starts).astype(np.float64)


def extent_boxes(
    means: np.ndarray, log_scales: np.ndarray, starts: np.ndarray, sigma: float = EXTENT_SIGMA
) -> np.ndarray:
    """means [N, 3], log_scales [N, 3] grouped by block -> boxes of every sigma-ellipsoid [B, 6]."""
    with np.errstate(over="ignore"):
        r = sigma * np.exp(log_scales.max(axis=1, keepdims=True).astype(np.float64))  # [N, 1]
    return np.clip(_reduce(means - r, means + r, starts), -BOX_LIMIT, BOX_LIMIT)


def point_box_distance(points: np.ndarray, boxes: np.ndarray) -> np.ndarray:  # [N, 3], [B, 6] -> [N, B]
    """Euclidean distance from each point to each box (0 inside)."""
    p = np.asarray(points, dtype=np.float64)[:, None, :]
    gap = np.maximum(np.maximum(boxes[None, :, :3] - p, p - boxes[None, :, 3:]), 0.0)
    return np.sqrt((gap**2).sum(axis=2))


def box_box_distance(box: np.ndarray, boxes: np.ndarray) -> np.ndarray:  # [6], [B, 6] -> [B]
    """Euclidean distance between one box and each of many (0 where they touch or overlap)."""
    gap = np.maximum(np.maximum(boxes[:, :3] - box[3:], box[:3] - boxes[:, 3:]), 0.0)
    return np.sqrt((gap**2).sum(axis=1))
