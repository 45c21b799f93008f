"""Lens models: a pinhole with OpenCV's radial-tangential distortion, and how to undistort it.

Distorted cameras are undistorted once, as COLMAP's image_undistorter does with blank_pixels=0: the
focal lengths stay, the image is resized so that it holds no pixel the source did not see, and the
principal point moves with the size. The undistorted images are cached next to the data.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# COLMAP's clip on how much the undistorted image may shrink or grow.
_MIN_SCALE, _MAX_SCALE = 0.2, 2.0

# The largest image side a camera may declare. Sizes come from headers (cameras.txt, transforms.json,
# image files) and per-pixel arrays are allocated from them, so a corrupt one must be refused before
# anything is allocated: a 65,536-pixel side is beyond any camera, and its float image is already 48 GiB.
MAX_IMAGE_SIDE = 65_536


def image_size_problem(width: int, height: int) -> str | None:
    """Why a declared image size is unusable, or None if it is fine."""
    if width <= 0 or height <= 0:
        return f"image size {width}x{height} is not positive"
    if width > MAX_IMAGE_SIDE or height > MAX_IMAGE_SIDE:
        return f"image size {width}x{height} exceeds the maximum of {MAX_IMAGE_SIDE:,} pixels a side"
    return None


@dataclass(frozen=True)
class Intrinsics:
    """A camera as the input describes it, at the size of the images in the input's image folder."""

    fx: float
    fy: float
    cx: float
    cy: float
    width: int
    height: int
    dist: tuple[float, float, float, float, float] = (0.0, 0.0, 0.0, 0.0, 0.0)  # k1, k2, p1, p2, k3 (OpenCV)

    @property
    def distorted(self) -> bool:
        return any(d != 0.0 for d in self.dist)

    @property
    def K(self) -> np.ndarray:  # [3, 3]
        return np.array([[self.fx, 0.0, self.cx], [0.0, self.fy, self.cy], [0.0, 0.0, 1.0]])


def distort(xy: np.ndarray, dist: tuple[float, ...]) -> np.ndarray:  # [N, 2] normalised -> [N, 2] distorted
    k1, k2, p1, p2, k3 = dist
    x, y = xy[..., 0], xy[..., 1]
    r2 = x * x + y * y
    radial = 1.0 + r2 * (k1 + r2 * (k2 + r2 * k3))
    xd = x * radial + 2.0 * p1 * x * y + p2 * (r2 + 2.0 * x * x)
    yd = y * radial + p1 * (r2 + 2.0 * y * y) + 2.0 * p2 * x * y
    return np.stack([xd, yd], axis=-1)


def undistort_points(xy_d: np.ndarray, dist: tuple[float, ...], iters: int = 50) -> np.ndarray:  # [N, 2] -> [N, 2]
    """Invert `distort` by Newton's method (the 2x2 Jacobian in closed form)."""
    k1, k2, p1, p2, k3 = dist
    xy = np.array(xy_d, dtype=np.float64)
    for _ in range(iters):
        x, y = xy[..., 0], xy[..., 1]
        r2 = x * x + y * y
        radial = 1.0 + r2 * (k1 + r2 * (k2 + r2 * k3))
        g2 = 2.0 * (k1 + r2 * (2.0 * k2 + 3.0 * k3 * r2))  # d radial / d r2, doubled
        j00 = radial + g2 * x * x + 2.0 * p1 * y + 6.0 * p2 * x
        j01 = g2 * x * y + 2.0 * p1 * x + 2.0 * p2 * y
        j11 = radial + g2 * y * y + 6.0 * p1 * y + 2.0 * p2 * x
        res = distort(xy, dist) - xy_d
        det = j00 * j11 - j01 * j01
        step = np.stack([j11 * res[..., 0] - j01 * res[..., 1], j00 * res[..., 1] - j01 * res[..., 0]], -1)
        xy -= step / det[..., None]
        if np.abs(res).max(initial=0.0) < 1e-14:
            break
    return xy


def _to_normalised(cam: Intrinsics, px: np.ndarray) -> np.ndarray:  # [N, 2] pixels -> [N, 2]
    return (px - [cam.cx, cam.cy]) / [cam.fx, cam.fy]


def _to_pixels(cam: Intrinsics, xy: np.ndarray) -> np.ndarray:  # [N, 2] -> [N, 2] pixels
    return xy * [cam.fx, cam.fy] + [cam.cx, cam.cy]


def undistorted_intrinsics(cam: Intrinsics) -> Intrinsics:
    """The pinhole camera of the undistorted image (COLMAP's UndistortCamera with blank_pixels=0)."""
    if not cam.distorted:
        return cam
    w, h = cam.width, cam.height
    ys, xs = np.arange(h) + 0.5, np.arange(w) + 0.5

    def border(px: np.ndarray) -> np.ndarray:  # distorted border pixels -> pinhole pixels
        return _to_pixels(cam, undistort_points(_to_normalised(cam, px), cam.dist))

    left = border(np.stack([np.full(h, 0.5), ys], -1))[:, 0]
    right = border(np.stack([np.full(h, w - 0.5), ys], -1))[:, 0]
    top = border(np.stack([xs, np.full(w, 0.5)], -1))[:, 1]
    bottom = border(np.stack([xs, np.full(w, h - 0.5)], -1))[:, 1]
    # The largest shrink that keeps every undistorted pixel inside what the source saw.
    inv_x = max(cam.cx / (cam.cx - left.max()), (w - 0.5 - cam.cx) / (right.min() - cam.cx))
    inv_y = max(cam.cy / (cam.cy - top.max()), (h - 0.5 - cam.cy) / (bottom.min() - cam.cy))
    sx = float(np.clip(1.0 / inv_x, _MIN_SCALE, _MAX_SCALE))
    sy = float(np.clip(1.0 / inv_y, _MIN_SCALE, _MAX_SCALE))
    nw, nh = max(1, int(sx * w)), max(1, int(sy * h))
    return Intrinsics(cam.fx, cam.fy, cam.cx * nw / w, cam.cy * nh / h, nw, nh)


def undistort_map(src: Intrinsics, dst: Intrinsics) -> np.ndarray:  # [dst.height, dst.width, 2] float32
    """For each pixel centre of the pinhole `dst`, where it lies (in pixels) in the distorted `src` image."""
    u, v = np.meshgrid(np.arange(dst.width) + 0.5, np.arange(dst.height) + 0.5)
    xy = _to_normalised(dst, np.stack([u, v], -1))
    return _to_pixels(src, distort(xy, src.dist)).astype(np.float32)
