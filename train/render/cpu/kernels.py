"""Forward and backward tile kernels (numba, one tile per task, both cores).

Each tile walks its depth-sorted list once, keeping the state of its 256 pixels in small arrays
laid out as two 8-pixel-wide half tiles (`_slot`): the rows of a splat's bounding box within a
half are then one contiguous run, which LLVM compiles to AVX2 loops over 8 pixels at a time.
Pixels outside the support ellipse fail the alpha test like any other; the box only saves work.

Nothing per (pixel, splat) is stored: the backward pass recomputes alpha and walks the tile's list
back to front from its last contributor, dividing each pixel's transmittance out as gsplat's CUDA
kernel does and skipping splats at or behind the one that terminated the pixel; it writes one
gradient row per tile intersection, and `reduce_grads` sums them per splat.

exp(-sigma) down a column: sigma is quadratic in the row, so from one row to the next exp(-sigma)
is multiplied by a ratio that is itself multiplied by exp(-c) (c the conic's yy entry) each row.
Both kernels step these two products instead of evaluating `exp_neg` at every pixel, which took
the longest dependency chain out of the pixel loop. Stepping is used only where every sigma in
the half tile's box is at most `_STEP_MAX` (then no product under- or overflows; the relative
error after 16 rows is ~1e-5), otherwise the pixel loop evaluates the exponential. Whether a pixel
passes the alpha test is decided on sigma itself (alpha >= 1/255 exactly where
sigma <= ln(255 o)), so the stepped exponential's error never moves a pixel across that test.

Written for the vectorizer: indices are unsigned (numba's negative-index handling on signed ones
stops vectorization), per-pixel values compared in the loop are float32 so every lane is 32 bits,
and a pixel's state is updated with arithmetic and selects of computed values, never a select
that keeps a loaded value (LLVM turns that into a masked store). All per-pixel state of a tile,
the pixel centres included, lives in one buffer at compile-time offsets (`_X`, `_Y`, ...): LLVM
then proves the loop's loads and stores apart by their constant distance, where separate arrays
cost a runtime overlap check between every pair before each (splat, half tile) loop (~10% of
the kernels' time).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from train.render.cpu.ellipse import (
    BLUE, CA, CB, CC, DEGENERATE, DEPTH, GREEN, HALF_X, HALF_Y, MX, MY, OPACITY, RECORD, RED, THRESHOLD,
    tile_box,
)
from train.render.cpu.fastexp import exp_neg
from train.render.cpu.prefetch import prefetch
from train.render.semantics import ALPHA_MAX, T_MIN, TILE_SIZE

GRAD_COLS = 9  # v_mean x, y; v_conic a, b, c; v_opacity; v_color r, g, b (the wire order)
_HALF_W = 8  # width of a half tile: the float32 lanes of an AVX2 register
LANES = _HALF_W  # the kernels' `lanes` argument
_HALF_PIX = _HALF_W * TILE_SIZE
_NPIX = TILE_SIZE * TILE_SIZE
_AMAX, _TMIN = np.float32(ALPHA_MAX), np.float32(T_MIN)
_ZERO, _HALF, _ONE = np.float32(0.0), np.float32(0.5), np.float32(1.0)
_INF = np.float32(np.inf)  # the depth of a pixel no splat terminated
_NEVER = np.float32(2.0 ** 31)  # the stop position of a pixel that never terminated
_STEP_MAX = np.float32(64.0)  # largest sigma in a box that is stepped (exp(-64) ~ 1.6e-28 stays normal)


def _centres() -> np.ndarray:  # [2 * 256]: x + 0.5 of every slot, then y + 0.5
    """Pixel centres within a tile, per slot."""
    slot = np.arange(_NPIX)
    x = slot // _HALF_PIX * _HALF_W + slot % _HALF_W
    y = slot % _HALF_PIX // _HALF_W
    return np.concatenate([x + 0.5, y + 0.5]).astype(np.float32)


_CENTRES = _centres()
# Offsets of the per-pixel arrays in a tile's buffer. Both kernels: pixel centres x and y, then
# the stepped exp(-sigma) and its row ratio (a row longer: the last row writes the next one's).
# Forward: transmittance, colour. Backward: transmittance, colour gradient, the T_final v_alpha
# term, the colour behind, and the list position that stopped the pixel. 256 floats each.
_X, _Y, _E = np.uint64(0), np.uint64(_NPIX), np.uint64(2 * _NPIX)
_Q = _E + np.uint64(_NPIX + _HALF_W)
_T, _R, _G, _B, _TVA, _BEHIND, _STOP = (_Q + np.uint64(_NPIX + _HALF_W + i * _NPIX) for i in range(7))
_FORWARD_BUF, _BACKWARD_BUF = int(_B) + _NPIX, int(_STOP) + _NPIX
_ROW = np.uint64(_HALF_W)
_RECORD_BYTES = RECORD * 4  # float32 records: one 64-byte cache line each (numba allocates them aligned)
_AHEAD = 8  # records asked for ahead of the copy (16: no better)


@njit(inline="always")
def _tile_buffer(size):  # -> [size] float32: the pixel centres, then zeros
    buf = np.zeros(size, np.float32)
    for i in range(2 * _NPIX):
        buf[i] = _CENTRES[i]
    return buf


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
    """Each record is asked for `_AHEAD` records before it is copied: the list's records lie
    anywhere in the array, and waiting for each in turn cost the tile kernels an eighth of their
    time (0.86-0.88x with the hint on a Zen 3, docs/benchmarks.md)."""
    local = np.empty((n, RECORD), np.float32)
    first = records.ctypes.data
    for k in range(n):
        if k + _AHEAD < n:
            prefetch(first + gids[start + k + _AHEAD] * _RECORD_BYTES)
        g = gids[start + k]
        for col in range(RECORD):  # element by element: a row slice would build a view (see _splat)
            local[k, col] = records[g, col]
    return local


@njit(inline="always")
def _splat(local, k, x0, y0):
    """Record k's mean in tile coordinates, conic, opacity, colour and alpha-test level. Records are
    read by index, never as a row view: a view costs two atomic reference-count updates."""
    return (local[k, MX] - np.float32(x0), local[k, MY] - np.float32(y0), local[k, CA], local[k, CB],
            local[k, CC], local[k, OPACITY], local[k, RED], local[k, GREEN], local[k, BLUE],
            local[k, THRESHOLD])


@njit(inline="always", fastmath=True)
def _sigma(ca, cb, cc, dx, dy):
    return _HALF * (ca * dx * dx + cc * dy * dy) + cb * dx * dy


@njit(inline="always", fastmath=True)
def _steps_safely(bounded, ca, cb, cc, mx, my, half, ya, yb):
    """Whether exp(-sigma) may be stepped down the rows [ya, yb) of a half tile: the conic is
    positive definite (sigma convex, so its largest value on the box is at a corner) and that
    largest value is at most _STEP_MAX."""
    if not bounded:
        return False
    dx0, dx1 = mx - np.float32(half * _HALF_W + 0.5), mx - np.float32(half * _HALF_W + _HALF_W - 0.5)
    dy0, dy1 = my - np.float32(ya + 0.5), my - np.float32(yb - 0.5)
    return max(max(_sigma(ca, cb, cc, dx0, dy0), _sigma(ca, cb, cc, dx0, dy1)),
               max(_sigma(ca, cb, cc, dx1, dy0), _sigma(ca, cb, cc, dx1, dy1))) <= _STEP_MAX


@njit(inline="always", fastmath=True)
def _first_row(buf, base, lanes, mx, my, ca, cb, cc):  # -> exp(-c), the ratio's own factor per row
    """Start stepping a half tile's box: exp(-sigma) on its first row, and the ratio to the next
    row's, exp(sigma(y) - sigma(y + 1)) = exp(-(c / 2 - b dx - c dy)). `lanes` is 8, passed at run
    time so that LLVM vectorizes this loop instead of unrolling it into scalar code."""
    for q in range(lanes):
        p = base + np.uint64(q)
        dx, dy = mx - buf[_X + p], my - buf[_Y + p]
        buf[_E + p] = exp_neg(_sigma(ca, cb, cc, dx, dy))
        buf[_Q + p] = exp_neg(_HALF * cc - cb * dx - cc * dy)
    return exp_neg(cc)


@njit(inline="always", fastmath=True)
def _stepped(buf, p, mx, my, step):  # -> dx, dy, exp(-sigma) at pixel p
    """Pixel p's offset from the mean and its stepped exp(-sigma); moves the column's product and
    ratio on to the next row (step = exp(-c))."""
    dx, dy = mx - buf[_X + p], my - buf[_Y + p]
    vis, ratio = buf[_E + p], buf[_Q + p]
    buf[_E + p + _ROW] = vis * ratio
    buf[_Q + p + _ROW] = ratio * step
    return dx, dy, vis


@njit(inline="always", fastmath=True)
def _over(buf, p, sig, vis, level, o, cr, cg, cbl):  # -> (1 if the splat was blended, 1 if it ended the pixel)
    """Blend one splat over pixel p (front to back), gsplat's rules."""
    alpha = min(_AMAX, o * vis)
    t = buf[_T + p]
    ok = (sig >= _ZERO) & (sig <= level) & (t > _ZERO)
    rest = t * (_ONE - alpha)
    go = ok & (rest > _TMIN)
    ends = ok & (rest <= _TMIN)
    wgt = alpha * t if go else _ZERO
    buf[_R + p] += wgt * cr
    buf[_G + p] += wgt * cg
    buf[_B + p] += wgt * cbl
    buf[_T + p] = t * (_ONE - (alpha if go else _ZERO)) * (-_ONE if ends else _ONE)
    return (_ONE if go else _ZERO), (_ONE if ends else _ZERO)


