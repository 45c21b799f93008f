"""Moving Gaussians between world frames related by a similarity x' = s R x + t.

The store holds the scene in a normalised frame; exports go back to the input's frame. Means,
scales and rotations transform in closed form; view-dependent colour (SH bands 1..3) is rotated
exactly by fitting the rotated band-limited function at sample directions (SH of each band are
closed under rotation, so the least-squares fit has zero residual).
"""
from __future__ import annotations

import numpy as np
import torch
from gsplat.cuda._torch_impl import _eval_sh_bases_fast  # pure torch

from storage.schema import param_shapes


def split_similarity(T: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:  # T [4, 4]
    """(s, R [3, 3], t [3]) with T[:3, :3] = s R."""
    A = np.asarray(T, dtype=np.float64)[:3, :3]
    s = float(np.cbrt(np.linalg.det(A)))
    if not np.isfinite(s) or s <= 0:
        raise ValueError("world transform is not a proper similarity (det <= 0)")
    R = A / s
    if not np.allclose(R @ R.T, np.eye(3), atol=1e-6):
        raise ValueError("world transform is not a similarity (its linear part is not s * rotation)")
    return s, R, np.asarray(T, dtype=np.float64)[:3, 3]


def _fibonacci_sphere(n: int) -> np.ndarray:  # [n, 3]
    i = np.arange(n) + 0.5
    phi = np.arccos(1 - 2 * i / n)
    theta = np.pi * (1 + 5**0.5) * i
    return np.stack([np.cos(theta) * np.sin(phi), np.sin(theta) * np.sin(phi), np.cos(phi)], axis=1)


def sh_rotation(R: np.ndarray, sh_degree: int) -> np.ndarray:  # [K, K], K = (d+1)^2 - 1
    """M with f'(d) = f(R d): shN' = M @ shN for the non-DC coefficients."""
    basis = (sh_degree + 1) ** 2
    dirs = _fibonacci_sphere(4 * basis)
    Y = _eval_sh_bases_fast(basis, torch.from_numpy(dirs)).numpy()  # [S, basis]
    Y_rot = _eval_sh_bases_fast(basis, torch.from_numpy(dirs @ R.T)).numpy()
    return np.linalg.lstsq(Y[:, 1:], Y_rot[:, 1:], rcond=None)[0]  # Y M = Y_rot, so f(R d) = Y(d) M c


def _quat_from_matrix(R: np.ndarray) -> np.ndarray:  # [4] wxyz
    w = np.sqrt(max(0.0, 1 + R[0, 0] + R[1, 1] + R[2, 2])) / 2
    x = np.copysign(np.sqrt(max(0.0, 1 + R[0, 0] - R[1, 1] - R[2, 2])) / 2, R[2, 1] - R[1, 2])
    y = np.copysign(np.sqrt(max(0.0, 1 - R[0, 0] + R[1, 1] - R[2, 2])) / 2, R[0, 2] - R[2, 0])
    z = np.copysign(np.sqrt(max(0.0, 1 - R[0, 0] - R[1, 1] + R[2, 2])) / 2, R[1, 0] - R[0, 1])
    return np.array([w, x, y, z])


def _quat_mul(a: np.ndarray, b: np.ndarray) -> np.ndarray:  # a [4], b [N, 4] -> [N, 4] (wxyz)
    w1, x1, y1, z1 = a
    w2, x2, y2, z2 = b[:, 0], b[:, 1], b[:, 2], b[:, 3]
    return np.stack(
        [
            w1 * w2 - x1 * x2 - y1 * y2 - z1 * z2,
            w1 * x2 + x1 * w2 + y1 * z2 - z1 * y2,
            w1 * y2 - x1 * z2 + y1 * w2 + z1 * x2,
            w1 * z2 + x1 * y2 - y1 * x2 + z1 * w2,
        ],
        axis=1,
    )


def transform_gaussians(params: dict[str, np.ndarray], T: np.ndarray, sh_degree: int) -> dict[str, np.ndarray]:
    """Parameters (gsplat names, float32) mapped through x' = T x. The identity returns them untouched."""
    T = np.asarray(T, dtype=np.float64)
    if np.array_equal(T, np.eye(4)):
        return params
    s, R, t = split_similarity(T)
    out = dict(params)
    out["means"] = (params["means"].astype(np.float64) @ (s * R).T + t).astype(np.float32)
    out["scales"] = (params["scales"].astype(np.float64) + np.log(s)).astype(np.float32)
    out["quats"] = _quat_mul(_quat_from_matrix(R), params["quats"].astype(np.float64)).astype(np.float32)
    K = param_shapes(sh_degree)["shN"][0]
    if K:
        # colour seen along d' = R d in the new frame is the old colour along d = R^T d'
        M = sh_rotation(R.T, sh_degree)
        out["shN"] = np.einsum("kj,njc->nkc", M, params["shN"].astype(np.float64)).astype(np.float32)
    return out
