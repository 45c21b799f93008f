"""SSIM for the training loss on the CPU: one fused numba pass forward and one backward.

pytorch_msssim, which evaluation uses, runs five separable depthwise convolutions forward and their
transposes backward; at 321x480 that took ~40 ms of a ~270 ms training iteration. This computes the
same function (11-tap Gaussian window, sigma 1.5, K = (0.01, 0.03), data range 1, the valid region,
mean over pixels and channels) and keeps, per valid pixel, the three partial derivatives of SSIM
with respect to the filtered maps it depends on (the means, E[x^2] and E[xy]); the backward filters
those with the transposed window. Tests hold it to pytorch_msssim's value and autograd gradient.

The training loss's other terms ride along (`train.loss_cpu`): the forward also sums each row's
L1 and squared errors, and the backward adds the L1 term's gradient, so the loss reads and writes
each image once. Both read the [H, W, C] images as they are (no channel-first copies).

Every output value is computed by one thread in a fixed order and the per-row sums are added in row
order, so the result does not depend on the number of threads (MPI runs compare bit for bit).
"""
from __future__ import annotations

import functools

import numba
import numpy as np
import torch
from numba import njit, prange
from torch import Tensor

WINDOW, SIGMA = 11, 1.5
_PAD = WINDOW - 1  # zero rows and columns around the partials' maps: the backward's taps need no bounds tests
_FASTMATH = {"contract", "reassoc", "nsz", "nnan", "ninf", "arcp", "afn"}
# SSIM from the filtered maps without reassociation or approximate reciprocals: its quotients of
# near-equal sums, so computed, moved the SSIM of identical images 1e-6 off 1.
_STRICT = {"contract", "nsz", "nnan", "ninf"}
# The backward adds the L1 term's gradient to SSIM's after rounding, as autograd adds the two
# branches: with contraction allowed anywhere in the kernel LLVM fused the product into that sum.
_NO_CONTRACT = {"nsz"}  # and no "no NaN": sgn(NaN) must stay NaN, as torch gives it
_C1, _C2 = np.float32(0.01 ** 2), np.float32(0.03 ** 2)
_ONE, _TWO = np.float32(1.0), np.float32(2.0)


@functools.lru_cache(maxsize=4)
def gaussian_window(size: int = WINDOW, sigma: float = SIGMA) -> np.ndarray:  # [size] float32
    """The normalised 1D window, computed as pytorch_msssim's `_fspecial_gauss_1d` does, with torch
    in float32: SSIM's variances are differences of near-equal filtered values, so a window that
    differs in the last bit (numpy's exp) moved SSIM by 1e-5 on a real photo."""
    coords = torch.arange(size, dtype=torch.float32) - size // 2
    g = torch.exp(-(coords ** 2) / (2 * sigma ** 2))
    window = (g / g.sum()).numpy()
    window.flags.writeable = False  # one array shared by every caller (cached: torch ops cost 0.15 ms a step)
    return window


# Bands of valid rows per thread in the forward: each band filters the WINDOW - 1 input rows below
# it a second time, and bands of about equal rows keep both cores busy. The values do not depend
# on the split: each is computed in the same order whichever band computes it.
_BANDS_PER_THREAD = 4


def _bands() -> int:
    """The forward's band count, passed in: a kernel that asks numba for its thread count is not
    cached (numba: "uses dynamic globals"), so every process would compile its own."""
    return _BANDS_PER_THREAD * numba.get_num_threads()


@njit(inline="always", fastmath=_FASTMATH)
def _filter_row(src, g, stride, out):  # out[m] = sum_k g[k] src[m + k stride], m < len(out): one map, one row
    """The taps unrolled (WINDOW is a compile-time constant) and the sum kept in a register: the
    vectorizer then works along the row with one store per 8 outputs, where accumulating a row of
    sums tap by tap loaded and stored every sum at every tap. A row holds its pixels' channels
    side by side, so a tap is `stride` (the channel count) elements along."""
    for m in range(np.uint64(out.size)):  # unsigned: a signed index with a run-time stride could be negative
        acc = np.float32(0.0)
        for k in range(WINDOW):
            acc += g[k] * src[m + np.uint64(k) * stride]
        out[m] = acc


