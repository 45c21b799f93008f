"""Sparse, per-row Adam over block tensors.

A row's moments and its step count change only on steps where its Gaussian contributed to a
pixel. Bias correction uses the row's own step count, so a block that sat on disk for a thousand
steps resumes exactly where it stopped: the update of a row never depends on what other rows did.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from storage.schema import PARAM_NAMES


@dataclass(frozen=True)
class AdamConfig:
    """Learning rates follow gsplat's simple_trainer; `means` is scaled by the scene extent."""

    lr: dict[str, float] = field(
        default_factory=lambda: {
            "means": 1.6e-4,
            "scales": 5e-3,
            "quats": 1e-3,
            "opacities": 5e-2,
            "sh0": 2.5e-3,
            "shN": 2.5e-3 / 20,
        }
    )
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-15
    means_lr_final_factor: float = 0.01  # means lr decays exponentially to this fraction over the run

    def for_batch(self, batch_size: int) -> "AdamConfig":
        """gsplat's rule for batched cameras: lr * sqrt(B), eps / sqrt(B), betas ** B."""
        s = math.sqrt(batch_size)
        return AdamConfig(
            lr={k: v * s for k, v in self.lr.items()},
            betas=(self.betas[0] ** batch_size, self.betas[1] ** batch_size),
            eps=self.eps / s,
            means_lr_final_factor=self.means_lr_final_factor,
        )


def learning_rates(cfg: AdamConfig, step: int, max_steps: int, scene_scale: float) -> dict[str, float]:
    lrs = dict(cfg.lr)
    decay = cfg.means_lr_final_factor ** (min(step, max_steps) / max(1, max_steps))
    lrs["means"] = cfg.lr["means"] * scene_scale * decay
    return lrs


@torch.no_grad()
def sparse_adam_step(
    block: dict[str, Tensor],  # every array of one block (parameters, exp_avg_*, exp_avg_sq_*, adam_step)
    grads: dict[str, Tensor],  # parameter name -> gradient, same shape as the parameter
    rows: Tensor,  # [R] int64, the rows that contributed to a pixel this step
    lrs: dict[str, float],
    cfg: AdamConfig,
) -> None:
    """Update `block` in place on `rows` only."""
    if rows.numel() == 0:
        return
    b1, b2 = cfg.betas
    step = block["adam_step"][rows] + 1  # [R]
    block["adam_step"][rows] = step
    stepf = step.to(torch.float64)
    bc1 = (1.0 - b1**stepf).to(torch.float32)  # [R]
    bc2_sqrt = torch.sqrt(1.0 - b2**stepf).to(torch.float32)  # [R]
    for name in PARAM_NAMES:
        g = grads[name][rows]
        p, m, v = block[name], block[f"exp_avg_{name}"], block[f"exp_avg_sq_{name}"]
        shape = (-1,) + (1,) * (g.dim() - 1)
        m_r = m[rows].mul_(b1).add_(g, alpha=1.0 - b1)
        v_r = v[rows].mul_(b2).addcmul_(g, g, value=1.0 - b2)
        denom = (v_r.sqrt() / bc2_sqrt.view(shape)).add_(cfg.eps)
        p[rows] = p[rows] - (lrs[name] / bc1.view(shape)) * m_r / denom
        m[rows] = m_r
        v[rows] = v_r
