"""gsplat's DefaultStrategy, one block at a time: the clone, split and prune rules, and the
opacity reset, applied to every array of a block (`storage.rows`).

The decisions are gsplat's (`gsplat/strategy/default.py`, `_grow_gs` and `_prune_gs`) on the
statistics a block gathered since the last refinement: the mean 2D gradient per contribution,
the largest scale against the scene scale, the largest screen radius. The rows that result are
in gsplat's order: survivors, then clones, then both halves of each split (first halves, then
second halves), less the pruned. Every rule depends on a row's own values only, so a block's
result never depends on the other blocks, which rank refines it, or when it was paged in.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from gsplat.utils import normalized_quat_to_rotmat  # pure torch (the same rotation gsplat's split uses)
from torch import Tensor

from storage.rows import Block, cat_rows, spawn_rows, take_rows
from storage.schema import STAT_NAMES
from train.densify.config import DensifyConfig


@dataclass
class Grown:
    """What a refinement did to one block."""

    block: Block
    cloned: int = 0  # Gaussians duplicated (each adds one)
    split: int = 0  # Gaussians split in two (each adds one net)
    pruned: int = 0  # Gaussians removed
    relocated: int = 0  # MCMC: dead Gaussians removed (as many are drawn again, somewhere, among `added`)
    added: int = 0  # MCMC: Gaussians drawn by opacity (copies of live ones)


def refines_at(step: int, cfg: DensifyConfig) -> bool:
    """Whether step (0-based, after its optimizer update) ends with a refinement, as gsplat's
    `step_post_backward` decides (step > refine_start_iter, on refine_every, outside the pause)."""
    return (cfg.strategy == "default" and cfg.refine_start_iter < step < cfg.stop_iter
            and step % cfg.refine_every == 0 and step % cfg.reset_every >= cfg.pause_refine_after_reset)


def resets_at(step: int, cfg: DensifyConfig) -> bool:
    """Whether step ends with an opacity reset. gsplat 1.5.3 tests `step % reset_every == 0 & step > 0`,
    which Python reads as `step % reset_every == (0 & step) > 0`, never true: it never resets.
    This is the rule it meant (and the original 3DGS code follows)."""
    return cfg.strategy == "default" and step < cfg.stop_iter and step > 0 and step % cfg.reset_every == 0


def grow_masks(block: Block, step: int, cfg: DensifyConfig, scene_scale: float) -> tuple[Tensor, Tensor]:
    """(is_dupli [N], is_split [N]) bool: gsplat's `_grow_gs` decisions."""
    grads = block["grad2d"] / block["count"].to(torch.float32).clamp_min(1)
    is_grad_high = grads > cfg.grow_grad2d
    is_small = torch.exp(block["scales"]).max(dim=-1).values <= cfg.grow_scale3d * scene_scale
    is_split = is_grad_high & ~is_small
    if step < cfg.refine_scale2d_stop_iter:
        is_split |= block["max_radii"] > cfg.grow_scale2d
    return is_grad_high & is_small, is_split


def prune_mask(block: Block, step: int, cfg: DensifyConfig, scene_scale: float) -> Tensor:  # [N] bool
    """gsplat's `_prune_gs` decision: too transparent, or (after the first reset) too large."""
    is_prune = torch.sigmoid(block["opacities"].flatten()) < cfg.prune_opa
    if step > cfg.reset_every:
        is_too_big = torch.exp(block["scales"]).max(dim=-1).values > cfg.prune_scale3d * scene_scale
        if step < cfg.refine_scale2d_stop_iter:
            is_too_big |= block["max_radii"] > cfg.prune_scale2d
        is_prune |= is_too_big
    return is_prune


def _split(block: Block, mask: Tensor, generator: torch.Generator, revised_opacity: bool) -> Block:
    """gsplat's `ops.split`: each masked Gaussian becomes two, sampled from itself, 1.6x smaller."""
    sel, rest = torch.where(mask)[0], torch.where(~mask)[0]
    scales = torch.exp(block["scales"][sel])
    rotmats = normalized_quat_to_rotmat(F.normalize(block["quats"][sel], dim=-1))  # [S, 3, 3]
    noise = torch.randn(2, len(sel), 3, generator=generator).to(scales.device)
    samples = torch.einsum("nij,nj,bnj->bni", rotmats, scales, noise)  # [2, S, 3]
    params = {"means": (block["means"][sel] + samples).reshape(-1, 3),
              "scales": torch.log(scales / 1.6).repeat(2, 1)}
    if revised_opacity:
        params["opacities"] = torch.logit(1.0 - torch.sqrt(1.0 - torch.sigmoid(block["opacities"][sel]))).repeat(2)
    return cat_rows([take_rows(block, rest), spawn_rows(block, sel.repeat(2), params)])


@torch.no_grad()
def refine_block(block: Block, step: int, cfg: DensifyConfig, scene_scale: float,
                 generator: torch.Generator) -> Grown:
    """Clone, split, then prune one block's Gaussians (gsplat's order), and zero its statistics."""
    is_dupli, is_split = grow_masks(block, step, cfg, scene_scale)
    out = Grown(block, cloned=int(is_dupli.sum()), split=int(is_split.sum()))
    if out.cloned:
        out.block = cat_rows([out.block, spawn_rows(out.block, torch.where(is_dupli)[0])])
        # clones are not split
        is_split = torch.cat([is_split, torch.zeros(out.cloned, dtype=torch.bool, device=is_split.device)])
    if out.split:
        out.block = _split(out.block, is_split, generator, cfg.revised_opacity)
    is_prune = prune_mask(out.block, step, cfg, scene_scale)
    out.pruned = int(is_prune.sum())
    if out.pruned:
        out.block = take_rows(out.block, torch.where(~is_prune)[0])
    out.block = dict(out.block)
    for name in STAT_NAMES:
        out.block[name] = torch.zeros_like(out.block[name])
    return out


@torch.no_grad()
def reset_opacities(block: Block, prune_opa: float) -> None:
    """gsplat's `ops.reset_opa` with value 2 x prune_opa, in place: opacities clamped to at most
    that, their Adam moments zeroed (the step count stays, as torch's Adam keeps its step)."""
    limit = torch.logit(torch.tensor(prune_opa * 2.0)).item()
    block["opacities"].clamp_(max=limit)
    block["exp_avg_opacities"].zero_()
    block["exp_avg_sq_opacities"].zero_()
