"""Pictures drawn without a browser: block boxes over a render, and the top-down block map."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

from train.camera import Camera
from tools.view.colour import block_colours, legend
from tools.view.scene import BlockScene

# The 12 edges of a box as pairs of corner indices; corner i has x from bit 0, y from bit 1, z from bit 2.
BOX_EDGES = np.array([(0, 1), (2, 3), (4, 5), (6, 7), (0, 2), (1, 3), (4, 6), (5, 7), (0, 4), (1, 5), (2, 6), (3, 7)])
# The 12 triangles of a box's faces: each face is the corners with one bit fixed.
BOX_FACES = np.array([(0, 2, 6), (0, 6, 4), (1, 5, 7), (1, 7, 3), (0, 4, 5), (0, 5, 1),
                      (2, 3, 7), (2, 7, 6), (0, 1, 3), (0, 3, 2), (4, 6, 7), (4, 7, 5)])
_NEAR = 1e-3


def box_corners(boxes: np.ndarray) -> np.ndarray:  # [B, 6] -> [B, 8, 3]
    bits = np.array([[(i >> a) & 1 for a in range(3)] for i in range(8)], dtype=np.float64)  # [8, 3]
    lo, hi = boxes[:, None, :3], boxes[:, None, 3:]
    return lo + bits[None] * (hi - lo)


def box_segments(boxes: np.ndarray) -> np.ndarray:  # [B, 6] -> [B, 12, 2, 3]
    return box_corners(boxes)[:, BOX_EDGES]


def draw_outlines(rgb: np.ndarray, camera: Camera, boxes: np.ndarray, colours: np.ndarray) -> np.ndarray:
    """rgb [H, W, 3] uint8 with the edges of `boxes` [B, 6] drawn in `colours` [B, 3], clipped at
    the camera's near plane."""
    image = Image.fromarray(rgb)
    pen = ImageDraw.Draw(image)
    R, t = camera.viewmat[:3, :3], camera.viewmat[:3, 3]
    segs = box_segments(boxes) @ R.T + t  # [B, 12, 2, 3] in camera space
    for b in range(len(boxes)):
        for a, c in segs[b]:
            if a[2] < _NEAR and c[2] < _NEAR:
                continue
            if a[2] < _NEAR or c[2] < _NEAR:  # move the end behind the camera onto the near plane
                s = (_NEAR - a[2]) / (c[2] - a[2])
                a, c = (a + s * (c - a), c) if a[2] < _NEAR else (a, a + s * (c - a))
            p = [tuple((camera.K @ (v / v[2]))[:2]) for v in (a, c)]
            if all(np.isfinite(p).ravel()) and max(abs(v) for v in np.ravel(p)) < 1e6:
                pen.line(p, fill=tuple(int(v) for v in colours[b]), width=1)
    return np.asarray(image)


@dataclass(frozen=True)
class MapLayout:
    """Where the map put the world: world axes `axes` = (a, b) run right and up the image, and
    pixel (u, v) of world coordinates (x_a, x_b) is (margin + (x_a - x0) * scale, height - margin - (x_b - y0) * scale)."""

    axes: tuple[int, int]
    x0: float
    y0: float
    scale: float  # pixels per world unit
    margin: int
    width: int
    height: int

    def pixel(self, x: float, y: float) -> tuple[float, float]:
        return self.margin + (x - self.x0) * self.scale, self.height - self.margin - (y - self.y0) * self.scale


def map_axes(up: tuple[int, int]) -> tuple[int, int]:
    """The horizontal world axes (right, up the image) seen from above along `up` = (axis, sign),
    in the order that keeps the picture a view from above, not a mirror image."""
    axis, sign = up
    a, b = (axis + 1) % 3, (axis + 2) % 3
    return (a, b) if sign > 0 else (b, a)


def map_order(cells: np.ndarray, up: tuple[int, int]) -> np.ndarray:  # [B, 6] -> [B] indices
    """Drawing order of the map: larger cells first, so the small cells of dense regions stay
    visible over the big sparse ones around them; among equal sizes, the highest last."""
    axis, sign = up
    top = cells[:, axis + 3] if sign > 0 else -cells[:, axis]
    return np.lexsort((top, -(cells[:, 3] - cells[:, 0])))


def draw_map(scene: BlockScene, size: int = 1024, mode: str = "owner") -> tuple[np.ndarray, MapLayout]:  # [H, W, 3]
    """The blocks' cells seen from above (an orthographic view down `scene.up`) in `map_order`,
    filled by `mode` colour, with each block's count where it fits, and a legend on the right."""
    cells = scene.cells
    a, b = map_axes(scene.up)
    lo, hi = cells[:, :3].min(0), cells[:, 3:].max(0)
    margin, panel = 16, 320
    span = max(hi[a] - lo[a], hi[b] - lo[b], 1e-12)
    scale = (size - 2 * margin) / span
    height = int(np.ceil((hi[b] - lo[b]) * scale)) + 2 * margin
    layout = MapLayout((a, b), float(lo[a]), float(lo[b]), float(scale), margin, size + panel, max(height, 200))
    image = Image.new("RGB", (layout.width, layout.height), (255, 255, 255))
    pen = ImageDraw.Draw(image)
    colours = block_colours(scene, mode)
    for i in map_order(cells, scene.up):
        u0, v1 = layout.pixel(cells[i, a], cells[i, b])
        u1, v0 = layout.pixel(cells[i, a + 3], cells[i, b + 3])
        pen.rectangle([u0, v0, u1, v1], fill=tuple(int(v) for v in colours[i]), outline=(0, 0, 0))
        text = f"{scene.rows[i].info.count:,}"
        if u1 - u0 > 7 * len(text) and v1 - v0 > 14:
            pen.text(((u0 + u1) / 2, (v0 + v1) / 2), text, fill=(0, 0, 0), anchor="mm")
    x = size + 8
    pen.text((x, margin), f"commit {scene.head}, step {scene.step}: {len(scene.rows)} blocks, "
                          f"{scene.gaussians:,} Gaussians", fill=(0, 0, 0))
    axis, sign = scene.up
    names = "xyz"
    pen.text((x, margin + 16), f"seen from {'+' if sign > 0 else '-'}{names[axis]}: {names[a]} right, {names[b]} up",
             fill=(0, 0, 0))
    for i, (colour, text) in enumerate(legend(scene, mode)):
        y = margin + 40 + 18 * i
        pen.rectangle([x, y, x + 12, y + 12], fill=colour, outline=(0, 0, 0))
        pen.text((x + 18, y), text, fill=(0, 0, 0))
    return np.asarray(image), layout
