"""Blocks seen from a camera: their front-to-back order and conservative screen footprints.

Occlusion culling (`train/occlusion.py`) visits a frustum's blocks nearest first and drops a block
whose every possible splat lies behind the depth at which all the pixels it could touch were
already saturated. Both the order and the footprint are pure geometry of extent boxes (means +-
`EXTENT_SIGMA` x largest scale), with the splat semantics of `octree.semantics`:

* a Gaussian of the box has its mean m in the box shrunk by b s (b = `EXTENT_SIGMA`, s its largest
  scale), so s <= (shortest half side) / b, its mean's depth is at least the box's nearest
  camera-space z, and its 2D mean (the pinhole projection of m) lies in the projection of the box;
* the pixels its splat can change lie within its support ellipse sigma <= ln(255 o) < 3.33^2 / 2
  (the kernels evaluate nothing outside it), whose half extent along x is at most
  3.33 sqrt(cov2d_xx + eps2d), and cov2d_xx <= s^2 fx^2 (1 + L^2) / z^2 (`octree.cull`: the
  Jacobian's direction is clamped to L, the field of view plus 30%).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from octree.bounds import EXTENT_SIGMA
from octree.semantics import EPS2D, NEAR_PLANE, RADIUS_SIGMAS

# Slack on the support's half extent: the kernels widen the alpha-test level by 1e-3 relative
# (`train/render/cpu/ellipse.py`) and the conic round-trips through float32.
_SUPPORT_SLACK_REL = 1.01
_SUPPORT_SLACK_PX = 1.5
# A splat's depth is its mean's camera z rounded to float32 (relative error 2^-24): the nearest
# depth a box's splats can have is taken this much (relative to the terms summed) below the box's.
_DEPTH_SLACK_REL = 1e-6
_FOV_MARGIN = 0.3  # the projection clamps the Jacobian's direction to the field of view plus 30%


def box_depths(boxes: np.ndarray, viewmat: np.ndarray) -> np.ndarray:  # [B, 6], [4, 4] -> [B] float64
    """The nearest camera-space z of each box (negative where the box reaches behind the camera;
    inf for an empty box): a linear function's minimum over a box is at a corner."""
    boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, 6)
    viewmat = np.asarray(viewmat, dtype=np.float64)
    centre, half = (boxes[:, :3] + boxes[:, 3:]) / 2, (boxes[:, 3:] - boxes[:, :3]) / 2
    z = centre @ viewmat[2, :3] - half @ np.abs(viewmat[2, :3]) + viewmat[2, 3]
    valid = (half >= 0).all(axis=1) & np.isfinite(boxes).all(axis=1)
    return np.where(valid, z, np.inf)


def front_to_back(boxes: np.ndarray, viewmat: np.ndarray) -> np.ndarray:  # [B, 6], [4, 4] -> [B] int64
    """Indices of `boxes` by their nearest camera-space depth (`box_depths`), nearest first: the
    rasterizer's sort key, so a box whose nearest splat lies behind the splats of the boxes
    before it comes after them. Equal depths keep index order (a function of the boxes alone)."""
    return np.argsort(box_depths(boxes, viewmat), kind="stable").astype(np.int64)


@dataclass
class Footprints:
    """Where on screen, and how near, the splats of each box can be."""

    rects: np.ndarray  # [B, 4] int64 pixels x0, y0, x1, y1 (end exclusive) clipped to the image
    depth: np.ndarray  # [B] float64 the box's nearest camera-space z (`box_depths`)
    near: np.ndarray  # [B] float64: every splat of the box has a float32 depth above this (-inf if not bounded)
    bounded: np.ndarray  # [B] bool: the box lies wholly in front of the near plane and its rect is not empty


def box_footprints(
    boxes: np.ndarray,  # [B, 6] extent boxes (x0, y0, z0, x1, y1, z1), world space
    viewmat: np.ndarray,  # [4, 4] world-to-camera, OpenCV axes
    K: np.ndarray,  # [3, 3] pinhole intrinsics
    width: int,
    height: int,
) -> Footprints:
    """Conservative screen rectangles and nearest depths of extent boxes (`bounded` False where
    no bound is given: a box reaching the camera plane, or an empty box)."""
    boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, 6)
    viewmat, K = np.asarray(viewmat, dtype=np.float64), np.asarray(K, dtype=np.float64)
    R, t = viewmat[:3, :3], viewmat[:3, 3]
    lo, hi = boxes[:, :3], boxes[:, 3:]
    valid = (lo <= hi).all(axis=1) & np.isfinite(boxes).all(axis=1)
    lo, hi = np.where(valid[:, None], lo, 0.0), np.where(valid[:, None], hi, 1.0)
    corners = np.stack([np.where(np.array([(c >> a) & 1 for a in range(3)], dtype=bool), hi, lo)
                        for c in range(8)], axis=1)  # [B, 8, 3]
    cam = corners @ R.T + t  # [B, 8, 3]
    z = cam[..., 2]
    z_min = z.min(axis=1)  # a linear function's minimum over a box is at a corner
    in_front = valid & (z_min > NEAR_PLANE)
    zs = np.where(in_front[:, None], z, 1.0)
    fx, fy, cx, cy = K[0, 0], K[1, 1], K[0, 2], K[1, 2]
    # x/z over a box in front of the camera is extreme at a corner (linear-fractional, z > 0).
    u, v = fx * cam[..., 0] / zs + cx, fy * cam[..., 1] / zs + cy
    lim_x = max(abs((width - cx) / fx), abs(cx / fx)) + _FOV_MARGIN * 0.5 * width / abs(fx)
    lim_y = max(abs((height - cy) / fy), abs(cy / fy)) + _FOV_MARGIN * 0.5 * height / abs(fy)
    max_scale = (hi - lo).min(axis=1) / 2 / EXTENT_SIGMA
    z_near = np.where(in_front, z_min, 1.0)
    reach = RADIUS_SIGMAS * _SUPPORT_SLACK_REL
    pad_x = reach * np.sqrt((max_scale * abs(fx) * np.hypot(1.0, lim_x) / z_near) ** 2 + EPS2D) + _SUPPORT_SLACK_PX
    pad_y = reach * np.sqrt((max_scale * abs(fy) * np.hypot(1.0, lim_y) / z_near) ** 2 + EPS2D) + _SUPPORT_SLACK_PX
    # Pixel i is touched only if its centre i + 0.5 lies within the padded range.
    x0 = np.floor(u.min(axis=1) - pad_x - 0.5)
    x1 = np.ceil(u.max(axis=1) + pad_x - 0.5) + 1
    y0 = np.floor(v.min(axis=1) - pad_y - 0.5)
    y1 = np.ceil(v.max(axis=1) + pad_y - 0.5) + 1
    rects = np.stack([np.clip(x0, 0, width), np.clip(y0, 0, height), np.clip(x1, 0, width),
                      np.clip(y1, 0, height)], axis=1)
    rects = np.where(np.isfinite(rects), rects, 0).astype(np.int64)
    bounded = in_front & (rects[:, 2] > rects[:, 0]) & (rects[:, 3] > rects[:, 1])
    magnitude = np.abs(corners) @ np.abs(R[2]) + abs(t[2])  # [B, 8] the terms summed into z
    near = z_min - _DEPTH_SLACK_REL * magnitude.max(axis=1) - 1e-12
    return Footprints(rects, box_depths(boxes, viewmat), np.where(bounded, near, -np.inf), bounded)
