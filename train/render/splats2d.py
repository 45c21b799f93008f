"""The 2D splats that travel between projection and rasterization, and their wire formats.

Under MPI the rank owning a Gaussian projects it and another rank may rasterize it, so a
`Splats2D` is self-contained: everything the rasterizer needs, plus `ids` naming the owner's rows.
The wire format is 12 float32 a splat forward and 9 float32 a splat back (only the inputs the
rasterizer differentiates: means2d 2, conics 3, opacities 1, colors 3).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from train.render.errors import RenderError, all_finite, nonfinite

WIRE_FLOATS = 12  # means2d 2, conics 3, depths 1, opacities 1, colors 3, radii 2
GRAD_FLOATS = 9  # means2d 2, conics 3, opacities 1, colors 3
_WIRE_SPLIT = (2, 3, 1, 1, 3, 2)
_GRAD_SPLIT = (2, 3, 1, 3)


@dataclass
class Splats2D:
    """Projected Gaussians of one camera, in any order (the rasterizer sorts them by depth)."""

    means2d: Tensor  # [M, 2] pixel coordinates, pixel centres at +0.5
    conics: Tensor  # [M, 3] upper triangle (a, b, c) of the inverse 2D covariance
    depths: Tensor  # [M] camera-space z, the sort key (not differentiated)
    opacities: Tensor  # [M] activated, in (0, 1]
    colors: Tensor  # [M, 3] SH colour + 0.5, clamped at 0
    radii: Tensor  # [M, 2] int32 half extents in pixels, opacity-aware, at most 3.33 sigma
    ids: Tensor  # [M] int64 rows of the projected splats dict

    def __len__(self) -> int:
        return self.means2d.shape[0]

    def differentiable(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The inputs the rasterizer differentiates, in gradient wire order."""
        return self.means2d, self.conics, self.opacities, self.colors

    def select(self, index: Tensor) -> "Splats2D":
        """The rows `index` (bool mask [M] or int64 rows), keeping the autograd graph."""
        return Splats2D(**{f.name: getattr(self, f.name)[index] for f in fields(self)})

    @staticmethod
    def cat(parts: list["Splats2D"]) -> "Splats2D":
        if not parts:
            raise RenderError("Splats2D.cat needs at least one part (use Splats2D.empty for none)")
        if len(parts) == 1:  # one rank's own splats, the usual case: no copy
            return parts[0]
        return Splats2D(**{f.name: torch.cat([getattr(p, f.name) for p in parts]) for f in fields(Splats2D)})

    @staticmethod
    def empty(device: torch.device | str = "cpu") -> "Splats2D":
        f32 = {"dtype": torch.float32, "device": device}
        return Splats2D(torch.zeros(0, 2, **f32), torch.zeros(0, 3, **f32), torch.zeros(0, **f32),
                        torch.zeros(0, **f32), torch.zeros(0, 3, **f32),
                        torch.zeros(0, 2, dtype=torch.int32, device=device),
                        torch.zeros(0, dtype=torch.int64, device=device))

    def check(self, where: str = "splats2d") -> None:
        """Raise RenderError unless the fields agree in length, dtype, device and are finite."""
        m = len(self)
        shapes = {"means2d": (m, 2), "conics": (m, 3), "depths": (m,), "opacities": (m,),
                  "colors": (m, 3), "radii": (m, 2), "ids": (m,)}
        for name, shape in shapes.items():
            t = getattr(self, name)
            if tuple(t.shape) != shape:
                raise RenderError(f"{where}.{name}: shape {tuple(t.shape)}, expected {shape}")
            if t.device != self.means2d.device:
                raise RenderError(f"{where}.{name}: on {t.device}, means2d on {self.means2d.device}")
            if name in ("radii", "ids"):
                continue
            if t.dtype != torch.float32:
                raise RenderError(f"{where}.{name}: dtype {t.dtype}, expected float32")
            if not all_finite(t):
                raise nonfinite(f"{where}.{name}")

    def as_leaves(self) -> "Splats2D":
        """The same splats with the differentiable fields as fresh leaves (sharing memory): what
        `unpack(pack())` gives, without the copies, for splats that stay on their rank."""
        means2d, conics, opacities, colors = (t.detach().contiguous().requires_grad_(True)
                                              for t in self.differentiable())
        return Splats2D(means2d, conics, self.depths.detach().contiguous(), opacities, colors, self.radii, self.ids)

    def pack(self) -> Tensor:  # [M, 12] float32, detached
        """The forward wire format (ids stay with the sender, who pairs the returned gradients by row)."""
        with torch.no_grad():
            return torch.cat([self.means2d, self.conics, self.depths[:, None], self.opacities[:, None],
                              self.colors, self.radii.to(torch.float32)], dim=1).contiguous()

    @staticmethod
    def unpack(buf: Tensor, ids: Tensor | None = None, requires_grad: bool = True) -> "Splats2D":
        """Splats from `pack()`'s buffer [M, 12]; the differentiable fields become leaves whose
        `.grad` is what `pack_grads` sends back to the owner."""
        if buf.ndim != 2 or buf.shape[1] != WIRE_FLOATS:
            raise RenderError(f"splat buffer: shape {tuple(buf.shape)}, expected [M, {WIRE_FLOATS}]")
        means2d, conics, depths, opacities, colors, radii = torch.split(buf.to(torch.float32), _WIRE_SPLIT, 1)
        if ids is None:
            ids = torch.arange(len(buf), device=buf.device)
        means2d, conics, opacities, colors = (
            t.contiguous().requires_grad_(requires_grad) for t in (means2d, conics, opacities[:, 0], colors))
        return Splats2D(means2d, conics, depths[:, 0].contiguous(), opacities, colors,
                        radii.round().to(torch.int32), ids.to(torch.int64))


