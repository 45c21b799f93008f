"""Photometric loss and image metrics (3DGS: 0.8 L1 + 0.2 (1 - SSIM); PSNR and SSIM for evaluation),
and the MCMC preset's opacity and scale regularisers."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numba
import numpy as np
import torch
from pytorch_msssim import ssim as _ssim
from torch import Tensor

from train.loss_cpu import photometric_cpu
from train.ssim import WINDOW as SSIM_WINDOW  # smaller images fall back to L1
from train.ssim import fused_ssim_applies, ssim_cpu

SSIM_LAMBDA = 0.2  # the D-SSIM term's weight in 3DGS's loss (gsplat's --ssim-lambda)


def ssim(rendered: Tensor, target: Tensor) -> Tensor:  # [H, W, 3] each -> scalar
    """Structural similarity as 3DGS computes it (11x11 Gaussian window, sigma 1.5, valid region)."""
    x = rendered.permute(2, 0, 1).unsqueeze(0)
    y = target.permute(2, 0, 1).unsqueeze(0)
    return _ssim(x, y, data_range=1.0, size_average=True)


def photometric_loss(rendered: Tensor, target: Tensor, ssim_lambda: float = SSIM_LAMBDA) -> Tensor:
    """rendered, target: [H, W, 3] in [0, 1]; returns a scalar (no PSNR: on CUDA it would sync)."""
    if ssim_lambda > 0.0 and fused_ssim_applies(rendered, target):
        return photometric_cpu(rendered, target, ssim_lambda)[0]
    return composite_photometric_loss(rendered, target, ssim_lambda)


def training_loss(rendered: Tensor, target: Tensor, ssim_lambda: float = SSIM_LAMBDA) -> tuple[Tensor, float]:
    """The photometric loss of one training view and its PSNR (dB, of the rendering clamped to
    [0, 1]); on the CPU one fused pass (`train.loss_cpu`: the same gradient bit for bit)."""
    if ssim_lambda > 0.0 and fused_ssim_applies(rendered, target):
        loss, mse = photometric_cpu(rendered, target, ssim_lambda)
        return loss, psnr_of_mse(mse)
    return composite_photometric_loss(rendered, target, ssim_lambda), psnr(rendered, target)


def composite_photometric_loss(rendered: Tensor, target: Tensor, ssim_lambda: float = SSIM_LAMBDA) -> Tensor:
    """The loss in torch operations (any device), with the fused SSIM where it applies."""
    l1 = (rendered - target).abs().mean()
    if min(rendered.shape[0], rendered.shape[1]) < SSIM_WINDOW or ssim_lambda == 0.0:
        return l1
    structure = ssim_cpu(rendered, target) if fused_ssim_applies(rendered, target) else ssim(rendered, target)
    return (1.0 - ssim_lambda) * l1 + ssim_lambda * (1.0 - structure)


def psnr(rendered: Tensor, target: Tensor) -> float:
    return psnr_of_mse(torch.mean((rendered.detach().clamp(0, 1) - target) ** 2).item())


def psnr_of_mse(mse: float) -> float:
    return float("inf") if mse == 0 else -10.0 * float(torch.log10(torch.tensor(mse)))


@numba.njit(cache=True, nogil=True)
def _add_reg_grads(x, g, rows, coeff, sigmoid):  # x, g: [M, K] float32; rows: [n] int64; in place on g
    """coeff * sigmoid'(x), or coeff * exp(x), added to g's rows: one row at a time, so a row's value
    does not depend on where it sits in the batch (torch's vectorised sigmoid rounds the elements
    of a tensor's tail, done by its scalar loop, otherwise than the body: a row's gradient changed
    in the last bit with the number of ranks)."""
    c, one = np.float32(coeff), np.float32(1.0)
    for r in rows:  # in float32, as the loss's autograd computes it
        for j in range(x.shape[1]):
            if sigmoid:
                o = one / (one + math.exp(-x[r, j]))
                g[r, j] += c * o * (one - o)
            else:
                g[r, j] += c * math.exp(x[r, j])


@dataclass(frozen=True)
class Regularizers:
    """gsplat simple_trainer's `opacity_reg` and `scale_reg` (its MCMC preset: 0.01 each): the loss
    gains opacity_reg |sigmoid(opacities)|.mean() + scale_reg |exp(scales)|.mean(), means over every
    Gaussian of the scene. Out of core the terms are never summed; each step adds their gradient
    to the rows Adam steps, which is all gsplat's visible Adam takes of it (the others' part is
    dropped there too). The gradient of a row depends only on the row and the scene's count, so
    it is the same on any number of ranks."""

    opacity_reg: float = 0.0
    scale_reg: float = 0.0
    total: int = 0  # Gaussians in the scene, every rank's: the means' denominator

    @property
    def active(self) -> bool:
        return (self.opacity_reg > 0.0 or self.scale_reg > 0.0) and self.total > 0

    @torch.no_grad()
    def add_grads(
        self,
        params: dict[str, Tensor],  # the batch's leaves: opacities [M] logits, scales [M, 3] log scales
        rows: Tensor,  # [M] bool: the rows Adam steps
    ) -> None:
        """Adds the terms' gradient on `rows` to the leaves' `.grad` (made where backward left none)."""
        if not self.active:
            return
        for name, weight in (("opacities", self.opacity_reg), ("scales", self.scale_reg)):
            if weight <= 0.0:
                continue
            p = params[name]
            if p.grad is None or not p.grad.is_contiguous():
                p.grad = torch.zeros_like(p) if p.grad is None else p.grad.contiguous()
            opacity = name == "opacities"  # d/dx sigmoid(x) / N, else d/dx exp(x) / 3N
            coeff = weight / self.total if opacity else weight / (3 * self.total)
            if p.device.type == "cpu":
                if len(p) == 0:  # a rank that sees none of its blocks this step
                    continue
                x, g = (t.detach().reshape(len(p), -1).contiguous().numpy() for t in (p, p.grad))
                _add_reg_grads(x, g, np.flatnonzero(rows.cpu().numpy()), coeff, opacity)
            else:  # CUDA: torch's elementwise kernels, one code path for every element
                x = p.detach()[rows]
                p.grad[rows] += coeff * (torch.sigmoid(x) * (1.0 - torch.sigmoid(x)) if opacity else torch.exp(x))
