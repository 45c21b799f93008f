"""A dense rasterizer in plain torch: every pixel against every splat, autograd for gradients.

It shares no code with the tile kernels (no tiles, no support ellipses, no hand-written backward),
so tests and `python -m tools.bench render` can hold the kernels to it. Memory is pixels x splats:
small scenes only. Runs in the dtype of the splats (float64 for a tight reference).
"""
from __future__ import annotations

import torch
from torch import Tensor

from train.render.semantics import ALPHA_MAX, ALPHA_MIN, T_MIN
from train.render.splats2d import RasterOutput, Splats2D


def depth_order(splats: Splats2D) -> Tensor:  # [M] int64
    """By depth, ties by means2d x, y, opacity, conic a, b, c, colour r, g, b (never by row)."""
    keys = [splats.colors[:, 2], splats.colors[:, 1], splats.colors[:, 0], splats.conics[:, 2], splats.conics[:, 1],
            splats.conics[:, 0], splats.opacities, splats.means2d[:, 1], splats.means2d[:, 0], splats.depths]
    order = torch.arange(len(splats), device=splats.means2d.device)
    for key in keys:  # least significant first, each sort stable
        order = order[torch.argsort(key.detach()[order], stable=True)]
    return order


def rasterize_dense(splats: Splats2D, width: int, height: int, background: Tensor) -> RasterOutput:
    """background: [3]. Same semantics and outputs as `rasterize`."""
    dtype, device = splats.means2d.dtype, splats.means2d.device
    background = background.to(dtype)
    if len(splats) == 0:
        return RasterOutput(background.expand(height, width, 3).clone(),
                            torch.zeros(height, width, 1, dtype=dtype, device=device),
                            torch.zeros(0, dtype=torch.bool, device=device),
                            torch.full((height, width), float("inf"), dtype=dtype, device=device))
    order = depth_order(splats)
    means2d, conics = splats.means2d[order], splats.conics[order]
    opacities, colors, depths = splats.opacities[order], splats.colors[order], splats.depths[order].detach()
    ys, xs = torch.meshgrid(torch.arange(height, dtype=dtype, device=device) + 0.5,
                            torch.arange(width, dtype=dtype, device=device) + 0.5, indexing="ij")
    dx = means2d[None, :, 0] - xs.reshape(-1, 1)  # [P, M]
    dy = means2d[None, :, 1] - ys.reshape(-1, 1)
    sigma = 0.5 * (conics[:, 0] * dx * dx + conics[:, 2] * dy * dy) + conics[:, 1] * dx * dy
    alpha = torch.clamp_max(opacities * torch.exp(-sigma), ALPHA_MAX)
    valid = (sigma >= 0) & (alpha >= ALPHA_MIN)
    alpha = torch.where(valid, alpha, torch.zeros_like(alpha))
    trans = torch.cumprod(torch.cat([torch.ones_like(alpha[:, :1]), 1.0 - alpha], dim=1), dim=1)  # [P, M + 1]
    stops = valid & (trans[:, 1:] <= T_MIN)
    # A pixel keeps the splats strictly in front of its first stopping splat (gsplat's exclusive stop).
    alive = torch.cumsum(stops.to(torch.int32), dim=1) == 0
    weights = torch.where(alive, alpha * trans[:, :-1], torch.zeros_like(alpha))
    stopped = stops.any(dim=1)
    first_stop = torch.argmax(stops.to(torch.int8), dim=1)
    t_final = torch.where(stopped, trans.gather(1, first_stop[:, None])[:, 0], trans[:, -1])
    rgb = weights @ colors + t_final[:, None] * background
    sat_depth = torch.where(stopped, depths[first_stop], torch.full_like(t_final, float("inf")))
    contributed = torch.zeros(len(order), dtype=torch.bool, device=device)
    contributed[order] = (valid & alive).any(dim=0)
    return RasterOutput(rgb.reshape(height, width, 3), (1.0 - t_final).reshape(height, width, 1),
                        contributed, sat_depth.detach().reshape(height, width))
