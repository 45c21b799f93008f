"""gsplat's MCMCStrategy ("3D Gaussian Splatting as Markov Chain Monte Carlo") over blocks.

At a refinement, dead Gaussians (opacity at most `min_opacity`) are removed and as many new ones,
plus 5% of the scene up to `cap_max`, are sampled from the live ones by opacity; a sampled
Gaussian and its copies share its opacity and scale as the paper's equation 9 divides them
(`relocation`). gsplat draws from one global distribution over every Gaussian; here the draw
is the same distribution made block-wise, so that it does not depend on who holds which block:
the samples are allocated to blocks by their live opacity mass in one keyed multinomial
(`allocate`, identical on every rank), then drawn inside each block by a generator keyed by
(seed, step, block) (`relocate_block`). Copies sit at their source's mean, in its block.

Between refinements, every step perturbs the means it saw with noise scaled by the means
learning rate times `noise_lr` and by how transparent a Gaussian is (`perturb_means`).
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from gsplat.utils import normalized_quat_to_rotmat  # pure torch
from torch import Tensor

from storage.rows import Block, cat_rows, spawn_rows, take_rows
from train.densify.config import DensifyConfig
from train.densify.default import Grown

N_MAX = 51  # gsplat's binomial table: a Gaussian shares its opacity with at most 50 copies


def refines_at(step: int, cfg: DensifyConfig) -> bool:
    """gsplat's MCMCStrategy: refine_start_iter < step < refine_stop_iter, on refine_every."""
    return cfg.strategy == "mcmc" and cfg.refine_start_iter < step < cfg.stop_iter and step % cfg.refine_every == 0


def _share_table() -> np.ndarray:  # [N_MAX + 1, N_MAX] float64
    """T[n, k] = sum over i = k+1..n of C(i-1, k), which is C(n, k+1): equation 9's double sum
    grouped by the power of the new opacity."""
    table = np.zeros((N_MAX + 1, N_MAX))
    for n in range(1, N_MAX + 1):
        for k in range(n):
            table[n, k] = math.comb(n, k + 1)
    return table


_SHARES = _share_table()
_SIGNS = np.array([(-1.0) ** k / math.sqrt(k + 1) for k in range(N_MAX)])


def relocation(opacities: Tensor, scales: Tensor, ratios: Tensor) -> tuple[Tensor, Tensor]:
    """Equation 9 (gsplat's `compute_relocation`): a Gaussian of opacity o and scales s replaced by
    n = ratio copies gets o' = 1 - (1 - o)^(1/n) and s' = o / (sum_i sum_k C(i-1, k) (-1)^k o'^(k+1)
    / sqrt(k+1)) s. opacities [N] and scales [N, 3] activated; ratios [N] clamped to 1..N_MAX.
    In float64 (gsplat's kernel: float32), returned in the inputs' dtype."""
    o = opacities.detach().to(torch.float64).cpu().numpy()
    n = np.clip(ratios.detach().cpu().numpy().astype(np.int64), 1, N_MAX)
    new_o = 1.0 - np.power(1.0 - o, 1.0 / n)
    powers = new_o[:, None] ** np.arange(1, N_MAX + 1)[None, :]  # [N, N_MAX]
    denom = (_SHARES[n] * _SIGNS[None, :] * powers).sum(axis=1)
    coeff = torch.from_numpy(o / denom).to(scales.dtype).to(scales.device)
    return torch.from_numpy(new_o).to(opacities.dtype).to(opacities.device), coeff[:, None] * scales


def summarize(block: Block, cfg: DensifyConfig) -> tuple[float, int]:
    """(live opacity mass, dead Gaussians) of a block, in float64 in row order: every rank gets the
    same numbers for the same block."""
    o = torch.sigmoid(block["opacities"].detach().to(torch.float64).flatten())
    dead = o <= cfg.min_opacity
    return float(o[~dead].sum()), int(dead.sum())


def samples_wanted(total: int, dead: int, cfg: DensifyConfig) -> int:
    """As many samples as dead Gaussians (relocation), plus the growth to min(cap_max, 1.05 N)."""
    return dead + max(0, min(cfg.cap_max, int(1.05 * total)) - total)


def allocate(masses: np.ndarray, samples: int, seed: int, step: int) -> np.ndarray:  # [B] float64 -> [B] int64
    """How many of `samples` draws, by opacity over all live Gaussians, fall in each block: one
    multinomial over the blocks' masses, keyed by (seed, step)."""
    total = float(masses.sum())
    if samples == 0 or total <= 0:
        return np.zeros(len(masses), np.int64)
    rng = np.random.default_rng(np.random.SeedSequence([seed, step, 3]))
    return rng.multinomial(samples, masses / total).astype(np.int64)


@torch.no_grad()
def relocate_block(block: Block, samples: int, cfg: DensifyConfig, generator: torch.Generator) -> Grown:
    """Remove the block's dead Gaussians and add `samples` copies of live ones drawn by opacity;
    each drawn Gaussian and its copies take equation 9's opacity and scales, their Adam moments
    zero (gsplat zeroes a relocated source's too)."""
    dead = torch.sigmoid(block["opacities"].flatten()) <= cfg.min_opacity
    out = Grown(take_rows(block, torch.where(~dead)[0]) if dead.any() else dict(block), relocated=int(dead.sum()))
    if samples == 0:
        return out
    live = out.block
    probs = torch.sigmoid(live["opacities"].flatten()).to(torch.float32).cpu()
    sampled = torch.multinomial(probs, samples, replacement=True, generator=generator).to(live["means"].device)
    ratios = torch.bincount(sampled, minlength=len(probs))[sampled] + 1
    new_o, new_s = relocation(torch.sigmoid(live["opacities"][sampled]), torch.exp(live["scales"][sampled]), ratios)
    eps = torch.finfo(torch.float32).eps
    live = dict(live)
    live["opacities"] = live["opacities"].clone()
    live["scales"] = live["scales"].clone()
    live["opacities"][sampled] = torch.logit(new_o.clamp(min=cfg.min_opacity, max=1.0 - eps))
    live["scales"][sampled] = torch.log(new_s)
    copies = spawn_rows(live, sampled)
    for name in (n for n in live if n.startswith("exp_avg")):
        live[name] = live[name].clone()
        live[name][sampled] = 0
    out.block, out.added = cat_rows([live, copies]), samples
    return out


@torch.no_grad()
def perturb_means(block: Block, rows: Tensor, scaler: float, generator: torch.Generator) -> None:
    """gsplat's `inject_noise_to_position` on `rows` [R] of a block, in place: noise drawn for the
    whole block (keyed, so which rows a step saw does not change the numbers), shaped by each
    Gaussian's covariance and by sigmoid(100 (1 - opacity - 0.995)), times `scaler`."""
    if rows.numel() == 0:
        return
    noise = torch.randn(block["means"].shape, generator=generator).to(block["means"].device)[rows]
    opacities = torch.sigmoid(block["opacities"][rows].flatten())
    scales = torch.exp(block["scales"][rows])
    R = normalized_quat_to_rotmat(F.normalize(block["quats"][rows], dim=-1))  # [R, 3, 3]
    covars = R @ torch.diag_embed(scales**2) @ R.transpose(-1, -2)
    gate = 1.0 / (1.0 + torch.exp(-100.0 * ((1.0 - opacities) - 0.995)))
    block["means"][rows] += torch.einsum("bij,bj->bi", covars, noise * gate[:, None] * scaler)
