"""`contributed` and `sat_depth` from tile lists, in plain torch (any device).

gsplat's CUDA rasterizer reports neither, so the cuda backend replays compositing without colour:
every pixel walks its tile's depth-sorted list `window` splats at a time, all pixels at once, until
its transmittance would fall to 1e-4 or the list ends. Memory is pixels x window.
"""
from __future__ import annotations

import torch
from torch import Tensor

from train.render.semantics import ALPHA_MAX, ALPHA_MIN, T_MIN, TILE_SIZE


@torch.no_grad()
def tile_visibility(means2d: Tensor,  # [M, 2]
                    conics: Tensor,  # [M, 3]
                    opacities: Tensor,  # [M]
                    depths: Tensor,  # [M]
                    offsets: Tensor,  # [tiles + 1] int, tile t's list is flat_ids[offsets[t]:offsets[t + 1]]
                    flat_ids: Tensor,  # [n_isects] int, rows of the splats, depth-sorted within a tile
                    width: int, height: int, window: int = 32) -> tuple[Tensor, Tensor]:
    """-> contributed [M] bool, sat_depth [H, W] (inf where no splat terminated the pixel)."""
    device = means2d.device
    tiles_x = -(-width // TILE_SIZE)
    ys, xs = torch.meshgrid(torch.arange(height, device=device), torch.arange(width, device=device), indexing="ij")
    tile = (ys // TILE_SIZE * tiles_x + xs // TILE_SIZE).reshape(-1)
    px, py = xs.reshape(-1).to(torch.float32) + 0.5, ys.reshape(-1).to(torch.float32) + 0.5
    offsets, flat_ids = offsets.to(torch.int64), flat_ids.to(torch.int64)
    pos, end = offsets[tile], offsets[tile + 1]
    trans = torch.ones(height * width, dtype=torch.float32, device=device)
    sat_depth = torch.full((height * width,), float("inf"), dtype=torch.float32, device=device)
    contributed = torch.zeros(len(means2d), dtype=torch.bool, device=device)
    steps = torch.arange(window, device=device)
    active = torch.nonzero(pos < end)[:, 0]
    while active.numel():
        j = pos[active, None] + steps  # [A, window]
        inside = j < end[active, None]
        g = flat_ids[torch.where(inside, j, offsets[0])]
        dx = means2d[g, 0] - px[active, None]
        dy = means2d[g, 1] - py[active, None]
        c = conics[g]
        sigma = 0.5 * (c[..., 0] * dx * dx + c[..., 2] * dy * dy) + c[..., 1] * dx * dy
        alpha = torch.clamp_max(opacities[g] * torch.exp(-sigma), ALPHA_MAX)
        valid = inside & (sigma >= 0) & (alpha >= ALPHA_MIN)
        factors = torch.where(valid, 1.0 - alpha, torch.ones_like(alpha))
        # Multiply in the kernels' order (T first) so the stop decisions match them.
        after = torch.cumprod(torch.cat([trans[active, None], factors], 1), 1)[:, 1:]
        stops = valid & (after <= T_MIN)
        before_stop = torch.cumsum(stops.to(torch.int32), 1) == 0
        contributed[g[valid & before_stop]] = True
        stopped = stops.any(1)
        first = torch.argmax(stops.to(torch.int8), 1)
        sat_depth[active[stopped]] = depths[g[stopped, first[stopped]]]
        trans[active] = after[:, -1]
        pos[active] += window
        active = active[~stopped & (pos[active] < end[active])]
    return contributed, sat_depth.reshape(height, width)