@njit(inline="always", fastmath=_FASTMATH)
def _filter_ring(rows, r0, g, out):  # out[m] = sum_k g[k] rows[(r0 + k) % WINDOW, m]: a column in the ring of rows
    for m in range(out.size):
        acc = np.float32(0.0)
        for k in range(WINDOW):
            acc += g[k] * rows[(r0 + k) % WINDOW, m]
        out[m] = acc


# error_model "numpy": numba's default raises on a division by zero, and that test's early exit
# kept LLVM from vectorizing this loop (forward 0.74x on the 50k bench's captured images).
@njit(cache=True, nogil=True, fastmath=_STRICT, error_model="numpy")
def _ssim_row(filtered, s, d_mu, d_xx, d_xy):
    """SSIM s [L] at each value of a valid row from its filtered maps [5, L] (mu_x, mu_y, E[x^2],
    E[y^2], E[xy]), and its partials by mu_x, E[x^2], E[xy] into the three [L] rows. Not
    inlined: a function of its own keeps its own fast-math flags where LLVM inlines it."""
    for m in range(s.size):
        mx, u, exx, eyy, exy = filtered[0, m], filtered[1, m], filtered[2, m], filtered[3, m], filtered[4, m]
        a1, b1 = _TWO * mx * u + _C1, mx * mx + u * u + _C1
        a2, b2 = _TWO * (exy - mx * u) + _C2, (exx - mx * mx) + (eyy - u * u) + _C2
        inv_b1, inv_b2 = _ONE / b1, _ONE / b2
        lum, cs = a1 * inv_b1, a2 * inv_b2
        sm = lum * cs
        s[m] = sm
        # S = (a1 / b1)(a2 / b2); d/dm through a1 (2u), b1 (2m), a2 (-2u), b2 (-2m).
        d_mu[m] = _TWO * ((u * cs - mx * sm) * inv_b1 + (mx * sm - u * lum) * inv_b2)
        d_xx[m] = -sm * inv_b2
        d_xy[m] = _TWO * lum * inv_b2


