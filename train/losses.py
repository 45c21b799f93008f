"""Photometric loss and image metrics (3DGS: 0.8 L1 + 0.2 (1 - SSIM); PSNR and SSIM for evaluation)."""
from __future__ import annotations

import torch
from pytorch_msssim import ssim as _ssim
from torch import Tensor

from train.ssim import WINDOW as SSIM_WINDOW  # smaller images fall back to L1
from train.ssim import fused_ssim_applies, ssim_cpu

SSIM_LAMBDA = 0.2  # the D-SSIM term's weight in 3DGS's loss (gsplat's --ssim-lambda)


def ssim(rendered: Tensor, target: Tensor) -> Tensor:  # [H, W, 3] each -> scalar
    """Structural similarity as 3DGS computes it (11x11 Gaussian window, sigma 1.5, valid region)."""
    x = rendered.permute(2, 0, 1).unsqueeze(0)
    y = target.permute(2, 0, 1).unsqueeze(0)
    return _ssim(x, y, data_range=1.0, size_average=True)


def photometric_loss(rendered: Tensor, target: Tensor, ssim_lambda: float = SSIM_LAMBDA) -> Tensor:
    """rendered, target: [H, W, 3] in [0, 1]; returns a scalar."""
    l1 = (rendered - target).abs().mean()
    if min(rendered.shape[0], rendered.shape[1]) < SSIM_WINDOW or ssim_lambda == 0.0:
        return l1
    structure = ssim_cpu(rendered, target) if fused_ssim_applies(rendered, target) else ssim(rendered, target)
    return (1.0 - ssim_lambda) * l1 + ssim_lambda * (1.0 - structure)


def psnr(rendered: Tensor, target: Tensor) -> float:
    mse = torch.mean((rendered.detach().clamp(0, 1) - target) ** 2).item()
    return float("inf") if mse == 0 else -10.0 * float(torch.log10(torch.tensor(mse)))
