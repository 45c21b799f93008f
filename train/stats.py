"""Densification statistics, as gsplat's DefaultStrategy gathers them: per Gaussian, the sum over
cameras of its 2D mean's gradient norm (in NDC-like units), how many cameras it was visible in
(projected into the image with a positive radius, whether or not it reached a pixel), and its
largest screen radius relative to the image size.

On the host, one compiled loop a camera: through torch this was a dozen small ops a camera (~0.1
ms each under MPI), a cost that followed the number of cameras a rank's blocks appear in. On a
GPU the same sums are three scatter kernels a camera (`DeviceStats`), so nothing leaves the device.
"""
from __future__ import annotations

import math

import numpy as np
import torch
from numba import njit, prange
from torch import Tensor

from train.camera import Camera
from train.pointers import float_vector, int32_vector


@njit(parallel=True, cache=True, nogil=True)
def _accumulate(ids, radii, grads, sx, sy, inv_size, grad2d, count, max_radii):
    """One camera's splats into the sums; its ids name each row at most once, so the rows are
    split over the cores without two threads ever adding into one row."""
    for i in prange(ids.size):
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


@njit(cache=True, nogil=True)
def _add_rows(grad2d, count, max_radii, acc_grad2d, acc_count, acc_max_radii, lo):
    for i in range(grad2d.size):
        grad2d[i] += acc_grad2d[lo + i]
        count[i] += acc_count[lo + i]
        max_radii[i] = max(max_radii[i], acc_max_radii[lo + i])


@njit(parallel=True, cache=True, nogil=True)
def _add_stats_blocks(table, at, sizes, los, groups, stepped, grad2d, count, max_radii, changed):
    """`add_stats` of many blocks in one call: block b's statistics at the addresses table[b,
    at:at + 3] (grad2d, count, max_radii; sizes[b] rows, at los[b] of the batch), added where
    the block stepped a row (stepped[b]) or one of its rows was counted; changed[b] says which."""
    for grp in prange(groups.size - 1):
        for b in range(groups[grp], groups[grp + 1]):
            n, lo = sizes[b], los[b]
            seen = stepped[b] > 0
            for i in range(lo, lo + n):
                seen |= count[i] != 0
            changed[b] = seen
            if seen:
                _add_rows(float_vector(table[b, at], n), int32_vector(table[b, at + 1], n),
                          float_vector(table[b, at + 2], n), grad2d, count, max_radii, lo)


def add_stats_blocks(
    table: np.ndarray,  # [B, K] int64 address table rows, the block's statistics at columns at..at+2
    at: int,
    sizes: np.ndarray,  # [B] int64
    los: np.ndarray,  # [B] int64
    groups: np.ndarray,  # [G + 1] int64 (`blockwise.row_groups`)
    stepped: np.ndarray,  # [B] int64 rows Adam stepped in each block
    stats: dict[str, np.ndarray],  # a step's sums over the batch (`empty_stats`)
) -> np.ndarray:  # [B] bool: the blocks whose statistics (or parameters) changed
    """`add_stats` of many blocks at once (the caller holding their arrays)."""
    changed = np.empty(len(sizes), np.bool_)
    _add_stats_blocks(table, at, sizes, los, groups, stepped, stats["grad2d"], stats["count"], stats["max_radii"],
                      changed)
    return changed


def add_stats(
    block: dict[str, Tensor],  # one block's arrays, its statistics among them: grad2d, count, max_radii [n]
    arrays: dict[str, np.ndarray] | None,  # `train.optim.numpy_arrays(block)`, or None: torch ops
    stats: dict[str, np.ndarray],  # a step's sums over the batch (`empty_stats`)
    lo: int,  # the block's rows in the batch: [lo, hi)
    hi: int,
) -> None:
    """Add a step's sums of the block's rows to the block's statistics, in place. With the
    block's numpy views, one compiled call instead of three torch calls (~2 us each here, under
    the GIL), which a street view of a city makes for hundreds of blocks of ~100 rows a step."""
    if arrays is not None:
        _add_rows(arrays["grad2d"].reshape(-1), arrays["count"].reshape(-1), arrays["max_radii"].reshape(-1),
                  stats["grad2d"], stats["count"], stats["max_radii"], lo)
        return
    device = block["grad2d"].device
    block["grad2d"] += torch.from_numpy(stats["grad2d"][lo:hi]).to(device)
    block["count"] += torch.from_numpy(stats["count"][lo:hi]).to(device)
    torch.maximum(block["max_radii"], torch.from_numpy(stats["max_radii"][lo:hi]).to(device), out=block["max_radii"])


class DeviceStats:
    """The statistics of a batch of n Gaussians as tensors on the batch's device, accumulated by
    torch's scatter kernels: `accumulate_stats`'s arithmetic (the norm in float64, stored in
    float32), without copying each camera's splats to the host. A camera's splats hold each
    Gaussian once, so its scatter adds no two values into one row: cameras are added in the
    caller's order, and the sums do not depend on the kernels' scheduling."""

    def __init__(self, n: int, device: torch.device) -> None:
        self.grad2d = torch.zeros(n, dtype=torch.float32, device=device)  # [n]
        self.count = torch.zeros(n, dtype=torch.int32, device=device)  # [n]
        self.max_radii = torch.zeros(n, dtype=torch.float32, device=device)  # [n]

    def add(
        self,
        ids: Tensor,  # [M] int64 batch rows of one camera's splats, each at most once
        radii: Tensor,  # [M, 2] int
        grads: Tensor,  # [M, >= 2] the 2D mean's gradient first (pack_grads layout, or absgrad [M, 2])
        camera: Camera,
        n_cameras: int,
    ) -> None:
        g = grads[:, :2].detach().to(torch.float64)
        g = g * torch.tensor([camera.width / 2.0 * n_cameras, camera.height / 2.0 * n_cameras],
                             dtype=torch.float64, device=g.device)
        self.grad2d.index_add_(0, ids, torch.linalg.vector_norm(g, dim=1).to(torch.float32))
        self.count.index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        r = radii.amax(dim=1).to(torch.float64) * (1.0 / float(max(camera.width, camera.height)))
        self.max_radii.scatter_reduce_(0, ids, r.to(torch.float32), "amax")
