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
) -> dict:
    """Mean PSNR / SSIM (and LPIPS) over the held-out views (rank r renders views r, r+R, ...)."""
    if max_images:
        cameras = cameras[:max_images]
    if not cameras:
        return {}
    cam_rank = [i % exchange.size for i in range(len(cameras))]
    rendered = render_cameras(cameras, cam_rank, region, cache, exchange, sh_degree, background, backend, prepare)
    sums = torch.zeros(4, dtype=torch.float64)
    for i, raster in rendered.items():
        rgb = raster.rgb
        gt = load_image(cameras[i]).to(rgb.device)
        p, s = psnr(rgb, gt), float(ssim(rgb.clamp(0, 1), gt)) if min(rgb.shape[:2]) >= SSIM_WINDOW else float("nan")
        d = lpips(rgb, gt) if lpips is not None else float("nan")
        sums += torch.tensor([p, s, d, 1.0], dtype=torch.float64)
        pair, name = side_by_side(rgb, gt), Path(cameras[i].name).stem
        path = out / "renders" / f"step_{step:06d}" / f"{name}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pair).save(path)
        log.image(f"held-out/{name}", step, pair)
    total = exchange.sum(sums)
    metrics = {"psnr": float(total[0] / total[3]), "ssim": float(total[1] / total[3]),
               **({"lpips": float(total[2] / total[3])} if lpips is not None else {}), "views": int(total[3])}
    log.write("eval", step, **metrics)
    return metrics
