"""One batch of Gaussians projected into several cameras, differentiated in one backward.

An owner projects its Gaussians into every camera of a step that sees them and receives the
splats' gradients back camera by camera (from its own rasterizer or through the exchange).
`project_batch` in `train.render.api` returns a `ProjectedBatch`: the CPU backend's fused one
(`train.render.cpu.projection.CpuProjectedBatch`) or `AutogradBatch` around any single-camera
projection.
"""
from __future__ import annotations

from dataclasses import fields
from typing import Callable, Protocol

import numpy as np
import torch
from torch import Tensor

from train.camera import Camera
from train.render.splats2d import Splats2D, unpack_grads

# (camera index, camera, rows of the batch it may see; None: all of them)
View = tuple[int, Camera, np.ndarray | None]


class ProjectedBatch(Protocol):
    splats: dict[int, Splats2D]  # camera index -> its splats, detached; ids are rows of the batch

    def backward(self, grads: dict[int, Tensor]) -> None:
        """Add the batch parameters' gradients to their `.grad`, given each camera's splat
        gradients [M, 9] in `pack_grads` layout (cameras left out contribute nothing)."""
        ...


class AutogradBatch:
    """A projection per camera through torch autograd, one backward over all of them."""

    def __init__(self, splats: dict[str, Tensor], views: list[View],
                 project_one: Callable[[dict[str, Tensor], Camera], Splats2D]) -> None:
        self._graphs: dict[int, Splats2D] = {}
        self.splats: dict[int, Splats2D] = {}
        device = splats["means"].device
        for i, camera, rows in views:
            if rows is None:
                s = project_one(splats, camera)
            else:
                r = torch.as_tensor(rows, dtype=torch.int64, device=device)
                s = project_one({name: p[r] for name, p in splats.items()}, camera)
                s.ids = r[s.ids]
            self._graphs[i] = s
            self.splats[i] = Splats2D(**{f.name: getattr(s, f.name).detach() for f in fields(Splats2D)})

    def backward(self, grads: dict[int, Tensor]) -> None:
        outs, grad_outs = [], []
        for i in sorted(grads):
            for t, g in zip(self._graphs[i].differentiable(), unpack_grads(grads[i])):
                if t.requires_grad:
                    outs.append(t)
                    grad_outs.append(g.reshape(t.shape).to(t.device))
        if outs:
            torch.autograd.backward(outs, grad_outs)
