"""Forward and backward tile kernels (numba, one tile per task, both cores).

Each tile walks its depth-sorted list once, keeping the state of its 256 pixels in small arrays
laid out as two 8-pixel-wide half tiles (`_slot`): the rows of a splat's bounding box within a
half are then one contiguous run, which LLVM compiles to AVX2 loops over 8 pixels at a time.
Pixels outside the support ellipse fail the alpha test like any other; the box only saves work.

Nothing per (pixel, splat) is stored: the backward pass recomputes alpha and walks the tile's list
back to front from its last contributor, dividing each pixel's transmittance out as gsplat's CUDA
kernel does and skipping splats at or behind the one that terminated the pixel; it writes one
gradient row per tile intersection, and `reduce_grads` sums them per splat.

Written for the vectorizer: indices are unsigned (numba's negative-index handling on signed ones
stops vectorization), per-pixel values compared in the loop are float32 so every lane is 32 bits,
and a pixel's state is updated with arithmetic and selects of computed values, never a select
that keeps a loaded value (LLVM turns that into a masked store).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from train.render.cpu.ellipse import (
    BLUE, CA, CB, CC, DEPTH, GREEN, HALF_X, HALF_Y, MX, MY, OPACITY, RECORD, RED, tile_box,
)
from train.render.cpu.fastexp import exp_neg
from train.render.semantics import ALPHA_MAX, ALPHA_MIN, T_MIN, TILE_SIZE

GRAD_COLS = 9  # v_mean x, y; v_conic a, b, c; v_opacity; v_color r, g, b (the wire order)
_HALF_W = 8  # width of a half tile: the float32 lanes of an AVX2 register
_HALF_PIX = _HALF_W * TILE_SIZE
_NPIX = TILE_SIZE * TILE_SIZE
_AMIN, _AMAX, _TMIN = np.float32(ALPHA_MIN), np.float32(ALPHA_MAX), np.float32(T_MIN)
_ZERO, _HALF, _ONE = np.float32(0.0), np.float32(0.5), np.float32(1.0)
_NEVER = np.float32(2.0 ** 31)  # the stop position of a pixel that never terminated


def _centres() -> tuple[np.ndarray, np.ndarray]:
    """Pixel centres (x + 0.5, y + 0.5) within a tile, per slot."""
    slot = np.arange(_NPIX)
    x = slot // _HALF_PIX * _HALF_W + slot % _HALF_W
    y = slot % _HALF_PIX // _HALF_W
    return (x + 0.5).astype(np.float32), (y + 0.5).astype(np.float32)


_PX, _PY = _centres()


@njit(inline="always")
def _slot(xx, yy):
    """Where pixel (xx, yy) of a tile keeps its state."""
    return xx // _HALF_W * _HALF_PIX + yy * _HALF_W + xx % _HALF_W


@njit(inline="always")
def _tile_geometry(tile, tiles_x, width, height):
    x0, y0 = (tile % tiles_x) * TILE_SIZE, (tile // tiles_x) * TILE_SIZE
    return x0, y0, min(TILE_SIZE, width - x0), min(TILE_SIZE, height - y0)


@njit(inline="always")
def _gather(records, gids, start, n):  # -> [n, RECORD] the tile's splats, contiguous
    local = np.empty((n, RECORD), np.float32)
    for k in range(n):
        g = gids[start + k]
        for col in range(RECORD):  # element by element: a row slice would build a view (see _splat)
            local[k, col] = records[g, col]
    return local


@njit(inline="always")
def _splat(local, k, x0, y0):
    """Record k's mean in tile coordinates, conic, opacity and colour. Records are read by index,
    never as a row view: a view costs two atomic reference-count updates."""
    return (local[k, MX] - np.float32(x0), local[k, MY] - np.float32(y0), local[k, CA], local[k, CB],
            local[k, CC], local[k, OPACITY], local[k, RED], local[k, GREEN], local[k, BLUE])


@njit(inline="always", fastmath=True)
def _sigma(ca, cb, cc, dx, dy):
    return _HALF * (ca * dx * dx + cc * dy * dy) + cb * dx * dy


@njit(parallel=True, fastmath=True, cache=True)
def forward(offsets, gids, records, background, width, height, tiles_x,
            rgb, t_final, stop, sat_depth, tile_end, contributed):
    """Composite every tile; writes rgb [H,W,3], t_final [H,W] (transmittance left), stop [H,W]
    (list position of the splat that terminated the pixel, -1 if none), sat_depth [H,W] (only
    where a splat terminated the pixel), tile_end [tiles] (list position of the tile's last
    contributor, -1 if none) and contributed [M] (uint8)."""
    for tile in prange(offsets.size - 1):
        start, n = offsets[tile], offsets[tile + 1] - offsets[tile]
        x0, y0, w, h = _tile_geometry(tile, tiles_x, width, height)
        # Positive while live, negated once terminated, 0 outside the image (never composited).
        trans = np.zeros(_NPIX, np.float32)
        for yy in range(h):
            for xx in range(w):
                trans[_slot(xx, yy)] = _ONE
        red = np.zeros(_NPIX, np.float32)
        green = np.zeros(_NPIX, np.float32)
        blue = np.zeros(_NPIX, np.float32)
        stop_at = np.full(_NPIX, -1, np.int32)
        local = _gather(records, gids, start, n)
        done, npix, k_end = _ZERO, np.float32(w * h), -1
        for k in range(n):
            if done >= npix:
                break
            if local[k, HALF_Y] < _ZERO:
                continue
            mx, my, ca, cb, cc, o, cr, cg, cbl = _splat(local, k, x0, y0)
            used, stopped = _ZERO, _ZERO
            xa, xb, ya, yb = tile_box(local[k, HALF_X], local[k, HALF_Y], mx, my, w, h)
            for half in range(xa // _HALF_W, (xb + _HALF_W - 1) // _HALF_W):
                base = np.uint64(half * _HALF_PIX + ya * _HALF_W)
                for q in range((yb - ya) * _HALF_W):
                    p = base + np.uint64(q)
                    dx, dy = mx - _PX[p], my - _PY[p]
                    sig = _sigma(ca, cb, cc, dx, dy)
                    alpha = min(_AMAX, o * exp_neg(sig))
                    t = trans[p]
                    ok = (sig >= _ZERO) & (alpha >= _AMIN) & (t > _ZERO)
                    go = ok & (t * (_ONE - alpha) > _TMIN)
                    ends = ok & (t * (_ONE - alpha) <= _TMIN)
                    wgt = alpha * t if go else _ZERO
                    red[p] += wgt * cr
                    green[p] += wgt * cg
                    blue[p] += wgt * cbl
                    trans[p] = t * (_ONE - (alpha if go else _ZERO)) * (-_ONE if ends else _ONE)
                    used += _ONE if go else _ZERO
                    stopped += _ONE if ends else _ZERO
            if used > _ZERO:
                contributed[gids[start + k]] = 1
                k_end = k
            if stopped > _ZERO:
                # Rare (once per pixel at most), so kept out of the vector loop: a conditional
                # store there compiles to a masked store, which is slow on AMD cores.
                for half in range(xa // _HALF_W, (xb + _HALF_W - 1) // _HALF_W):
                    base = half * _HALF_PIX + ya * _HALF_W
                    for p in range(base, base + (yb - ya) * _HALF_W):
                        if trans[p] < _ZERO and stop_at[p] < 0:
                            stop_at[p] = k
                done += stopped
        tile_end[tile] = k_end
        for yy in range(h):
            for xx in range(w):
                p = _slot(xx, yy)
                t = abs(trans[p])
                rgb[y0 + yy, x0 + xx, 0] = red[p] + t * background[0]
                rgb[y0 + yy, x0 + xx, 1] = green[p] + t * background[1]
                rgb[y0 + yy, x0 + xx, 2] = blue[p] + t * background[2]
                t_final[y0 + yy, x0 + xx] = t
                stop[y0 + yy, x0 + xx] = stop_at[p]
                if stop_at[p] >= 0:
                    sat_depth[y0 + yy, x0 + xx] = local[stop_at[p], DEPTH]


@njit(parallel=True, fastmath=True, cache=True)
def backward(offsets, gids, records, background, width, height, tiles_x,
             t_final, stop, tile_end, v_rgb, v_alpha, grads):
    """Gradients of every tile intersection into row i of grads [n_isects, 9], in tile-list order
    (rows of entries past a tile's last contributor are left as they are: zero). Rows are written
    as the tiles walk their lists, not where their splat's other rows are: scattered writes into
    the grads array cost a quarter of this kernel's time.

    With T_k the transmittance in front of splat k, c_k its colour, v the pixel's colour gradient
    and B_k = sum_{j > k} alpha_j T_j (c_j . v) + T_final (background . v), gsplat's
    d loss / d alpha_k is T_k (c_k . v) - (B_k - T_final v_alpha) / (1 - alpha_k); the pixel keeps
    B in one float (`behind`) instead of a colour, and T_final v_alpha - T_final (background . v)
    in another (`t_v_alpha`)."""
    for tile in prange(offsets.size - 1):
        start = offsets[tile]
        x0, y0, w, h = _tile_geometry(tile, tiles_x, width, height)
        trans = np.zeros(_NPIX, np.float32)
        v_r = np.zeros(_NPIX, np.float32)
        v_g = np.zeros(_NPIX, np.float32)
        v_b = np.zeros(_NPIX, np.float32)
        t_v_alpha = np.zeros(_NPIX, np.float32)
        behind = np.zeros(_NPIX, np.float32)
        stop_at = np.full(_NPIX, _NEVER, np.float32)  # float32 so the vector loop compares 32-bit lanes
        k_end = tile_end[tile]
        for yy in range(h):
            for xx in range(w):
                p = _slot(xx, yy)
                y, x = y0 + yy, x0 + xx
                trans[p] = t_final[y, x]
                v_r[p], v_g[p], v_b[p] = v_rgb[y, x, 0], v_rgb[y, x, 1], v_rgb[y, x, 2]
                t_v_alpha[p] = t_final[y, x] * (v_alpha[y, x] - (background[0] * v_r[p] + background[1] * v_g[p]
                                                                 + background[2] * v_b[p]))
                if stop[y, x] >= 0:
                    stop_at[p] = np.float32(stop[y, x])
        local = _gather(records, gids, start, k_end + 1)
        for k in range(k_end, -1, -1):
            if local[k, HALF_Y] < _ZERO:
                continue
            mx, my, ca, cb, cc, o, cr, cg, cbl = _splat(local, k, x0, y0)
            kf = np.float32(k)
            # Moments of d loss / d sigma over the pixels give the conic and mean gradients.
            m_x, m_y, m_xx, m_xy, m_yy = _ZERO, _ZERO, _ZERO, _ZERO, _ZERO
            g_o, g_r, g_g, g_b = _ZERO, _ZERO, _ZERO, _ZERO
            xa, xb, ya, yb = tile_box(local[k, HALF_X], local[k, HALF_Y], mx, my, w, h)
            for half in range(xa // _HALF_W, (xb + _HALF_W - 1) // _HALF_W):
                base = np.uint64(half * _HALF_PIX + ya * _HALF_W)
                for q in range((yb - ya) * _HALF_W):
                    p = base + np.uint64(q)
                    dx, dy = mx - _PX[p], my - _PY[p]
                    sig = _sigma(ca, cb, cc, dx, dy)
                    vis = exp_neg(sig)
                    alpha = min(_AMAX, o * vis)
                    ok = (sig >= _ZERO) & (alpha >= _AMIN) & (kf < stop_at[p])
                    ra = _ONE / (_ONE - alpha)
                    t = trans[p] * (ra if ok else _ONE)  # transmittance in front of splat k
                    trans[p] = t
                    vr, vg, vb = v_r[p], v_g[p], v_b[p]
                    c_dot_v = cr * vr + cg * vg + cbl * vb
                    v_alpha_k = t * c_dot_v + ra * (t_v_alpha[p] - behind[p])
                    unclamped = ok & (o * vis <= _AMAX)
                    v_sig = -o * vis * v_alpha_k if unclamped else _ZERO
                    sx, sy = v_sig * dx, v_sig * dy
                    m_x += sx
                    m_y += sy
                    m_xx += sx * dx
                    m_xy += sx * dy
                    m_yy += sy * dy
                    g_o += vis * v_alpha_k if unclamped else _ZERO
                    fac = alpha * t if ok else _ZERO
                    g_r += fac * vr
                    g_g += fac * vg
                    g_b += fac * vb
                    behind[p] += fac * c_dot_v
            i = start + k
            grads[i, 0], grads[i, 1] = ca * m_x + cb * m_y, cb * m_x + cc * m_y
            grads[i, 2], grads[i, 3], grads[i, 4] = _HALF * m_xx, m_xy, _HALF * m_yy
            grads[i, 5], grads[i, 6], grads[i, 7], grads[i, 8] = g_o, g_r, g_g, g_b


@njit(parallel=True, cache=True)
def reduce_grads(grads, hit_starts, hit_slots, order, m):  # -> [m, 9]
    """Sum each splat's intersection rows: splat order[i] owns the rows hit_slots[hit_starts[i]:
    hit_starts[i + 1]], so splats are summed in parallel without write conflicts."""
    out = np.zeros((m, GRAD_COLS), np.float32)
    for i in prange(order.size):
        g = order[i]
        for j in range(hit_starts[i], hit_starts[i + 1]):
            row = hit_slots[j]
            for col in range(GRAD_COLS):
                out[g, col] += grads[row, col]
    return out