@njit(parallel=True, fastmath=_FASTMATH, cache=True, nogil=True)
def _ssim_forward(x, y, g, bands):
    """x, y [H, W, C] float32 (H, W >= WINDOW), g [WINDOW], bands: tasks of valid rows (`_bands`,
    which does not change a value) -> SSIM summed over each valid row's
    values [Hv] float64; per input row [H] float64 the sums of |x - y| and of (clamp(x, 0, 1) -
    y)^2; and dS/dmu_x, dS/dE[x^2], dS/dE[xy] at every valid value, three [Hv + 2 PAD, (Wv + 2
    PAD) C] maps (a row's pixels with their channels side by side, as the images hold them) zero
    outside the valid region.

    Each output is a sum over the window's taps, kept in registers with the taps unrolled (WINDOW
    is a compile-time constant), so the vectorizer works along the row: accumulating a row of sums
    one tap at a time loaded and stored all five sums at every tap. Rows are filtered with their
    channels interleaved, as they lie in memory: one channel at a time read them at a stride."""
    h, w, nc = x.shape
    hv, wv = h - WINDOW + 1, w - WINDOW + 1
    xf, yf = x.reshape(h, w * nc), y.reshape(h, w * nc)
    n_in, n_valid, n_pad = w * nc, wv * nc, (wv + 2 * _PAD) * nc
    lead = _PAD * nc  # a padded map row's zero values before its valid ones
    bands = max(1, min(hv, bands))
    d_mu = np.empty((hv + 2 * _PAD, n_pad), np.float32)
    d_xx = np.empty_like(d_mu)
    d_xy = np.empty_like(d_mu)
    sums = np.zeros(hv, np.float64)
    l1, se = np.zeros(h, np.float64), np.zeros(h, np.float64)
    d_mu[:_PAD, :], d_xx[:_PAD, :], d_xy[:_PAD, :] = 0.0, 0.0, 0.0
    d_mu[_PAD + hv:, :], d_xx[_PAD + hv:, :], d_xy[_PAD + hv:, :] = 0.0, 0.0, 0.0
    for b in prange(bands):
        i0, i1 = b * hv // bands, (b + 1) * hv // bands
        # Rows this band sums the errors of: its own, and the last band also those below it.
        own_end = i1 if b < bands - 1 else h
        terms = np.empty((3, n_in), np.float32)  # an input row's x^2, y^2, xy (x and y are read in place)
        # The last WINDOW horizontally filtered rows of each map, input row i at i % WINDOW: ~300 KB
        # for a 480-pixel RGB row, within a core's L2 cache (a whole band's rows were fresh pages,
        # faulted in at every call).
        rows = np.empty((5, WINDOW, n_valid), np.float32)
        filtered, ssim = np.empty((5, n_valid), np.float32), np.empty(n_valid, np.float32)
        for i in range(i0, i1 + WINDOW - 1):
            xr, yr = xf[i], yf[i]
            for m in range(n_in):
                a, bb = xr[m], yr[m]
                terms[0, m], terms[1, m], terms[2, m] = a * a, bb * bb, a * bb
            if i < own_end:
                a1, a2 = 0.0, 0.0
                for m in range(n_in):
                    a, bb = xr[m], yr[m]
                    a1 += abs(np.float64(a) - np.float64(bb))
                    e = np.float64(min(max(a, np.float32(0.0)), _ONE)) - np.float64(bb)
                    a2 += e * e
                l1[i], se[i] = a1, a2
            r = i % WINDOW
            _filter_row(xr, g, np.uint64(nc), rows[0, r])  # horizontal
            _filter_row(yr, g, np.uint64(nc), rows[1, r])
            for q in range(3):
                _filter_row(terms[q], g, np.uint64(nc), rows[2 + q, r])
            io = i - (WINDOW - 1)  # the valid row whose window has just been filled
            if io < i0:
                continue
            for q in range(5):  # vertical
                _filter_ring(rows[q], io, g, filtered[q])
            o = _PAD + io
            d_mu[o, :lead], d_xx[o, :lead], d_xy[o, :lead] = 0.0, 0.0, 0.0
            d_mu[o, lead + n_valid:], d_xx[o, lead + n_valid:], d_xy[o, lead + n_valid:] = 0.0, 0.0, 0.0
            _ssim_row(filtered, ssim, d_mu[o, lead:lead + n_valid], d_xx[o, lead:lead + n_valid],
                      d_xy[o, lead:lead + n_valid])
            total = 0.0
            for m in range(n_valid):
                total += ssim[m]
            sums[io] = total
    return sums, l1, se, d_mu, d_xx, d_xy


@njit(inline="always", fastmath=_NO_CONTRACT)
def _filter_back(rows, r0, c0, g, out):  # out[m] = sum_k g[k] rows[r0 - k, c0 + m]: the transposed window down a column
    for m in range(np.uint64(out.size)):  # c0 unsigned, as `_filter_row`'s stride
        acc = np.float32(0.0)
        for k in range(WINDOW):
            acc += g[k] * rows[r0 - k, c0 + m]
        out[m] = acc


@njit(inline="always", fastmath=_NO_CONTRACT)
def _filter_row_back(src, g, stride, out):  # out[m] = sum_k g[k] src[m + (PAD - k) stride]: the transposed window along a row
    for m in range(np.uint64(out.size)):
        acc = np.float32(0.0)
        for k in range(WINDOW):
            acc += g[k] * src[m + np.uint64(_PAD - k) * stride]
        out[m] = acc


