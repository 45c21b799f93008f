"""Level of detail: a block far from the camera is drawn as fewer, larger Gaussians.

A frame that sees a city from above or down a long street holds millions of Gaussians, most of
them far smaller than a pixel; projecting and rasterizing each one is what makes such a frame
take seconds and gigabytes. Here a block whose Gaussians the camera sees at sub-pixel size is
merged voxel by voxel: the block's tight box is cut into cubes of about `pixels` pixels at the
block's nearest depth, and the Gaussians of each cube become one Gaussian with their weighted
mean, covariance and colour (moment matching, as Hierarchical 3DGS merges its nodes), weighted by
opacity times face-on area, with the opacity that keeps that weighted area. A cube holding one
Gaussian gives it back unchanged (to float rounding), so the merge only changes what a pixel
could not resolve anyway.

The proxies of a block depend only on its version and the level (the cube count per side, a
power of two), so they are kept in a small LRU beside the block cache and reused as the camera
moves; only the level's choice depends on the camera."""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
from gsplat.utils import normalized_quat_to_rotmat
from torch import Tensor

from octree.semantics import ALPHA_MAX, NEAR_PLANE
from storage.schema import PARAM_NAMES
from storage.table import BlockInfo
from train.camera import Camera

MAX_LEVEL = 20  # 2^20 cubes a side: three 21-bit cube indices pack into one int64
_TINY = 1e-30  # floor of a covariance eigenvalue (a Gaussian flat to float64's resolution)


def lod_level(info: BlockInfo, camera: Camera, pixels: float) -> int | None:
    """The level (2^level cubes a side of the block's tight box) at which a cube spans at most
    `pixels` pixels at the block's nearest depth, or None where merging cannot pay: the camera
    at or inside the block's extent, or a level whose cubes could hold each Gaussian alone (a
    surface crossing 2^level cubes a side fills about 4^level of them)."""
    if pixels <= 0 or info.count < 2:
        return None
    lo, hi = np.asarray(info.tight[:3]), np.asarray(info.tight[3:])
    side = float(np.max(hi - lo))
    if not side > 0:
        return None
    ext = np.asarray(info.extent, dtype=np.float64).reshape(2, 3)
    corners = np.stack(np.meshgrid(*ext.T, indexing="ij"), axis=-1).reshape(8, 3)
    depth = float((corners @ camera.viewmat[2, :3] + camera.viewmat[2, 3]).min())
    if depth <= NEAR_PLANE:
        return None
    focal = float(max(camera.K[0, 0], camera.K[1, 1]))
    level = max(0, math.ceil(math.log2(side * focal / (depth * pixels))))
    if level > MAX_LEVEL or 4**level >= info.count:
        return None
    return level


def _rotmat_to_quat(R: Tensor) -> Tensor:  # [M, 3, 3] proper rotations -> [M, 4] wxyz
    """Shepperd's method: take the largest of 4w^2, 4x^2, 4y^2, 4z^2 as the pivot (no division by ~0)."""
    m00, m11, m22 = R[:, 0, 0], R[:, 1, 1], R[:, 2, 2]
    cand = torch.stack([1 + m00 + m11 + m22, 1 + m00 - m11 - m22, 1 - m00 + m11 - m22, 1 - m00 - m11 + m22], dim=1)
    pivot = cand.argmax(dim=1)
    s = 2.0 * torch.sqrt(cand.gather(1, pivot[:, None]).squeeze(1).clamp_min(1e-300))  # 4 * the pivot's component
    d21, d02, d10 = R[:, 2, 1] - R[:, 1, 2], R[:, 0, 2] - R[:, 2, 0], R[:, 1, 0] - R[:, 0, 1]
    s21, s02, s10 = R[:, 2, 1] + R[:, 1, 2], R[:, 0, 2] + R[:, 2, 0], R[:, 1, 0] + R[:, 0, 1]
    rows = [
        torch.stack([s / 4, d21 / s, d02 / s, d10 / s], dim=1),
        torch.stack([d21 / s, s / 4, s10 / s, s02 / s], dim=1),
        torch.stack([d02 / s, s10 / s, s / 4, s21 / s], dim=1),
        torch.stack([d10 / s, s02 / s, s21 / s, s / 4], dim=1),
    ]
    return torch.stack(rows, dim=0)[pivot, torch.arange(R.shape[0], device=R.device)]


