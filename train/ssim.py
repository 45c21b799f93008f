"""SSIM for the training loss on the CPU: one fused numba pass forward and one backward.

pytorch_msssim, which evaluation uses, runs five separable depthwise convolutions forward and their
transposes backward; at 321x480 that took ~40 ms of a ~270 ms training iteration. This computes the
same function (11-tap Gaussian window, sigma 1.5, K = (0.01, 0.03), data range 1, the valid region,
mean over pixels and channels) and keeps, per valid pixel, the three partial derivatives of SSIM
with respect to the filtered maps it depends on (the means, E[x^2] and E[xy]); the backward filters
those with the transposed window. Tests hold it to pytorch_msssim's value and autograd gradient.

Every output value is computed by one thread in a fixed order and the per-row sums are added in row
order, so the result does not depend on the number of threads (MPI runs compare bit for bit).
"""
from __future__ import annotations

import functools

import numpy as np
import torch
from numba import njit, prange
from torch import Tensor

WINDOW, SIGMA = 11, 1.5
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


# Valid rows per task of the forward: a band's horizontally filtered rows (5 maps x (BAND + 10)
# rows) stay in the core's cache for the vertical pass, instead of five full-image maps written to
# and read back from memory (with their page faults), at the price of filtering the 10 rows
# between bands twice. The values do not depend on it: each is computed in the same order.
_BAND = 32


@njit(parallel=True, fastmath=True, cache=True, nogil=True)
def _ssim_forward(x, y, g):  # x, y [C, H, W] float32 -> row sums [C * Hv] float64, partials 3 x [C, Hv, Wv]
    """SSIM per valid row, and dS/dmu_x, dS/dE[x^2], dS/dE[xy] at every valid pixel."""
    nc, h, w = x.shape
    n = g.size
    hv, wv = h - n + 1, w - n + 1
    bands = (hv + _BAND - 1) // _BAND
    d_mu = np.empty((nc, hv, wv), np.float32)
    d_xx = np.empty((nc, hv, wv), np.float32)
    d_xy = np.empty((nc, hv, wv), np.float32)
    sums = np.zeros(nc * hv, np.float64)
    for task in prange(nc * bands):
        c, i0 = task // bands, task % bands * _BAND
        i1 = min(i0 + _BAND, hv)
        # Horizontal pass: x, y, x^2, y^2, xy filtered along the band's input rows.
        rows = np.zeros((5, i1 - i0 + n - 1, wv), np.float32)
        for i in range(i0, i1 + n - 1):
            xr, yr = x[c, i], y[c, i]
            f0, f1, f2, f3, f4 = rows[0, i - i0], rows[1, i - i0], rows[2, i - i0], rows[3, i - i0], rows[4, i - i0]
            for k in range(n):
                gk = g[k]
                for j in range(wv):
                    a, b = xr[j + k], yr[j + k]
                    f0[j] += gk * a
                    f1[j] += gk * b
                    f2[j] += gk * a * a
                    f3[j] += gk * b * b
                    f4[j] += gk * a * b
        mx, my = np.empty(wv, np.float32), np.empty(wv, np.float32)
        exx, eyy, exy = np.empty(wv, np.float32), np.empty(wv, np.float32), np.empty(wv, np.float32)
        for i in range(i0, i1):
            mx[:], my[:], exx[:], eyy[:], exy[:] = 0.0, 0.0, 0.0, 0.0, 0.0
            for k in range(n):  # vertical pass
                gk = g[k]
                r = i - i0 + k
                for j in range(wv):
                    mx[j] += gk * rows[0, r, j]
                    my[j] += gk * rows[1, r, j]
                    exx[j] += gk * rows[2, r, j]
                    eyy[j] += gk * rows[3, r, j]
                    exy[j] += gk * rows[4, r, j]
            total = 0.0
            for j in range(wv):
                m, u = mx[j], my[j]
                a1, b1 = _TWO * m * u + _C1, m * m + u * u + _C1
                a2, b2 = _TWO * (exy[j] - m * u) + _C2, (exx[j] - m * m) + (eyy[j] - u * u) + _C2
                inv_b1, inv_b2 = _ONE / b1, _ONE / b2
                lum, cs = a1 * inv_b1, a2 * inv_b2
                s = lum * cs
                total += s
                # S = (a1 / b1)(a2 / b2); d/dm through a1 (2u), b1 (2m), a2 (-2u), b2 (-2m).
                d_mu[c, i, j] = _TWO * ((u * cs - m * s) * inv_b1 + (m * s - u * lum) * inv_b2)
                d_xx[c, i, j] = -s * inv_b2
                d_xy[c, i, j] = _TWO * lum * inv_b2
            sums[c * hv + i] = total
    return sums, d_mu, d_xx, d_xy


@njit(parallel=True, fastmath=True, cache=True, nogil=True)
def _ssim_backward(x, y, g, d_mu, d_xx, d_xy, scale):  # -> [H, W, C] float32 d (scale * SSIM) / dx
    """Filter the partials with the transposed window (zero outside the valid region) and apply
    the chain rule through E[x^2] (2x) and E[xy] (y)."""
    nc, h, w = x.shape
    n = g.size
    hv, wv = h - n + 1, w - n + 1
    grad = np.empty((h, w, nc), np.float32)
    for r in prange(nc * h):
        c, i = r // h, r % h
        v0, v1, v2 = np.zeros(wv, np.float32), np.zeros(wv, np.float32), np.zeros(wv, np.float32)
        for k in range(n):  # vertical: rows i - k of the valid region
            src = i - k
            if 0 <= src < hv:
                gk = g[k]
                for j in range(wv):
                    v0[j] += gk * d_mu[c, src, j]
                    v1[j] += gk * d_xx[c, src, j]
                    v2[j] += gk * d_xy[c, src, j]
        o0, o1, o2 = np.zeros(w, np.float32), np.zeros(w, np.float32), np.zeros(w, np.float32)
        for k in range(n):  # horizontal: column j feeds columns j .. j + n - 1
            gk = g[k]
            for j in range(wv):
                o0[j + k] += gk * v0[j]
                o1[j + k] += gk * v1[j]
                o2[j + k] += gk * v2[j]
        for j in range(w):
            grad[i, j, c] = scale * (o0[j] + _TWO * x[c, i, j] * o1[j] + y[c, i, j] * o2[j])
    return grad


class SsimPass:
    """SSIM of two [H, W, C] float32 CPU images, kept for its gradient: the fused forward once,
    then `grad` of any multiple of it (the training loss's node and `ssim_cpu` both use it)."""

    def __init__(self, rendered: Tensor, target: Tensor) -> None:
        self.x = rendered.detach().permute(2, 0, 1).contiguous().numpy()  # [C, H, W]
        self.y = target.detach().permute(2, 0, 1).contiguous().numpy()
        self.g = gaussian_window()
        sums, self.d_mu, self.d_xx, self.d_xy = _ssim_forward(self.x, self.y, self.g)
        self.value = float(np.float32(sums.sum() / self.d_mu.size))

    def grad(self, grad_value: float) -> np.ndarray:  # -> [H, W, C] float32 d (grad_value * SSIM) / d rendered
        scale = np.float32(grad_value / self.d_mu.size)
        return _ssim_backward(self.x, self.y, self.g, self.d_mu, self.d_xx, self.d_xy, scale)


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
