"""Sparse, per-row Adam over block tensors.

A row's moments and its step count change only on the steps the caller's mask selects (the
trainer's default: its Gaussian contributed to a pixel; `--visible-adam`: a camera projected it).
Bias correction uses the row's own step count, so a block that sat on disk for a thousand steps
resumes exactly where it stopped, or (`global_step`) the training step, as torch's Adam and
gsplat's SelectiveAdam do; either way the update of a row never depends on what other rows did.
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


# float32 arithmetic, as torch's Adam: in float64 (converting every operand) the loop cost ~9 ns
# an element; with reciprocals and fused multiply-adds allowed it costs ~4.
@numba.njit(cache=True, fastmath={"arcp", "contract", "nsz"}, nogil=True)
def _adam_rows_cpu(p, g, m, v, rows, step, lo, lr, b1, b2, eps):
    """p, m, v [N, D] float32 of a block; g [M, D] the gradient of a batch holding the block's
    rows at lo..lo+N; rows, step [R] the block rows to update and their new step counts."""
    b1f, b2f, c1, c2 = np.float32(b1), np.float32(b2), np.float32(1.0 - b1), np.float32(1.0 - b2)
    epsf = np.float32(eps)
    for i in range(rows.shape[0]):
        r = rows[i]
        step_size = np.float32(lr / (1.0 - b1 ** step[i]))
        inv_bc2_sqrt = np.float32(1.0 / math.sqrt(1.0 - b2 ** step[i]))
        for j in range(p.shape[1]):
            gj = g[lo + r, j]
            mj = b1f * m[r, j] + c1 * gj
            vj = b2f * v[r, j] + c2 * gj * gj
            m[r, j] = mj
            v[r, j] = vj
            p[r, j] -= step_size * mj / (np.sqrt(vj) * inv_bc2_sqrt + epsf)


@numba.njit(cache=True, nogil=True)
def _adam_block_cpu(ps, gs, ms, vs, lrs, adam_step, lo, mask, b1, b2, eps, global_step):  # -> rows stepped
    """ps, ms, vs: tuples of a block's [N, D_k] float32 arrays; gs: the batch's [M, D_k]; lrs [K];
    adam_step [N] int32, advanced on the rows whose mask[lo + row] is set; bias correction by
    each row's count, or by global_step where it is positive."""
    n = adam_step.shape[0]
    rows, step = np.empty(n, np.int64), np.empty(n, np.int32)
    k = 0
    for r in range(n):
        if mask[lo + r]:
            adam_step[r] += 1
            rows[k], step[k] = r, (adam_step[r] if global_step <= 0 else global_step)
            k += 1
    for j in range(len(ps)):
        _adam_rows_cpu(ps[j], gs[j], ms[j], vs[j], rows[:k], step[:k], lo, lrs[j], b1, b2, eps)
    return k


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


_UPDATED = tuple(f"{prefix}{x}" for prefix in ("", "exp_avg_", "exp_avg_sq_") for x in PARAM_NAMES)


def numpy_arrays(tensors: dict[str, Tensor]) -> dict[str, np.ndarray] | None:
    """The tensors as numpy arrays [N, D] sharing their memory, as `SparseAdam.step` takes them;
    None unless all are contiguous CPU tensors (the compiled step updates them in place)."""
    if not all(t.device.type == "cpu" and t.is_contiguous() for t in tensors.values()):
        return None
    return {name: t.reshape(t.shape[0], math.prod(t.shape[1:])).numpy() for name, t in tensors.items()}


class SparseAdam:
    """One step of sparse Adam over the blocks of a gathered batch: the batch's gradients and the
    mask of rows to update are converted once, then each block costs one compiled call."""

    def __init__(
        self,
        grads: dict[str, Tensor],  # parameter name -> gradient [M, ...] of the batch
        mask: Tensor,  # [M] bool: the batch rows to update (those that contributed to a pixel)
        lrs: dict[str, float],
        cfg: AdamConfig,
        global_step: int = 0,  # > 0: bias correction by this step (torch's, gsplat's SelectiveAdam), not each row's count
    ) -> None:
        self.grads, self.mask, self.lrs, self.cfg = grads, mask, lrs, cfg
        self.global_step = global_step
        self._compiled = None
        if mask.device.type == "cpu" and all(grads[x].device.type == "cpu" for x in PARAM_NAMES):
            # (explicit widths: a rank that sees nothing this step has an empty batch)
            g = tuple(grads[x].reshape(len(mask), math.prod(grads[x].shape[1:])).contiguous().numpy()
                      for x in PARAM_NAMES)
            self._compiled = g, mask.numpy(), np.array([lrs[x] for x in PARAM_NAMES])

    @torch.no_grad()
    def step(
        self,
        block: dict[str, Tensor],  # every array of one block (parameters, exp_avg_*, exp_avg_sq_*, adam_step)
        lo: int,  # the block's first row in the batch
        arrays: dict[str, np.ndarray] | None = None,  # `numpy_arrays(block)`, kept by the caller; None: torch ops
    ) -> int:
        """Update `block` in place on its masked rows; returns how many rows were updated."""
        n, (b1, b2), eps = block["means"].shape[0], self.cfg.betas, self.cfg.eps
        if arrays is not None and self._compiled is not None:
            # One call for the six parameters: per-call overhead (tensor conversions, indexing
            # the step counts) cost more than the arithmetic of a small block.
            g, m, lr = self._compiled
            p, ms, vs = (tuple(arrays[x] for x in _UPDATED[i : i + 6]) for i in (0, 6, 12))
            return int(_adam_block_cpu(p, g, ms, vs, lr, arrays["adam_step"].reshape(-1), lo, m, b1, b2, eps,
                                       self.global_step))
        rows = torch.nonzero(self.mask[lo : lo + n]).squeeze(1)
        if rows.numel() == 0:
            return 0
        step = block["adam_step"][rows] + 1  # [R]
        block["adam_step"][rows] = step
        if self.global_step > 0:
            step = torch.full_like(step, self.global_step)
        for name in PARAM_NAMES:
            _adam_rows_torch(block[name], self.grads[name][lo : lo + n], block[f"exp_avg_{name}"],
                             block[f"exp_avg_sq_{name}"], rows, step, self.lrs[name], b1, b2, eps)
        return int(rows.numel())


def sparse_adam_step(
    block: dict[str, Tensor],
    grads: dict[str, Tensor],  # parameter name -> gradient, same shape as the parameter
    rows: Tensor,  # [R] int64, the rows that contributed to a pixel this step
    lrs: dict[str, float],
    cfg: AdamConfig,
    compiled: bool | None = None,  # CPU: the compiled loop (default where the block allows it)
) -> None:
    """Update `block` in place on `rows` only (`SparseAdam` for a block on its own)."""
    mask = torch.zeros(block["means"].shape[0], dtype=torch.bool, device=block["means"].device)
    mask[rows] = True
    arrays = numpy_arrays(block) if compiled is not False else None
    if compiled and arrays is None:
        raise ValueError("compiled=True needs contiguous CPU tensors")
    SparseAdam(grads, mask, lrs, cfg).step(block, 0, arrays)
