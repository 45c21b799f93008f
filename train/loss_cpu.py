"""The training loss, (1 - lambda) L1 + lambda (1 - SSIM), on the CPU as one autograd node.

Built from torch ops, the L1 term and its backward were a dozen passes over the image on one core
(subtract, abs, mean; then the backward's expand, divide, sign, multiply and the sum of the two
branches' gradients), and the training PSNR took four more: ~5 ms of a 65 ms step at 270x480.
Here the forward adds the L1 and squared-error row sums to SSIM's fused pass and the backward adds
the L1 term to SSIM's gradient in one pass.

The gradient is bit for bit what autograd gives for the composite expression in
`train.losses.composite_photometric_loss`: the scalar factors are the same float32 torch operations on the
output's gradient (`_scalar_factors`), the L1 term of a pixel is sign(x - y) times its factor
(exact), and it is added to SSIM's gradient in float32 without contraction, as autograd sums the
two branches. The loss value is summed in float64 (torch sums the L1 mean in float32), so it can
differ from the composite's in the last bits; it is logged, never differentiated.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from train.ssim import SsimPass


def _scalar_factors(grad_out: Tensor, ssim_lambda: float, pixels: int) -> tuple[np.float32, float]:
    """The L1 term's per-pixel factor and SSIM's gradient multiple, from the loss's gradient by the
    very float32 operations autograd applies to the composite expression: the weights' multiplies,
    the mean's division, rsub's negation."""
    with torch.no_grad():
        d_l1 = (grad_out * (1.0 - ssim_lambda)) / pixels
        d_ssim = -(grad_out * ssim_lambda)
    return np.float32(float(d_l1)), float(d_ssim)


class _Photometric(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rendered: Tensor, target: Tensor, ssim_lambda: float):  # [H, W, C] each -> loss, mse
        structure = SsimPass(rendered, target)
        ctx.state = (structure, ssim_lambda)
        pixels = structure.x.size
        l1 = np.float32(structure.l1_rows.sum() / pixels)
        loss = torch.tensor((1.0 - ssim_lambda) * float(l1) + ssim_lambda * (1.0 - structure.value),
                            dtype=torch.float32)
        mse = torch.tensor(structure.se_rows.sum() / pixels, dtype=torch.float64)
        ctx.mark_non_differentiable(mse)
        return loss, mse

    @staticmethod
    def backward(ctx, grad_out: Tensor, _grad_mse):
        structure, ssim_lambda = ctx.state
        d_l1, d_ssim = _scalar_factors(grad_out, ssim_lambda, structure.x.size)
        return torch.from_numpy(structure.grad(d_ssim, d_l1)), None, None


def photometric_cpu(rendered: Tensor, target: Tensor, ssim_lambda: float) -> tuple[Tensor, float]:
    """rendered, target: [H, W, C] float32 on the CPU, at least SSIM's window in each direction
    (`train.ssim.fused_ssim_applies`); 0 < ssim_lambda. Returns the loss [] and the mean squared
    error of the rendering clamped to [0, 1] (the training PSNR's)."""
    loss, mse = _Photometric.apply(rendered, target, ssim_lambda)
    return loss, float(mse)
