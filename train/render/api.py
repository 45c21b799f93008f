"""`project`, `rasterize` and `render = rasterize . project`, checked and dispatched to a backend.

"cpu": numba kernels for projection and rasterization behind torch autograd (CPU tensors).
"cuda": gsplat's CUDA kernels (CUDA tensors). Both give the same Splats2D and RasterOutput.
"""
from __future__ import annotations

from typing import Literal, Sequence

import torch
from torch import Tensor

from train.camera import Camera
from train.render.cpu.function import rasterize_cpu
from train.render.batch import AutogradBatch, ProjectedBatch, View
from train.render.cpu.projection import CpuProjectedBatch, project_cpu
from train.render.errors import RenderError, all_finite, first_nonfinite, nonfinite
from train.render.semantics import MAX_SH_DEGREE, num_sh_bases
from train.render.splats2d import RasterOutput, Splats2D

Backend = Literal["cpu", "cuda"]
BACKENDS = ("cpu", "cuda")
SPLAT_KEYS = ("means", "scales", "quats", "opacities", "sh0", "shN")


def check_splats(splats: dict[str, Tensor], sh_degree: int, finite: bool = True) -> None:
    """Raise RenderError unless `splats` has gsplat's names, shapes and enough SH coefficients,
    and (with `finite`) every value the degree reads is finite. The CPU projection tests the values
    itself as it reads each row (`cpu.projection._project`), so its callers pass finite=False: a
    pass of its own over the whole batch, cold in memory, cost ~0.9 ms of a 50k-Gaussian step."""
    missing = [k for k in SPLAT_KEYS if k not in splats]
    if missing:
        raise RenderError(f"splats: missing {', '.join(missing)} (need {', '.join(SPLAT_KEYS)})")
    for name in SPLAT_KEYS:
        if not isinstance(splats[name], Tensor):
            raise RenderError(f"splats['{name}']: a {type(splats[name]).__name__}, expected a torch.Tensor")
    n = splats["means"].shape[0]
    k = splats["shN"].shape[1] if splats["shN"].ndim == 3 else -1
    expected = {"means": (n, 3), "scales": (n, 3), "quats": (n, 4), "opacities": (n,), "sh0": (n, 1, 3),
                "shN": (n, k, 3)}
    device = splats["means"].device
    for name, shape in expected.items():
        t = splats[name]
        if tuple(t.shape) != shape:
            raise RenderError(f"splats['{name}']: shape {tuple(t.shape)}, expected {shape}")
        if t.dtype != torch.float32:
            raise RenderError(f"splats['{name}']: dtype {t.dtype}, expected float32")
        if t.device != device:
            raise RenderError(f"splats['{name}']: on {t.device}, means on {device}")
    if not 0 <= sh_degree <= MAX_SH_DEGREE:
        raise RenderError(f"sh_degree {sh_degree}: must be in 0..{MAX_SH_DEGREE}")
    used = num_sh_bases(sh_degree) - 1
    if used > k:
        raise RenderError(f"sh_degree {sh_degree} needs {used} shN coefficients, splats['shN'] has {k}")
    # Coefficients above the degree are never read: a NaN there cannot reach the image.
    bad = first_nonfinite((name, splats[name] if name != "shN" else splats[name][:, :used])
                          for name in SPLAT_KEYS) if finite else None
    if bad is not None:
        raise bad


def _check_backend(backend: str, device: torch.device, what: str) -> None:
    if backend not in BACKENDS:
        raise RenderError(f"unknown render backend {backend!r} (choose from {', '.join(BACKENDS)})")
    if backend == "cuda" and device.type != "cuda":
        raise RenderError(f"backend 'cuda' needs {what} on a CUDA device, got {device}")


def _background(background: Tensor | Sequence[float] | None, device: torch.device) -> Tensor:  # [3]
    if background is None:
        return torch.zeros(3, dtype=torch.float32, device=device)
    try:
        bg = torch.as_tensor(background, dtype=torch.float32).detach().to(device)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise RenderError(f"background: {exc}") from exc
    if bg.shape != (3,):
        raise RenderError(f"background: shape {tuple(bg.shape)}, expected [3]")
    if not all_finite(bg):
        raise nonfinite("background")
    return bg


