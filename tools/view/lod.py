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

The merge is two compiled passes over the Gaussians (weights and means, then covariances and
colours) and a Jacobi eigensolver per cube. The proxies of a block depend only on its version
and the level (the cube count per side, a power of two), so they are kept in a small LRU beside
the block cache and reused as the camera moves; only the level's choice depends on the camera."""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
from numba import njit
from torch import Tensor

from octree.order import box_depths
from octree.semantics import ALPHA_MAX, NEAR_PLANE
from storage.schema import PARAM_NAMES
from storage.table import BlockInfo
from train.camera import Camera
from train.render.cpu.mat3 import quat_to_rotmat

MAX_LEVEL = 20  # 2^20 cubes a side: three 21-bit cube indices pack into one int64
_TINY = 1e-30  # floor of a covariance eigenvalue (a Gaussian flat to float64's resolution)


def lod_levels(infos: list[BlockInfo], camera: Camera, pixels: float) -> list[int | None]:
    """Per block, the level (2^level cubes a side of its tight box) at which a cube spans at most
    `pixels` pixels at the block's nearest depth (`octree.order.box_depths` of its extent box), or
    None where merging cannot pay: the camera at or inside the block's extent, or a level whose
    cubes could hold each Gaussian alone (a surface crossing 2^level cubes a side fills about
    4^level of them)."""
    if pixels <= 0 or not infos:
        return [None] * len(infos)
    depths = box_depths(np.array([i.extent for i in infos], dtype=np.float64), camera.viewmat)  # [B]
    focal = float(max(camera.K[0, 0], camera.K[1, 1]))
    levels: list[int | None] = []
    for info, depth in zip(infos, depths.tolist()):
        side = float(np.max(np.subtract(info.tight[3:], info.tight[:3])))
        if info.count < 2 or not side > 0 or not depth > NEAR_PLANE:
            levels.append(None)
            continue
        level = max(0, math.ceil(math.log2(side * focal / (depth * pixels))))
        levels.append(None if level > MAX_LEVEL or 4**level >= info.count else level)
    return levels


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
    return torch.stack(rows, dim=0)[pivot, torch.arange(R.shape[0])]


@njit(cache=True)
def _cube_moments(means, scales, quats, logits, colours, cube, m):  # pragma: no cover (compiled)
    """Per cube: the summed weight [M], weighted mean [M, 3], weighted covariance about that mean
    [M, 3, 3] and weighted colour coefficients [M, C], in float64 (see `merge_block`).
    means, scales (log), quats [N, 3|3|4], logits [N], colours [N, C] float32; cube [N] int64."""
    n = means.shape[0]
    weight = np.empty(n)
    wsum = np.zeros(m)
    mean = np.zeros((m, 3))
    for i in range(n):
        s0, s1, s2 = math.exp(scales[i, 0]), math.exp(scales[i, 1]), math.exp(scales[i, 2])
        face = s0 * s1 * s2 / min(s0, s1, s2)  # the two largest axes: the face-on area
        weight[i] = face / (1.0 + math.exp(-logits[i]))  # times the opacity
        c = cube[i]
        wsum[c] += weight[i]
        for k in range(3):
            mean[c, k] += weight[i] * means[i, k]
    for c in range(m):
        wsum[c] = max(wsum[c], 1e-300)
        for k in range(3):
            mean[c, k] /= wsum[c]
    cov = np.zeros((m, 3, 3))
    colour = np.zeros((m, colours.shape[1]))
    var = np.empty(3)
    d = np.empty(3)
    for i in range(n):
        c = cube[i]
        share = weight[i] / wsum[c]
        qw, qx, qy, qz = quats[i, 0], quats[i, 1], quats[i, 2], quats[i, 3]
        norm = math.sqrt(qw * qw + qx * qx + qy * qy + qz * qz)
        R = quat_to_rotmat(qw / norm, qx / norm, qy / norm, qz / norm)  # row-major 3x3 as 9 values
        for k in range(3):
            var[k] = math.exp(2.0 * scales[i, k])
            d[k] = means[i, k] - mean[c, k]  # about the cube's mean: no cancellation far from the origin
        for j in range(3):
            for k in range(3):
                own = (R[3 * j] * var[0] * R[3 * k] + R[3 * j + 1] * var[1] * R[3 * k + 1]
                       + R[3 * j + 2] * var[2] * R[3 * k + 2])
                cov[c, j, k] += share * (own + d[j] * d[k])
        for k in range(colours.shape[1]):
            colour[c, k] += share * colours[i, k]
    return wsum, mean, cov, colour