@njit(inline="always", fastmath=True)
def _under(buf, p, sig, vis, level, kf, o, cr, cg, cbl):  # -> d loss / d opacity, alpha T, c . v
    """Take splat k back out of pixel p (back to front): restores the transmittance in front of it
    and returns the gradient of this pixel's loss w.r.t. the splat's opacity, the weight alpha T
    of its colour (0 if it was not blended here) and its colour dotted with the pixel's colour
    gradient. The gradient w.r.t. sigma is -o times the opacity's (alpha = o exp(-sigma)), so the
    caller sums the opacity's moments and scales them by -o once a splat: a product and a select
    less a pixel. The caller adds weight * (c . v) to the colour behind, after its other uses of
    the weight (in that order LLVM keeps the store unmasked)."""
    alpha = min(_AMAX, o * vis)
    ok = (sig >= _ZERO) & (sig <= level) & (kf < buf[_STOP + p])
    ra = _ONE / (_ONE - alpha)
    t = buf[_T + p] * (ra if ok else _ONE)  # transmittance in front of splat k
    buf[_T + p] = t
    c_dot_v = cr * buf[_R + p] + cg * buf[_G + p] + cbl * buf[_B + p]
    v_alpha_k = t * c_dot_v + ra * (buf[_TVA + p] - buf[_BEHIND + p])
    unclamped = ok & (o * vis <= _AMAX)
    fac = alpha * t if ok else _ZERO
    return (vis * v_alpha_k if unclamped else _ZERO), fac, c_dot_v


