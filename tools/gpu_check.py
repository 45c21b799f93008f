"""Render the garden scene with the cuda and the cpu backends and print how far apart they are:
one camera through `render` (image, flags, gradients); an owner's `project_batch` into all three
cameras, each seeing part of the splats, with one backward (splats and gradients); and the same
Splats2D through both rasterizers, with the pixel where they differ most checked against the
float64 dense reference (and whether two splats covering it tie in depth: the backends order
depth ties differently, docs/render.md).

    python -m tools.gpu_check [path/to/test_garden.npz]

For a machine with CUDA; without one it says so and exits 0. The cpu backend runs on CPU copies
of the same splats, so both see identical inputs; gradients come from one fixed random loss.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from tools.bench import data_dir
from train.render import project, project_batch, rasterize, render
from train.render.errors import RenderError
from train.render.reference import rasterize_dense
from train.render.scenes import load_garden
from train.render.splats2d import GRAD_FLOATS, Splats2D

PARAMS = ("means", "scales", "quats", "opacities", "sh0", "shN")
DEFAULT_DATA = data_dir() / "test_garden.npz"


def _render_with_grads(splats: dict, camera, backend: str, device: str) -> tuple[torch.Tensor, ...]:
    params = {k: v.detach().to(device).clone().requires_grad_(True) for k, v in splats.items()}
    rgb, alpha, meta = render(params, camera, 3, background=[0.2, 0.3, 0.4], backend=backend)
    gen = torch.Generator().manual_seed(0)
    weights = torch.rand(rgb.shape, generator=gen).to(device)
    ((rgb * weights).sum() + alpha.sum()).backward()
    grads = tuple(params[k].grad.cpu() for k in PARAMS)
    return rgb.detach().cpu(), alpha.detach().cpu(), meta["ids"].cpu(), meta["contributed"].cpu(), grads


def compare_backends(data: str | Path, camera_index: int = 0) -> dict[str, float]:
    """Max abs image/alpha difference, the fraction of splats whose `contributed` flag differs, and
    per parameter the max abs gradient difference relative to the largest cpu gradient entry."""
    splats, cameras = load_garden(data)
    cam = cameras[camera_index]
    rgb_g, alpha_g, ids_g, contrib_g, grads_g = _render_with_grads(splats, cam, "cuda", "cuda")
    rgb_c, alpha_c, ids_c, contrib_c, grads_c = _render_with_grads(splats, cam, "cpu", "cpu")
    flags_g = torch.zeros(len(splats["means"]), dtype=torch.bool)
    flags_c = torch.zeros_like(flags_g)
    flags_g[ids_g[contrib_g]] = True
    flags_c[ids_c[contrib_c]] = True
    report = {
        "image_max_abs": float((rgb_g - rgb_c).abs().max()),
        "alpha_max_abs": float((alpha_g - alpha_c).abs().max()),
        "projected_cuda": float(len(ids_g)),
        "projected_cpu": float(len(ids_c)),
        "contributed_mismatch": float((flags_g != flags_c).float().mean()),
    }
    for name, g, c in zip(PARAMS, grads_g, grads_c):
        report[f"grad_{name}_rel"] = float((g - c).abs().max() / c.abs().max().clamp_min(1e-12))
    return report


def _batch_with_grads(splats: dict, views: list, weights: dict, backend: str, device: str) -> tuple[dict, tuple]:
    params = {k: v.detach().to(device).clone().requires_grad_(True) for k, v in splats.items()}
    batch = project_batch(params, views, 3, backend=backend)
    kept = {i: s.ids.cpu() for i, s in batch.splats.items()}
    # The same per-splat gradients on both backends: weights are drawn per splat row, not per index.
    batch.backward({i: weights[i][kept[i]].to(device) for i in kept})
    return kept, tuple(params[k].grad.cpu() for k in PARAMS)


def compare_batch_projection(data: str | Path) -> dict[str, float]:
    """Per camera the fraction of splats kept by one backend only, and per parameter the max abs
    gradient difference of one batch backward over three cameras, relative to the cpu's largest."""
    splats, cameras = load_garden(data)
    n = len(splats["means"])
    gen = torch.Generator().manual_seed(1)
    views = [(0, cameras[0], None), (1, cameras[1], torch.randperm(n, generator=gen)[: n // 2].sort().values.numpy()),
             (2, cameras[2], torch.arange(n // 3, n).numpy())]
    weights = {i: torch.rand(n, GRAD_FLOATS, generator=gen) - 0.5 for i, _, _ in views}
    ids_g, grads_g = _batch_with_grads(splats, views, weights, "cuda", "cuda")
    ids_c, grads_c = _batch_with_grads(splats, views, weights, "cpu", "cpu")
    report = {}
    for i in ids_c:
        g, c = set(ids_g[i].tolist()), set(ids_c[i].tolist())
        report[f"batch_cam{i}_kept_mismatch"] = len(g ^ c) / max(1, len(c))
    for name, g, c in zip(PARAMS, grads_g, grads_c):
        report[f"batch_grad_{name}_rel"] = float((g - c).abs().max() / c.abs().max().clamp_min(1e-12))
    return report


def _on(s: Splats2D, device: str, dtype: torch.dtype = torch.float32) -> Splats2D:
    return Splats2D(*(t.to(device, dtype) if t.is_floating_point() else t.to(device)
                      for t in (s.means2d, s.conics, s.depths, s.opacities, s.colors, s.radii, s.ids)))


def compare_rasterizers(data: str | Path, patch: int = 9) -> dict[str, float]:
    """Per camera: max and mean abs difference of the two rasterizers on identical splats, and at
    the worst pixel each one's distance to the float64 dense reference (on a patch around it)."""
    splats, cameras = load_garden(data)
    bg = torch.tensor([0.2, 0.3, 0.4])
    report = {}
    for ci, cam in enumerate(cameras):
        with torch.no_grad():
            s = project(splats, cam, 3)
            cpu = rasterize(s, cam, bg).rgb
            gpu = rasterize(_on(s, "cuda"), cam, bg.cuda(), backend="cuda").rgb.cpu()
        d = (gpu - cpu).abs().amax(-1)
        y, x = divmod(int(d.flatten().argmax()), cam.width)
        x0, y0 = max(0, x - patch // 2), max(0, y - patch // 2)
        near = (((s.means2d[:, 0] - x).abs() < s.radii[:, 0] + patch)
                & ((s.means2d[:, 1] - y).abs() < s.radii[:, 1] + patch))
        sub = _on(s.select(near), "cuda", torch.float64)
        sub.means2d -= torch.tensor([x0, y0], dtype=torch.float64, device="cuda")
        ref = rasterize_dense(sub, patch, patch, bg.double().cuda()).rgb.cpu()[y - y0, x - x0].float()
        dx, dy = s.means2d[:, 0] - (x + 0.5), s.means2d[:, 1] - (y + 0.5)
        sigma = 0.5 * (s.conics[:, 0] * dx * dx + s.conics[:, 2] * dy * dy) + s.conics[:, 1] * dx * dy
        covering = (sigma >= 0) & (s.opacities * torch.exp(-sigma) >= 1.0 / 255.0)
        depths = s.depths[covering]
        report |= {f"raster_cam{ci}_max_abs": float(d.max()), f"raster_cam{ci}_mean_abs": float(d.mean()),
                   f"raster_cam{ci}_pixels_over_1e-2": float((d > 1e-2).sum()),
                   f"raster_cam{ci}_worst_cuda_vs_ref64": float((gpu[y, x] - ref).abs().max()),
                   f"raster_cam{ci}_worst_cpu_vs_ref64": float((cpu[y, x] - ref).abs().max()),
                   f"raster_cam{ci}_worst_depth_ties": float(len(depths) - len(torch.unique(depths)))}
    return report


def main(argv: list[str]) -> int:
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to compare (run it on a machine with a GPU)")
        return 0
    data = Path(argv[0]) if argv else DEFAULT_DATA
    try:
        report = compare_backends(data) | compare_batch_projection(data) | compare_rasterizers(data)
    except RenderError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for key, value in report.items():
        print(f"{key:>24}: {value:.3e}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
