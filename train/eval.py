"""Held-out evaluation: PSNR and SSIM per view, side-by-side PNGs, one metrics line per run."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from train.camera import Camera
from train.exchange import Exchange
from train.logs import RunLog
from train.losses import SSIM_WINDOW, psnr, ssim
from train.lpips import Metric
from train.region import Region
from train.step import render_cameras

# --occlusion on: (cameras, the rank rendering each) -> each camera's owned blocks that can change
# its image, and the Gaussians of this rank's frustum blocks and of its kept ones, summed over them
Cull = Callable[[list[Camera], list[int]], tuple[list[list[str]], int, int]]


def side_by_side(rendered: Tensor, target: Tensor) -> np.ndarray:  # [H, W, 3] each -> [H, 2W, 3] uint8
    both = torch.cat([rendered.clamp(0, 1), target], dim=1)
    return (both.cpu().numpy() * 255.0 + 0.5).astype(np.uint8)


@torch.no_grad()
def evaluate(
    cameras: list[Camera],
    load_image: Callable[[Camera], Tensor],  # camera -> ground truth [H, W, 3]
    step: int,
    region: Region,
    cache,
    exchange: Exchange,
    sh_degree: int,
    background: Tensor,
    backend: str,
    out: Path,
    log: RunLog,
    max_images: int = 0,  # 0: all
    prepare: Callable[[str], None] | None = None,  # called on each block before it is read (dense Adam's catch-up)
    lpips: Metric | None = None,  # train.lpips's metric, where it is installed
    cull: Cull | None = None,  # --occlusion on: each camera's owned blocks that can change its image
) -> dict:
    """Mean PSNR / SSIM (and LPIPS) over the held-out views (rank r renders views r, r+R, ...).
    The views go a round at a time, one a rank, so a rank holds one rendered view at once (and,
    with `cull`, one culling pass)."""
    if max_images:
        cameras = cameras[:max_images]
    if not cameras:
        return {}
    size = exchange.size
    sums = torch.zeros(6, dtype=torch.float64)  # PSNR, SSIM, LPIPS, views, frustum and kept Gaussians
    for first in range(0, len(cameras), size):
        group = cameras[first:first + size]
        cam_rank = [(first + i) % size for i in range(len(group))]
        kept = None
        if cull is not None:
            kept, frustum_gaussians, kept_gaussians = cull(group, cam_rank)
            sums[4:] += torch.tensor([frustum_gaussians, kept_gaussians], dtype=torch.float64)
        rendered = render_cameras(group, cam_rank, region, cache, exchange, sh_degree, background, backend, prepare,
                                  visible=kept)
        for i, raster in rendered.items():
            gt = load_image(group[i]).to(raster.rgb.device)
            sums[:4] += _score(raster.rgb, gt, lpips)
            pair, name = side_by_side(raster.rgb, gt), Path(group[i].name).stem
            path = out / "renders" / f"step_{step:06d}" / f"{name}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(pair).save(path)
            log.image(f"held-out/{name}", step, pair)
        del rendered  # before the next round renders: one round's views held at a time
    total = exchange.sum(sums)
    metrics = {"psnr": float(total[0] / total[3]), "ssim": float(total[1] / total[3]),
               **({"lpips": float(total[2] / total[3])} if lpips is not None else {}), "views": int(total[3]),
               **({"occ_frustum_gaussians": int(total[4]), "occ_kept_gaussians": int(total[5])} if cull else {})}
    log.write("eval", step, **metrics)
    return metrics


def _score(rgb: Tensor, gt: Tensor, lpips: Metric | None) -> Tensor:  # [H, W, 3] each -> [4] float64
    """PSNR, SSIM (NaN on images smaller than its window), LPIPS (NaN without it) and 1."""
    p, s = psnr(rgb, gt), float(ssim(rgb.clamp(0, 1), gt)) if min(rgb.shape[:2]) >= SSIM_WINDOW else float("nan")
    d = lpips(rgb, gt) if lpips is not None else float("nan")
    return torch.tensor([p, s, d, 1.0], dtype=torch.float64)