@njit(inline="always", fastmath=True)
def _accumulate(acc, buf, p, dx, dy, v_o, fac):  # -> acc with pixel p's terms added
    """The backward's sums over a splat's pixels: moments of d loss / d opacity (x, y, xx, xy, yy),
    which times -o are those of d loss / d sigma and give the conic and mean gradients, d loss /
    d opacity, and the colour weights."""
    sx, sy = v_o * dx, v_o * dy
    return (acc[0] + sx, acc[1] + sy, acc[2] + sx * dx, acc[3] + sx * dy, acc[4] + sy * dy, acc[5] + v_o,
            acc[6] + fac * buf[_R + p], acc[7] + fac * buf[_G + p], acc[8] + fac * buf[_B + p])


@njit(parallel=True, fastmath=True, cache=True, nogil=True)
def forward(offsets, gids, records, order, background, width, height, tiles_x, lanes,
            rgb, alpha, t_final, stop, sat_depth, tile_end, contributed, blended):
    """Composite every tile; writes rgb [H,W,3], alpha [H,W] (1 - t_final), t_final [H,W]
    (transmittance left), stop [H,W] (list position of the splat that terminated the pixel, -1 if
    none), sat_depth [H,W] (the depth of that splat, inf if none), tile_end [tiles] (list position
    of the tile's last contributor, -1 if none), contributed [M] (bool, zeroed by the caller: 1
    where the input row order[g] of record g reached a pixel) and blended [n_isects] (uint8,
    zeroed by the caller: 1 where the entry's splat was blended into a pixel of its tile). The
    per-pixel outputs and the flags in the input's row order are written here, by the tiles'
    threads, rather than in passes over the image on one core after. lanes: 8 (see `_first_row`)."""
    for tile in prange(offsets.size - 1):
        start, n = offsets[tile], offsets[tile + 1] - offsets[tile]
        x0, y0, w, h = _tile_geometry(tile, tiles_x, width, height)
        buf = _tile_buffer(_FORWARD_BUF)
        # Transmittance: positive while live, negated once terminated, 0 outside the image.
        for yy in range(h):
            for xx in range(w):
                buf[_T + np.uint64(_slot(xx, yy))] = _ONE
        stop_at = np.full(_NPIX, -1, np.int32)
        local = _gather(records, gids, start, n)
        done, npix, k_end = _ZERO, np.float32(w * h), -1
        for k in range(n):
            if done >= npix:
                break
            if local[k, HALF_Y] < _ZERO:
                continue
            mx, my, ca, cb, cc, o, cr, cg, cbl, level = _splat(local, k, x0, y0)
            bounded = local[k, HALF_Y] < DEGENERATE
            used, stopped = _ZERO, _ZERO
            xa, xb, ya, yb = tile_box(local[k, HALF_X], local[k, HALF_Y], mx, my, w, h)
            for half in range(xa // _HALF_W, (xb + _HALF_W - 1) // _HALF_W):
                base = np.uint64(half * _HALF_PIX + ya * _HALF_W)
                if _steps_safely(bounded, ca, cb, cc, mx, my, half, ya, yb):
                    step = _first_row(buf, base, lanes, mx, my, ca, cb, cc)
                    for q in range((yb - ya) * _HALF_W):
                        p = base + np.uint64(q)
                        dx, dy, vis = _stepped(buf, p, mx, my, step)
                        u, e = _over(buf, p, _sigma(ca, cb, cc, dx, dy), vis, level, o, cr, cg, cbl)
                        used += u
                        stopped += e
                else:
                    for q in range((yb - ya) * _HALF_W):
                        p = base + np.uint64(q)
                        dx, dy = mx - buf[_X + p], my - buf[_Y + p]
                        sig = _sigma(ca, cb, cc, dx, dy)
                        u, e = _over(buf, p, sig, exp_neg(sig), level, o, cr, cg, cbl)
                        used += u
                        stopped += e
            if used > _ZERO:
                contributed[order[gids[start + k]]] = True
                blended[start + k] = 1
                k_end = k
            if stopped > _ZERO:
                # Rare (once per pixel at most), so kept out of the vector loop: a conditional
                # store there compiles to a masked store, which is slow on AMD cores.
                for half in range(xa // _HALF_W, (xb + _HALF_W - 1) // _HALF_W):
                    base = np.uint64(half * _HALF_PIX + ya * _HALF_W)
                    for p in range(base, base + np.uint64((yb - ya) * _HALF_W)):
                        if buf[_T + p] < _ZERO and stop_at[p] < 0:
                            stop_at[p] = k
                done += stopped
        tile_end[tile] = k_end
        for yy in range(h):
            for xx in range(w):
                p = _slot(xx, yy)
                t = abs(buf[_T + np.uint64(p)])
                rgb[y0 + yy, x0 + xx, 0] = buf[_R + np.uint64(p)] + t * background[0]
                rgb[y0 + yy, x0 + xx, 1] = buf[_G + np.uint64(p)] + t * background[1]
                rgb[y0 + yy, x0 + xx, 2] = buf[_B + np.uint64(p)] + t * background[2]
                t_final[y0 + yy, x0 + xx] = t
                alpha[y0 + yy, x0 + xx] = _ONE - t
                stop[y0 + yy, x0 + xx] = stop_at[p]
                sat_depth[y0 + yy, x0 + xx] = local[stop_at[p], DEPTH] if stop_at[p] >= 0 else _INF


@njit(inline="always", fastmath=True)
def _accumulate_abs(ab, ca, cb, cc, v_o, dx, dy):  # -> ab with |pixel p's 2D mean gradient| / o added
    """AbsGS's statistic: the sum over pixels of each component's absolute per-pixel gradient of
    the 2D mean (d sigma / d mean = (a dx + b dy, b dx + c dy)), divided by the opacity o > 0,
    which the caller multiplies back once a splat."""
    sx, sy = v_o * dx, v_o * dy
    return ab[0] + abs(ca * sx + cb * sy), ab[1] + abs(cb * sx + cc * sy)


@njit(inline="always")
def _zero_row(grads, absgrads, i, want_abs):
    for col in range(grads.shape[1]):
        grads[i, col] = _ZERO
    if want_abs:
        absgrads[i, 0], absgrads[i, 1] = _ZERO, _ZERO


@njit(parallel=True, fastmath=True, cache=True, nogil=True)
def backward(offsets, gids, records, background, width, height, tiles_x, lanes,
             t_final, stop, tile_end, blended, v_rgb, v_alpha, grads, absgrads, want_abs):
    """Gradients of every tile intersection into row i of grads [n_isects, 9], in tile-list order
    (rows of entries past a tile's last contributor, or that `forward` blended into no pixel, are
    zeros, written here by the tile's thread rather than by a one-thread memset of the whole array
    before; 11% of the garden's entries before their tile's end). Rows are written
    as the tiles walk their lists, not where their splat's other rows are: scattered writes into
    the grads array cost a quarter of this kernel's time. With want_abs, absgrads [n_isects, 2]
    gets the sums of absolute per-pixel 2D mean gradients (gsplat's `absgrad`) the same way; the
    loops then carry that sum (a separate pair of loops, so the default's are unchanged).

    With T_k the transmittance in front of splat k, c_k its colour, v the pixel's colour gradient
    and B_k = sum_{j > k} alpha_j T_j (c_j . v) + T_final (background . v), gsplat's
    d loss / d alpha_k is T_k (c_k . v) - (B_k - T_final v_alpha) / (1 - alpha_k); the pixel keeps
    B in one float (`_BEHIND`) instead of a colour, and T_final v_alpha - T_final (background . v)
    in another (`_TVA`)."""
    for tile in prange(offsets.size - 1):
        start = offsets[tile]
        x0, y0, w, h = _tile_geometry(tile, tiles_x, width, height)
        buf = _tile_buffer(_BACKWARD_BUF)
        for p in range(_STOP, _STOP + np.uint64(_NPIX)):
            buf[p] = _NEVER  # the stop position is float32 so the vector loop compares 32-bit lanes
        k_end = tile_end[tile]
        for yy in range(h):
            for xx in range(w):
                p = np.uint64(_slot(xx, yy))
                y, x = y0 + yy, x0 + xx
                vr, vg, vb = v_rgb[y, x, 0], v_rgb[y, x, 1], v_rgb[y, x, 2]
                buf[_T + p] = t_final[y, x]
                buf[_R + p], buf[_G + p], buf[_B + p] = vr, vg, vb
                buf[_TVA + p] = t_final[y, x] * (v_alpha[y, x] - (background[0] * vr + background[1] * vg
                                                                  + background[2] * vb))
                if stop[y, x] >= 0:
                    buf[_STOP + p] = np.float32(stop[y, x])
        for i in range(start + k_end + 1, offsets[tile + 1]):  # past the tile's last contributor
            _zero_row(grads, absgrads, i, want_abs)
        local = _gather(records, gids, start, k_end + 1)
        for k in range(k_end, -1, -1):
            if local[k, HALF_Y] < _ZERO or not blended[start + k]:
                # an entry blended nowhere (alpha test failed, or its pixels had stopped): all zero
                _zero_row(grads, absgrads, start + k, want_abs)
                continue
            mx, my, ca, cb, cc, o, cr, cg, cbl, level = _splat(local, k, x0, y0)
            bounded = local[k, HALF_Y] < DEGENERATE
            kf = np.float32(k)
            acc = (_ZERO, _ZERO, _ZERO, _ZERO, _ZERO, _ZERO, _ZERO, _ZERO, _ZERO)
            ab = (_ZERO, _ZERO)
            xa, xb, ya, yb = tile_box(local[k, HALF_X], local[k, HALF_Y], mx, my, w, h)
            for half in range(xa // _HALF_W, (xb + _HALF_W - 1) // _HALF_W):
                base = np.uint64(half * _HALF_PIX + ya * _HALF_W)
                if _steps_safely(bounded, ca, cb, cc, mx, my, half, ya, yb):
                    step = _first_row(buf, base, lanes, mx, my, ca, cb, cc)
                    if want_abs:
                        for q in range((yb - ya) * _HALF_W):
                            p = base + np.uint64(q)
                            dx, dy, vis = _stepped(buf, p, mx, my, step)
                            v_o, fac, c_dot_v = _under(buf, p, _sigma(ca, cb, cc, dx, dy), vis, level, kf, o, cr, cg, cbl)
                            acc = _accumulate(acc, buf, p, dx, dy, v_o, fac)
                            ab = _accumulate_abs(ab, ca, cb, cc, v_o, dx, dy)
                            buf[_BEHIND + p] += fac * c_dot_v
                    else:
                        for q in range((yb - ya) * _HALF_W):
                            p = base + np.uint64(q)
                            dx, dy, vis = _stepped(buf, p, mx, my, step)
                            v_o, fac, c_dot_v = _under(buf, p, _sigma(ca, cb, cc, dx, dy), vis, level, kf, o, cr, cg, cbl)
                            acc = _accumulate(acc, buf, p, dx, dy, v_o, fac)
                            buf[_BEHIND + p] += fac * c_dot_v
                elif want_abs:
                    for q in range((yb - ya) * _HALF_W):
                        p = base + np.uint64(q)
                        dx, dy = mx - buf[_X + p], my - buf[_Y + p]
                        sig = _sigma(ca, cb, cc, dx, dy)
                        v_o, fac, c_dot_v = _under(buf, p, sig, exp_neg(sig), level, kf, o, cr, cg, cbl)
                        acc = _accumulate(acc, buf, p, dx, dy, v_o, fac)
                        ab = _accumulate_abs(ab, ca, cb, cc, v_o, dx, dy)
                        buf[_BEHIND + p] += fac * c_dot_v
                else:
                    for q in range((yb - ya) * _HALF_W):
                        p = base + np.uint64(q)
                        dx, dy = mx - buf[_X + p], my - buf[_Y + p]
                        sig = _sigma(ca, cb, cc, dx, dy)
                        v_o, fac, c_dot_v = _under(buf, p, sig, exp_neg(sig), level, kf, o, cr, cg, cbl)
                        acc = _accumulate(acc, buf, p, dx, dy, v_o, fac)
                        buf[_BEHIND + p] += fac * c_dot_v
            i = start + k
            if want_abs:
                absgrads[i, 0], absgrads[i, 1] = o * ab[0], o * ab[1]
            m_x, m_y, m_xx, m_xy, m_yy, g_o, g_r, g_g, g_b = acc
            no = -o  # d sigma's moments from d opacity's
            grads[i, 0], grads[i, 1] = no * (ca * m_x + cb * m_y), no * (cb * m_x + cc * m_y)
            grads[i, 2], grads[i, 3], grads[i, 4] = (no * _HALF) * m_xx, no * m_xy, (no * _HALF) * m_yy
            grads[i, 5], grads[i, 6], grads[i, 7], grads[i, 8] = g_o, g_r, g_g, g_b


@njit(parallel=True, cache=True, nogil=True)
def reduce_grads(grads, hit_starts, hit_slots, order):  # grads [n_isects, C] -> [m, C] by the input's rows
    """Sum each record's intersection rows: record i owns the rows hit_slots[hit_starts[i]:
    hit_starts[i + 1]], so records are summed in parallel without write conflicts, into the
    input's row order[i]."""
    m, cols = order.size, grads.shape[1]
    out = np.empty((m, cols), np.float32)  # order is a permutation of the rows: each written once
    for i in prange(m):
        g = order[i]
        for col in range(cols):
            out[g, col] = _ZERO
        for j in range(hit_starts[i], hit_starts[i + 1]):
            row = hit_slots[j]
            for col in range(cols):
                out[g, col] += grads[row, col]
    return out