@njit(parallel=True, fastmath=_NO_CONTRACT, cache=True, nogil=True)
def _ssim_backward(x, y, g, d_mu, d_xx, d_xy, scale, l1_factor):
    """-> [H, W, C] float32: d (scale * SSIM) / dx, plus sgn(x - y) * l1_factor (the L1 term's
    gradient, added after rounding as autograd adds the two branches; 0 for SSIM alone). The
    partials filtered with the transposed window (their zero border stands for the taps outside
    the valid region), then the chain rule through E[x^2] (2x) and E[xy] (y). Rows are taken with
    their channels side by side, as `_ssim_forward` does."""
    h, w, nc = x.shape
    wv = w - WINDOW + 1
    n_in, n_valid, lead = w * nc, wv * nc, _PAD * nc
    xf, yf = x.reshape(h, n_in), y.reshape(h, n_in)
    grad = np.empty((h, n_in), np.float32)
    for i in prange(h):
        v = np.zeros((3, (wv + 2 * _PAD) * nc), np.float32)  # zero columns around: the horizontal taps' border
        o = np.empty((3, n_in), np.float32)
        for q, d in enumerate((d_mu, d_xx, d_xy)):
            # vertical: valid rows i - k (padded i + PAD - k), then horizontal: valid columns j - k
            _filter_back(d, i + _PAD, np.uint64(lead), g, v[q, lead:lead + n_valid])
            _filter_row_back(v[q], g, np.uint64(nc), o[q])
        for m in range(n_in):
            xv, yv = xf[i, m], yf[i, m]
            s = scale * (o[0, m] + _TWO * xv * o[1, m] + yv * o[2, m])
            grad[i, m] = s + np.sign(xv - yv) * l1_factor
    return grad.reshape(h, w, nc)


class SsimPass:
    """SSIM of two [H, W, C] float32 CPU images, kept for its gradient: the fused forward once,
    then `grad` of any multiple of it, with an L1 term's gradient added if asked (the training
    loss's node and `ssim_cpu` both use it). The same pass sums the L1 and squared errors per row
    (`l1_rows`, `se_rows`, [H] float64), which the training loss and its PSNR take."""

    def __init__(self, rendered: Tensor, target: Tensor) -> None:
        self.x = rendered.detach().contiguous().numpy()  # [H, W, C]
        self.y = target.detach().contiguous().numpy()
        self.g = gaussian_window()
        h, w, c = self.x.shape
        self.valid = c * (h - WINDOW + 1) * (w - WINDOW + 1)  # SSIM's mean is over these
        sums, self.l1_rows, self.se_rows, self.d_mu, self.d_xx, self.d_xy = _ssim_forward(
            self.x, self.y, self.g, _bands())
        self.value = float(np.float32(sums.sum() / self.valid))

    def grad(self, grad_value: float, l1_factor: np.float32 = np.float32(0.0)) -> np.ndarray:  # -> [H, W, C] float32
        """d (grad_value * SSIM) / d rendered, plus sgn(rendered - target) * l1_factor."""
        scale = np.float32(grad_value / self.valid)
        return _ssim_backward(self.x, self.y, self.g, self.d_mu, self.d_xx, self.d_xy, scale, l1_factor)


class _Ssim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rendered: Tensor, target: Tensor) -> Tensor:  # [H, W, C] each -> scalar
        ctx.state = SsimPass(rendered, target)
        return torch.tensor(ctx.state.value, dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        return torch.from_numpy(ctx.state.grad(float(grad_out))), None


def fused_ssim_applies(rendered: Tensor, target: Tensor) -> bool:
    """Whether `ssim_cpu` can take these: float32 CPU images at least a window wide and tall, with
    no gradient wanted for the target."""
    return (rendered.device.type == "cpu" and rendered.dtype == torch.float32 and target.dtype == torch.float32
            and not target.requires_grad and min(rendered.shape[0], rendered.shape[1]) >= WINDOW)


def ssim_cpu(rendered: Tensor, target: Tensor) -> Tensor:
    """rendered, target: [H, W, C] float32 on the CPU; SSIM as pytorch_msssim computes it."""
    return _Ssim.apply(rendered, target)