def project(splats: dict[str, Tensor], camera: Camera, sh_degree: int, backend: Backend = "cpu",
            check: bool = True) -> Splats2D:
    """The splats that land in `camera`'s image, differentiable w.r.t. every splat parameter;
    `ids` are their rows in `splats`. check=False skips `check_splats` for a caller that checked
    these splats already (the trainer projects one batch for many cameras)."""
    if check:
        check_splats(splats, sh_degree, finite=backend != "cpu")
    device = splats["means"].device
    _check_backend(backend, device, "the splats")
    if backend == "cuda":
        from train.render.cuda import project_cuda  # importing gsplat takes seconds; CPU runs skip it

        return project_cuda(splats, camera, sh_degree)
    if device.type != "cpu":
        raise RenderError(f"backend 'cpu' projects CPU tensors, got splats on {device}")
    return project_cpu(splats, camera, sh_degree)


def project_batch(splats: dict[str, Tensor], views: list[View], sh_degree: int, backend: Backend = "cpu",
                  check: bool = True) -> ProjectedBatch:
    """`splats` projected into each view's camera (only the view's rows, all where None), with one
    backward for all cameras: what an owner does for the cameras of a step. The splats are
    checked once for all views (check=False: the caller did)."""
    if check:
        check_splats(splats, sh_degree, finite=backend != "cpu")
    device = splats["means"].device
    _check_backend(backend, device, "the splats")
    if backend == "cuda":
        from train.render.cuda import project_cuda  # importing gsplat takes seconds; CPU runs skip it

        return AutogradBatch(splats, views, lambda s, camera: project_cuda(s, camera, sh_degree))
    if device.type != "cpu":
        raise RenderError(f"backend 'cpu' projects CPU tensors, got splats on {device}")
    return CpuProjectedBatch(splats, views, sh_degree)


def rasterize(splats2d: Splats2D, camera: Camera, background: Tensor | Sequence[float] | None = None,
              backend: Backend = "cpu", absgrad: bool = False, packed_grads: bool = False) -> RasterOutput:
    """Composite `splats2d` front to back into camera's image; differentiable w.r.t. means2d,
    conics, opacities and colors. background: [3] or None (black). absgrad: also sum the absolute
    per-pixel 2D mean gradients in the backward (`RasterOutput.absgrad`). packed_grads: the CPU
    backend's backward hands the splats' gradients over as one [M, 9] tensor
    (`RasterOutput.packed_grads`) instead of accumulating them on the fields (CUDA accumulates
    them and leaves `packed_grads` None)."""
    device = splats2d.means2d.device
    _check_backend(backend, device, "the splats")
    splats2d.check()
    bg = _background(background, device)
    if backend == "cuda":
        from train.render.cuda import rasterize_cuda  # importing gsplat takes seconds; CPU runs skip it

        return rasterize_cuda(splats2d, camera.width, camera.height, bg, absgrad)
    if device.type != "cpu":
        raise RenderError(f"backend 'cpu' rasterizes CPU tensors, got splats on {device}")
    return rasterize_cpu(splats2d, camera.width, camera.height, bg, absgrad, packed_grads)


def render(splats: dict[str, Tensor], camera: Camera, sh_degree: int,
           background: Tensor | Sequence[float] | None = None,
           backend: Backend = "cpu") -> tuple[Tensor, Tensor, dict]:
    """rgb [H, W, 3], alpha [H, W, 1] and meta: means2d [M, 2] (its .grad is filled by backward),
    radii [M, 2], ids [M], contributed [M], sat_depth [H, W], and the Splats2D itself as splats2d."""
    splats2d = project(splats, camera, sh_degree, backend)
    out = rasterize(splats2d, camera, background, backend)
    meta = {"means2d": splats2d.means2d, "radii": splats2d.radii, "ids": splats2d.ids,
            "contributed": out.contributed, "sat_depth": out.sat_depth, "splats2d": splats2d}
    return out.rgb, out.alpha, meta
