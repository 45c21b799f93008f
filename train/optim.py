"""Sparse, per-row Adam over block tensors.

A row's moments and its step count change only on steps where its Gaussian contributed to a
pixel. Bias correction uses the row's own step count, so a block that sat on disk for a thousand
steps resumes exactly where it stopped: the update of a row never depends on what other rows did.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numba
import numpy as np
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


@numba.njit(cache=True, fastmath=False, nogil=True)
def _adam_rows_cpu(p, g, m, v, rows, step, lr, b1, b2, eps):  # p, g, m, v [N, D] float32; rows, step [R]
    for i in range(rows.shape[0]):
        r = rows[i]
        bc1 = 1.0 - b1 ** step[i]
        bc2_sqrt = np.sqrt(1.0 - b2 ** step[i])
        for j in range(p.shape[1]):
            gj = g[r, j]
            mj = np.float32(b1 * m[r, j] + (1.0 - b1) * gj)
            vj = np.float32(b2 * v[r, j] + (1.0 - b2) * gj * gj)
            m[r, j] = mj
            v[r, j] = vj
            p[r, j] = np.float32(p[r, j] - (lr / bc1) * mj / (np.sqrt(vj) / bc2_sqrt + eps))


def _adam_rows_torch(
    p: Tensor, g: Tensor, m: Tensor, v: Tensor, rows: Tensor, step: Tensor, lr: float, b1: float, b2: float, eps: float
) -> None:  # p, g, m, v [N, ...]; rows, step [R]
    shape = (-1,) + (1,) * (p.dim() - 1)
    stepf = step.to(torch.float64)
    bc1 = (1.0 - b1**stepf).to(torch.float32).view(shape)
    bc2_sqrt = torch.sqrt(1.0 - b2**stepf).to(torch.float32).view(shape)
    g_r = g[rows]
    m_r = m[rows].mul_(b1).add_(g_r, alpha=1.0 - b1)
    v_r = v[rows].mul_(b2).addcmul_(g_r, g_r, value=1.0 - b2)
    p[rows] = p[rows] - (lr / bc1) * m_r / ((v_r.sqrt() / bc2_sqrt).add_(eps))
    m[rows] = m_r
    v[rows] = v_r


@numba.njit(cache=True, fastmath=False, nogil=True)
def _adam_block_cpu(ps, gs, ms, vs, lrs, rows, step, b1, b2, eps):  # tuples of [N, D_k] float32; lrs [K]
    for k in range(len(ps)):
        _adam_rows_cpu(ps[k], gs[k], ms[k], vs[k], rows, step, lrs[k], b1, b2, eps)


@torch.no_grad()
def sparse_adam_step(
    block: dict[str, Tensor],  # every array of one block (parameters, exp_avg_*, exp_avg_sq_*, adam_step)
    grads: dict[str, Tensor],  # parameter name -> gradient, same shape as the parameter
    rows: Tensor,  # [R] int64, the rows that contributed to a pixel this step
    lrs: dict[str, float],
    cfg: AdamConfig,
    compiled: bool | None = None,  # CPU: one compiled loop instead of ~100 tiny tensor ops (default on CPU)
) -> None:
    """Update `block` in place on `rows` only."""
    if rows.numel() == 0:
        return
    if compiled is None:
        compiled = block["means"].device.type == "cpu"
    step = block["adam_step"][rows] + 1  # [R]
    block["adam_step"][rows] = step
    updated = [f"{prefix}{x}" for prefix in ("", "exp_avg_", "exp_avg_sq_") for x in PARAM_NAMES]
    if compiled and all(block[x].is_contiguous() for x in updated):  # views, so updates land in the block
        # One call for the six parameters: the trainer steps every visible block every step, and
        # per-call overhead (six calls, 24 tensor conversions) cost more than the arithmetic.
        n = block["means"].shape[0]
        p, m, v = (tuple(block[x].reshape(n, -1).numpy() for x in updated[i : i + 6]) for i in (0, 6, 12))
        g = tuple(grads[x].reshape(n, -1).contiguous().numpy() for x in PARAM_NAMES)
        lr = np.array([lrs[x] for x in PARAM_NAMES])
        _adam_block_cpu(p, g, m, v, lr, rows.numpy(), step.numpy(), cfg.betas[0], cfg.betas[1], cfg.eps)
        return
    for name in PARAM_NAMES:
        _adam_rows_torch(block[name], grads[name], block[f"exp_avg_{name}"], block[f"exp_avg_sq_{name}"], rows, step,
                         lrs[name], cfg.betas[0], cfg.betas[1], cfg.eps)
