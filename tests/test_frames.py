"""Exporting to the input's frame: Gaussians mapped through a similarity against direct evaluation."""
from __future__ import annotations

import numpy as np
import torch
from gsplat.cuda._torch_impl import _quat_scale_to_covar_preci, _spherical_harmonics
from scipy.spatial.transform import Rotation

from tools.frames import transform_gaussians


def _params(n: int, degree: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    k = (degree + 1) ** 2 - 1
    return {
        "means": rng.normal(size=(n, 3)).astype(np.float32),
        "scales": rng.normal(size=(n, 3)).astype(np.float32) - 2,
        "quats": rng.normal(size=(n, 4)).astype(np.float32),
        "opacities": rng.normal(size=n).astype(np.float32),
        "sh0": rng.normal(size=(n, 1, 3)).astype(np.float32),
        "shN": rng.normal(size=(n, k, 3)).astype(np.float32),
    }


def _similarity(seed: int) -> np.ndarray:
    T = np.eye(4)
    T[:3, :3] = 1.7 * Rotation.random(random_state=seed).as_matrix()
    T[:3, 3] = [0.5, -2.0, 3.0]
    return T


def _colours(p: dict[str, np.ndarray], viewer: np.ndarray, degree: int) -> np.ndarray:
    coeffs = torch.from_numpy(np.concatenate([p["sh0"], p["shN"]], 1)).double()
    dirs = torch.from_numpy(p["means"] - viewer).double()
    return _spherical_harmonics(degree, dirs, coeffs).numpy()


def _covariances(p: dict[str, np.ndarray]) -> np.ndarray:
    q = torch.from_numpy(p["quats"]).double()
    s = torch.exp(torch.from_numpy(p["scales"]).double())
    return _quat_scale_to_covar_preci(q, s, compute_covar=True, compute_preci=False)[0].numpy()


def test_colour_means_and_covariances_follow_the_similarity():
    for degree in (1, 2, 3):
        p = _params(50, degree, seed=degree)
        T = _similarity(degree)
        q = transform_gaussians(p, T, degree)
        A, t = T[:3, :3], T[:3, 3]
        np.testing.assert_allclose(q["means"], p["means"] @ A.T + t, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(_covariances(q), A @ _covariances(p) @ A.T, rtol=1e-4, atol=1e-6)
        viewer = np.array([4.0, 1.0, -2.0])
        np.testing.assert_allclose(_colours(q, A @ viewer + t, degree), _colours(p, viewer, degree), atol=2e-5)
        np.testing.assert_array_equal(q["opacities"], p["opacities"])


def test_identity_is_bit_exact_and_inverse_round_trips():
    p = _params(20, 3)
    assert transform_gaussians(p, np.eye(4), 3) is p
    T = _similarity(7)
    back = transform_gaussians(transform_gaussians(p, T, 3), np.linalg.inv(T), 3)
    for k in ("means", "scales", "shN"):
        np.testing.assert_allclose(back[k], p[k], atol=1e-4)
    # quaternions are equal up to sign
    qa = back["quats"] / np.linalg.norm(back["quats"], axis=1, keepdims=True)
    qb = p["quats"] / np.linalg.norm(p["quats"], axis=1, keepdims=True)
    np.testing.assert_allclose(np.abs((qa * qb).sum(1)), 1.0, atol=1e-5)