def pack_grads(splats: Splats2D) -> Tensor:  # [M, 9] float32
    """The gradients accumulated on an unpacked `Splats2D`'s leaves (zeros where none arrived)."""
    cols = []
    for t, width in zip(splats.differentiable(), _GRAD_SPLIT):
        g = t.grad if t.grad is not None else torch.zeros_like(t)
        cols.append(g.reshape(len(splats), width))  # explicit width: an empty splat set must pack too
    return torch.cat(cols, dim=1).to(torch.float32).contiguous()


def unpack_grads(buf: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """[M, 9] -> (v_means2d [M, 2], v_conics [M, 3], v_opacities [M], v_colors [M, 3])."""
    if buf.ndim != 2 or buf.shape[1] != GRAD_FLOATS:
        raise RenderError(f"gradient buffer: shape {tuple(buf.shape)}, expected [M, {GRAD_FLOATS}]")
    v_means2d, v_conics, v_opacities, v_colors = torch.split(buf, _GRAD_SPLIT, 1)
    return v_means2d, v_conics, v_opacities[:, 0], v_colors


@dataclass
class RasterOutput:
    rgb: Tensor  # [H, W, 3]
    alpha: Tensor  # [H, W, 1]
    contributed: Tensor  # [M] bool: passed alpha >= 1/255 before termination at some pixel
    sat_depth: Tensor  # [H, W] depth of the splat that took transmittance below 1e-4; inf if none did
    # Where asked for (`rasterize(..., absgrad=True)`): after the backward, [M, 2] the sum over
    # pixels of the absolute per-pixel gradient of each 2D mean component (gsplat's `absgrad`).
    absgrad: Callable[[], Tensor] | None = None
    # Where asked for (`rasterize(..., packed_grads=True)`) and the backend can: after the backward,
    # [M, 9] the splats' gradients in `pack_grads` layout, which then are not on the fields' `.grad`.
    packed_grads: Callable[[], Tensor] | None = None