@njit(cache=True)
def _eigh3(cov):  # pragma: no cover (compiled)
    """Eigenvalues [M, 3] (ascending) and eigenvectors [M, 3, 3] (columns) of symmetric 3x3
    matrices [M, 3, 3], by cyclic Jacobi rotations (a batched LAPACK call spent 1.3 us a matrix)."""
    m = cov.shape[0]
    vals = np.empty((m, 3))
    vecs = np.empty((m, 3, 3))
    A = np.empty((3, 3))
    V = np.empty((3, 3))
    for c in range(m):
        for j in range(3):
            for k in range(3):
                A[j, k] = 0.5 * (cov[c, j, k] + cov[c, k, j])
                V[j, k] = 1.0 if j == k else 0.0
        scale = abs(A[0, 0]) + abs(A[1, 1]) + abs(A[2, 2])
        for _ in range(32):
            off = A[0, 1] * A[0, 1] + A[0, 2] * A[0, 2] + A[1, 2] * A[1, 2]
            if off <= 1e-36 * scale * scale or off == 0.0:
                break
            for p, q in ((0, 1), (0, 2), (1, 2)):
                if A[p, q] == 0.0:
                    continue
                theta = (A[q, q] - A[p, p]) / (2.0 * A[p, q])
                t = 1.0 / (abs(theta) + math.sqrt(theta * theta + 1.0))
                if theta < 0:
                    t = -t
                cs = 1.0 / math.sqrt(t * t + 1.0)
                sn = t * cs
                for k in range(3):  # A J, then J^T (A J), with J the rotation in the (p, q) plane
                    akp, akq = A[k, p], A[k, q]
                    A[k, p], A[k, q] = cs * akp - sn * akq, sn * akp + cs * akq
                for k in range(3):
                    apk, aqk = A[p, k], A[q, k]
                    A[p, k], A[q, k] = cs * apk - sn * aqk, sn * apk + cs * aqk
                for k in range(3):
                    vkp, vkq = V[k, p], V[k, q]
                    V[k, p], V[k, q] = cs * vkp - sn * vkq, sn * vkp + cs * vkq
        lo = 0 if A[0, 0] <= A[1, 1] and A[0, 0] <= A[2, 2] else (1 if A[1, 1] <= A[2, 2] else 2)
        hi = 2 if A[2, 2] >= A[1, 1] and A[2, 2] >= A[0, 0] else (1 if A[1, 1] >= A[0, 0] else 0)
        if hi == lo:  # all three equal
            hi = 2 if lo != 2 else 1
        for j, col in enumerate((lo, 3 - lo - hi, hi)):
            vals[c, j] = A[col, col]
            for k in range(3):
                vecs[c, k, j] = V[k, col]
    return vals, vecs


def merge_block(params: dict[str, Tensor], tight: tuple[float, ...], level: int) -> dict[str, Tensor]:
    """The block's Gaussians merged per cube of its tight box cut 2^level a side (see the module
    docstring); the same parameter names and layout as a block, float32, cubes in code order, on
    the block's device (merged on the CPU)."""
    device = params["means"].device  # the block cache's (the viewer's --device)
    p = {k: v.detach().cpu().float() for k, v in params.items()}
    n = p["means"].shape[0]
    cells = 1 << level
    lo = torch.tensor(tight[:3], dtype=torch.float64)
    side = max(float(np.max(np.subtract(tight[3:], tight[:3]))), 1e-300)
    idx = ((p["means"].double() - lo) * (cells / side)).floor().clamp(0, cells - 1).long()  # [N, 3]
    code = idx[:, 0] | (idx[:, 1] << 21) | (idx[:, 2] << 42)
    _, cube = torch.unique(code, return_inverse=True)  # [N] cube of each Gaussian, in code order
    m = int(cube.max()) + 1 if n else 0
    colours = torch.cat([p["sh0"].reshape(n, -1), p["shN"].reshape(n, -1)], dim=1)  # [N, 3 + 3K]
    wsum, mean, cov, colour = (torch.from_numpy(a) for a in _cube_moments(
        p["means"].contiguous().numpy(), p["scales"].contiguous().numpy(), p["quats"].contiguous().numpy(),
        p["opacities"].contiguous().numpy(), colours.contiguous().numpy(), cube.numpy(), m))
    eigval, eigvec = (torch.from_numpy(a) for a in _eigh3(cov.numpy()))  # ascending
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
        "sh0": colour[:, :3].reshape(m, *p["sh0"].shape[1:]),
        "shN": colour[:, 3:].reshape(m, *p["shN"].shape[1:]),
    }
    return {k: out[k].float().contiguous().to(device) for k in PARAM_NAMES}


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