def merge_block(params: dict[str, Tensor], tight: tuple[float, ...], level: int) -> dict[str, Tensor]:
    """The block's Gaussians merged per cube of its tight box cut 2^level a side (see the module
    docstring); the same parameter names and layout as a block, float32, cubes in code order."""
    means = params["means"].double()  # [N, 3]
    n = means.shape[0]
    cells = 1 << level
    device = means.device  # the block cache's (the viewer's --device)
    lo = torch.tensor(tight[:3], dtype=torch.float64, device=device)
    side = max(float(np.max(np.subtract(tight[3:], tight[:3]))), 1e-300)
    idx = ((means - lo) * (cells / side)).floor().clamp(0, cells - 1).long()  # [N, 3]
    code = idx[:, 0] | (idx[:, 1] << 21) | (idx[:, 2] << 42)
    _, cube = torch.unique(code, return_inverse=True)  # [N] cube of each Gaussian, in code order
    m = int(cube.max()) + 1 if n else 0

    def total(x: Tensor) -> Tensor:  # [N, ...] -> [M, ...] summed per cube
        return torch.zeros((m, *x.shape[1:]), dtype=x.dtype, device=device).index_add_(0, cube, x)

    alpha = torch.sigmoid(params["opacities"].double())  # [N]
    scales = torch.exp(params["scales"].double())  # [N, 3]
    ordered = scales.sort(dim=1).values
    weight = alpha * ordered[:, 1] * ordered[:, 2]  # opacity x face-on area (the two largest axes)
    wsum = total(weight).clamp_min(1e-300)  # [M]
    share = weight / wsum[cube]  # [N] each Gaussian's part of its cube
    mean = total(share[:, None] * means)  # [M, 3]
    R = normalized_quat_to_rotmat(torch.nn.functional.normalize(params["quats"].double(), dim=1))  # [N, 3, 3]
    off = means - mean[cube]  # centred on the cube's mean: no cancellation far from the origin
    second = (R * scales[:, None, :] ** 2) @ R.transpose(1, 2) + off[:, :, None] * off[:, None, :]
    cov = total(share[:, None, None] * second)  # [M, 3, 3]
    cov = 0.5 * (cov + cov.transpose(1, 2))
    eigval, eigvec = torch.linalg.eigh(cov)  # ascending
    eigval = eigval.clamp_min(_TINY)
    # A proper rotation: flip the smallest axis where the eigenvectors make a left-handed frame.
    handed = torch.linalg.cross(eigvec[:, :, 1], eigvec[:, :, 2]).mul(eigvec[:, :, 0]).sum(dim=1)  # det
    eigvec = torch.cat([eigvec[:, :, :1] * torch.where(handed < 0, -1.0, 1.0)[:, None, None], eigvec[:, :, 1:]], dim=2)
    sigma = eigval.sqrt()
    merged_alpha = (wsum / (sigma[:, 1] * sigma[:, 2])).clamp(1e-6, ALPHA_MAX)
    out = {
        "means": mean,
        "scales": sigma.log(),
        "quats": _rotmat_to_quat(eigvec),
        "opacities": merged_alpha.log() - torch.log1p(-merged_alpha),
        "sh0": total(share[:, None, None] * params["sh0"].double()),
        "shN": total(share[:, None, None] * params["shN"].double()),
    }
    return {k: out[k].float().contiguous() for k in PARAM_NAMES}


@dataclass
class LodStats:
    blocks: int = 0  # blocks of the frame drawn merged
    gaussians: int = 0  # their Gaussians
    proxies: int = 0  # the Gaussians that stood in for them


Slot = tuple[str, int, int]  # (block key, version, level)


class ProxyCache:
    """Merged blocks by slot, least recently used first out, within `budget` bytes. A block whose
    merge saved under half its rows is remembered as None: it is drawn as it is."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._items: OrderedDict[Slot, dict[str, Tensor] | None] = OrderedDict()
        self._levels: dict[tuple[str, int], set[int]] = {}  # (key, version) -> the levels held
        self._bytes = 0

    @staticmethod
    def _size(proxy: dict[str, Tensor] | None) -> int:
        return 0 if proxy is None else sum(t.numel() * t.element_size() for t in proxy.values())

    def __contains__(self, slot: Slot) -> bool:
        return slot in self._items

    def get(self, slot: Slot) -> dict[str, Tensor] | None:
        self._items.move_to_end(slot)
        return self._items[slot]

    def choose(self, key: str, version: int, level: int) -> Slot:
        """The slot to draw a block at `level` from: that level's if held, else the nearest finer
        merge held (as true to the block, fewer rows than the block, and no merge to make: a camera
        that moves round a block changes its nearest depth, and with it the level, all the time),
        else that level's, to be made."""
        held = self._levels.get((key, version), set())
        if level not in held:
            finer = [lv for lv in held if lv > level and self._items[(key, version, lv)] is not None]
            if finer:
                return key, version, min(finer)
        return key, version, level

    def put(self, slot: Slot, proxy: dict[str, Tensor] | None) -> None:
        size = self._size(proxy)
        if size > self.budget or slot in self._items:
            return
        self._items[slot] = proxy
        self._levels.setdefault(slot[:2], set()).add(slot[2])
        self._bytes += size
        while self._bytes > self.budget:
            old, dropped = self._items.popitem(last=False)
            self._levels[old[:2]].discard(old[2])
            if not self._levels[old[:2]]:
                del self._levels[old[:2]]
            self._bytes -= self._size(dropped)

    def nbytes(self) -> int:
        return self._bytes

    def clear(self) -> None:
        self._items.clear()
        self._levels.clear()
        self._bytes = 0


def proxy_for(block: dict[str, Tensor], info: BlockInfo, level: int) -> dict[str, Tensor] | None:
    """The merged block, or None where merging keeps more than half of its rows (not worth a
    second copy: the block is drawn as it is)."""
    proxy = merge_block(block, info.tight, level)
    return proxy if 2 * proxy["means"].shape[0] <= info.count else None
