"""Distances to boxes (the boxes themselves: `octree.bounds`)."""
from __future__ import annotations

import numpy as np


def point_box_distance(points: np.ndarray, boxes: np.ndarray) -> np.ndarray:  # [N, 3], [B, 6] -> [N, B]
    """Euclidean distance from each point to each box (0 inside)."""
    p = np.asarray(points, dtype=np.float64)[:, None, :]
    gap = np.maximum(np.maximum(boxes[None, :, :3] - p, p - boxes[None, :, 3:]), 0.0)
    return np.sqrt((gap**2).sum(axis=2))


def box_box_distance(box: np.ndarray, boxes: np.ndarray) -> np.ndarray:  # [6], [B, 6] -> [B]
    """Euclidean distance between one box and each of many (0 where they touch or overlap)."""
    gap = np.maximum(np.maximum(boxes[:, :3] - box[3:], box[:3] - boxes[:, 3:]), 0.0)
    return np.sqrt((gap**2).sum(axis=1))
