"""Where a splat can matter: the ellipse sigma <= ln(255 * opacity), outside which alpha < 1/255.

Binning (which tiles) and the kernels (which rows and columns of a tile) both use it, so a splat
is evaluated only at pixels where it may pass the alpha test; the per-pixel test stays the authority,
and every bound here is widened a little so float rounding can never drop a pixel that passes.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from train.render.semantics import ALPHA_MIN

# Columns of the per-splat record the kernels gather per tile (float32, one 64-byte row a splat).
# THRESHOLD is ln(255 o): alpha passes 1/255 exactly where sigma <= THRESHOLD. LEVEL is THRESHOLD
# widened, for the bounds (binning, boxes).
MX, MY, CA, CB, CC, OPACITY, RED, GREEN, BLUE, DEPTH, LEVEL, HALF_X, HALF_Y, INV_A, INV_C, THRESHOLD = range(16)
RECORD = 16
DEGENERATE = np.float32(1e30)  # HALF_Y of a splat whose conic is not positive definite: no bound
_WIDEN_REL, _WIDEN_ABS = 1e-3, 1e-3
_ALPHA_MIN32 = np.float32(ALPHA_MIN)
SPAN_EPS = np.float32(1e-3)  # pixels added to each end of a row or column span


@njit(inline="always", fastmath=True)
def write_record(rec, i, means2d, conics, opacities, colors, depths, g):
    """Record i of rec [M, RECORD] from input row g ([M, 2], [M, 3], [M], [M, 3], [M] float32
    inputs): its means, conic, opacity, colour and depth, and its support ellipse in the forms the
    kernels and binning use. Every column is written (0 where a form does not apply), so rec need
    not be zeroed first: one thread zeroing all of it cost the binning a fifth of its records pass."""
    a, b, c, o = conics[g, 0], conics[g, 1], conics[g, 2], opacities[g]
    rec[i, MX], rec[i, MY] = means2d[g, 0], means2d[g, 1]
    rec[i, CA], rec[i, CB], rec[i, CC], rec[i, OPACITY] = a, b, c, o
    rec[i, RED], rec[i, GREEN], rec[i, BLUE] = colors[g, 0], colors[g, 1], colors[g, 2]
    rec[i, DEPTH] = depths[g]
    rec[i, INV_A], rec[i, INV_C] = 0.0, 0.0
    if o < _ALPHA_MIN32:
        rec[i, LEVEL] = -1.0  # no pixel can pass the alpha test
        rec[i, HALF_X] = -1.0
        rec[i, HALF_Y] = -1.0
        rec[i, THRESHOLD] = 0.0
        return
    threshold = math.log(float(o) / ALPHA_MIN)
    rec[i, THRESHOLD] = threshold
    level = threshold * (1.0 + _WIDEN_REL) + _WIDEN_ABS
    rec[i, LEVEL] = level
    det = float(a) * float(c) - float(b) * float(b)
    if a > 0.0 and det > 0.0:
        # Half extents of the ellipse, sqrt(2 L Sigma_xx) and sqrt(2 L Sigma_yy), Sigma = conic^-1.
        rec[i, HALF_X] = math.sqrt(2.0 * level * c / det)
        rec[i, HALF_Y] = math.sqrt(2.0 * level * a / det)
        rec[i, INV_A], rec[i, INV_C] = 1.0 / a, 1.0 / c
    else:
        rec[i, HALF_X] = DEGENERATE
        rec[i, HALF_Y] = DEGENERATE


_SPAN_WIDEN_ABS, _SPAN_WIDEN_REL = 1e-2, 1e-4  # pixels added to a band's span, absolute and per pixel of extent


@njit(inline="always")
def band_span(mx, my, a, b, c, inv_a, inv_c, level, py0, py1):  # -> x0, x1 (x0 > x1: the band misses)
    """The x extent of the ellipse 0.5 a dx^2 + b dx dy + 0.5 c dy^2 <= level about (mx, my)
    (d = mean - pixel, a, c and the determinant > 0) within the band py0 <= y <= py1, widened
    a little so that rounding never drops a pixel centre the ellipse reaches.

    For each dy the ellipse spans dx in (-b dy -+ sqrt(2 a level - det dy^2)) / a: the upper end is
    concave in dy, largest at the ellipse's extreme point dy = -b hx / c (hx its half width), and
    otherwise at the band's end nearest to it; the lower end mirrors it."""
    det = float(a) * float(c) - float(b) * float(b)
    hx, hy = math.sqrt(2.0 * level * c / det), math.sqrt(2.0 * level * a / det)
    widen = _SPAN_WIDEN_ABS + _SPAN_WIDEN_REL * (hx + hy)
    lo, hi = max(my - py1, -hy - widen), min(my - py0, hy + widen)
    if lo > hi:
        return 1.0, 0.0
    tip = -b * hx * inv_c
    top, bottom = min(max(tip, lo), hi), min(max(-tip, lo), hi)
    dx_max = (-b * top + math.sqrt(max(2.0 * a * level - det * top * top, 0.0))) * inv_a
    dx_min = (-b * bottom - math.sqrt(max(2.0 * a * level - det * bottom * bottom, 0.0))) * inv_a
    return mx - dx_max - widen, mx - dx_min + widen


@njit(inline="always", fastmath=True)
def _span(centre, half, n):
    """Pixels [a, b) of 0..n-1 whose centres i + 0.5 lie within centre +- half."""
    if half >= DEGENERATE:
        return 0, n
    a = max(0, int(np.ceil(centre - half - np.float32(0.5) - SPAN_EPS)))
    b = min(n, int(np.floor(centre + half - np.float32(0.5) + SPAN_EPS)) + 1)
    return a, b


@njit(inline="always", fastmath=True)
def tile_box(half_x, half_y, mx_local, my_local, w, h):
    """The pixels [xa, xb) x [ya, yb) of a w x h tile (mean in tile coordinates) inside the
    ellipse's bounding box (half extents from the record)."""
    xa, xb = _span(mx_local, half_x, w)
    ya, yb = _span(my_local, half_y, h)
    return xa, xb, ya, yb
