"""The cuda backend: gsplat's kernels behind the same Splats2D / RasterOutput contract.

Only call with CUDA tensors: on CPU tensors gsplat starts a minutes-long JIT build and then fails.
"""
from __future__ import annotations

import math

import torch
from gsplat.cuda._wrapper import (
    fully_fused_projection, isect_offset_encode, isect_tiles, rasterize_to_pixels, spherical_harmonics,
)
from torch import Tensor

from train.camera import Camera
from train.render.semantics import EPS2D, FAR_PLANE, NEAR_PLANE, TILE_SIZE, num_sh_bases
from train.render.splats2d import RasterOutput, Splats2D
from train.render.visibility import tile_visibility


def project_cuda(splats: dict[str, Tensor], camera: Camera, sh_degree: int) -> Splats2D:
    means = splats["means"]
    viewmat, K, center = (torch.as_tensor(a, dtype=torch.float32, device=means.device)
                          for a in (camera.viewmat, camera.K, camera.center))
    opacities = torch.sigmoid(splats["opacities"])
    # packed=True returns only the kept rows, which is the Splats2D layout; passing opacities gives
    # the opacity-aware radii and the alpha 1/255 cull.
    _, _, gids, radii, means2d, depths, conics, _ = fully_fused_projection(
        means, None, splats["quats"], torch.exp(splats["scales"]), viewmat[None], K[None],
        camera.width, camera.height, eps2d=EPS2D, near_plane=NEAR_PLANE, far_plane=FAR_PLANE,
        packed=True, opacities=opacities)
    ids = gids.to(torch.int64)
    coeffs = torch.cat([splats["sh0"][ids], splats["shN"][ids, : num_sh_bases(sh_degree) - 1]], dim=1)
    colors = torch.clamp_min(spherical_harmonics(sh_degree, means[ids] - center, coeffs) + 0.5, 0.0)
    if means2d.requires_grad:
        means2d.retain_grad()
    return Splats2D(means2d, conics, depths.detach(), opacities[ids], colors, radii.to(torch.int32), ids)


def rasterize_cuda(splats: Splats2D, width: int, height: int, background: Tensor,
                   absgrad: bool = False) -> RasterOutput:
    device = splats.means2d.device
    if len(splats) == 0:  # gsplat's kernels do not take empty inputs
        return RasterOutput(background.expand(height, width, 3).clone(),
                            torch.zeros(height, width, 1, device=device),
                            torch.zeros(0, dtype=torch.bool, device=device),
                            torch.full((height, width), float("inf"), device=device),
                            (lambda: torch.zeros(0, 2, device=device)) if absgrad else None)
    tiles_x, tiles_y = math.ceil(width / TILE_SIZE), math.ceil(height / TILE_SIZE)
    _, isect_ids, flat_ids = isect_tiles(splats.means2d[None].detach(), splats.radii[None], splats.depths[None],
                                         TILE_SIZE, tiles_x, tiles_y)
    offsets = isect_offset_encode(isect_ids, 1, tiles_x, tiles_y)  # [1, tiles_y, tiles_x]
    means2d = splats.means2d[None]  # gsplat's backward sets .absgrad on this tensor
    rgb, alpha = rasterize_to_pixels(means2d, splats.conics[None], splats.colors[None],
                                     splats.opacities[None], width, height, TILE_SIZE, offsets, flat_ids,
                                     backgrounds=background[None], absgrad=absgrad)
    bounds = torch.cat([offsets.reshape(-1).to(torch.int64), torch.tensor([len(flat_ids)], device=device)])
    contributed, sat_depth = tile_visibility(splats.means2d.detach(), splats.conics.detach(),
                                             splats.opacities.detach(), splats.depths, bounds, flat_ids,
                                             width, height)
    m = len(splats)
    read = (lambda: means2d.absgrad[0] if hasattr(means2d, "absgrad") else torch.zeros(m, 2, device=device))
    return RasterOutput(rgb[0], alpha[0], contributed, sat_depth, read if absgrad else None)
