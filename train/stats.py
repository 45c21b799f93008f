"""Densification statistics, as gsplat's DefaultStrategy gathers them: per Gaussian, the sum over
cameras of its 2D mean's gradient norm (in NDC-like units), how many cameras it was visible in
(projected into the image with a positive radius, whether or not it reached a pixel), and its
largest screen radius relative to the image size.

One compiled loop a camera: through torch this was a dozen small ops a camera (~0.1 ms each
under MPI), a cost that followed the number of cameras a rank's blocks appear in.
"""
from __future__ import annotations

import math

import numpy as np
import torch
from numba import njit
from torch import Tensor

from train.camera import Camera


@njit(cache=True, nogil=True)
def _accumulate(ids, radii, grads, sx, sy, inv_size, grad2d, count, max_radii):
    for i in range(ids.size):
        g = ids[i]
        gx, gy = grads[i, 0] * sx, grads[i, 1] * sy
        grad2d[g] += math.sqrt(gx * gx + gy * gy)
        count[g] += 1
        max_radii[g] = max(max_radii[g], max(radii[i, 0], radii[i, 1]) * inv_size)


def empty_stats(n: int) -> dict[str, np.ndarray]:
    """Zeroed statistics of a batch of n Gaussians: grad2d, count, max_radii [n]."""
    return {"grad2d": np.zeros(n, np.float32), "count": np.zeros(n, np.int32), "max_radii": np.zeros(n, np.float32)}


def accumulate_stats(
    stats: dict[str, np.ndarray],  # from empty_stats, over the gathered batch
    ids: Tensor,  # [M] int64 batch rows of one camera's splats
    radii: Tensor,  # [M, 2] int32
    grads: Tensor,  # [M, >= 2] the 2D mean's gradient first (pack_grads layout, or absgrad [M, 2])
    camera: Camera,
    n_cameras: int,  # the step's global batch (gsplat scales by it)
) -> None:
    """Add one camera's splats to `stats` (host arrays; tensors on a GPU are copied over)."""
    arrays = (t.detach().cpu().contiguous().numpy() for t in (ids, radii, grads.to(torch.float32)))
    _accumulate(*arrays,
                camera.width / 2.0 * n_cameras, camera.height / 2.0 * n_cameras,
                1.0 / float(max(camera.width, camera.height)), stats["grad2d"], stats["count"], stats["max_radii"])
