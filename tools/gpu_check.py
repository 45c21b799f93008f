"""Render the garden scene with the cuda and the cpu backends and print how far apart they are:
one camera through `render` (image, flags, gradients), then an owner's `project_batch` into all
three cameras, each seeing part of the splats, with one backward (splats and gradients).

    python -m tools.gpu_check [path/to/test_garden.npz]

For a machine with CUDA; without one it says so and exits 0. The cpu backend runs on CPU copies
of the same splats, so both see identical inputs; gradients come from one fixed random loss.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from train.render import project_batch, render
from train.render.splats2d import GRAD_FLOATS
from train.render.errors import RenderError
from train.render.scenes import load_garden

PARAMS = ("means", "scales", "quats", "opacities", "sh0", "shN")
DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "test_garden.npz"


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


def main(argv: list[str]) -> int:
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to compare (run it on a machine with a GPU)")
        return 0
    data = Path(argv[0]) if argv else DEFAULT_DATA
    try:
        report = compare_backends(data) | compare_batch_projection(data)
    except RenderError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for key, value in report.items():
        print(f"{key:>24}: {value:.3e}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
