"""Synthetic scenes for tests and benchmarks: clustered point clouds, random Gaussians, cameras.

Everything is seeded and float32 where the real data is, with gsplat's parameter names.
"""
from __future__ import annotations

import numpy as np

from storage.schema import num_sh_rest


def clustered_points(n: int, seed: int = 0, clusters: int = 16, background: float = 0.1) -> np.ndarray:
    """[n, 3] float32 points: anisotropic Gaussian blobs of very different sizes in a 20-unit box,
    plus a `background` fraction spread uniformly, so an octree over them is deep in places."""
    rng = np.random.default_rng(seed)
    n_bg = int(n * background)
    centres = rng.uniform(-10, 10, (clusters, 3))
    widths = np.exp(rng.uniform(np.log(0.02), np.log(2.0), (clusters, 1))) * rng.uniform(0.3, 1.0, (clusters, 3))
    which = rng.integers(0, clusters, n - n_bg)
    blobs = centres[which] + rng.standard_normal((n - n_bg, 3)) * widths[which]
    points = np.concatenate([blobs, rng.uniform(-10, 10, (n_bg, 3))])
    return points[rng.permutation(n)].astype(np.float32)


def random_colors(n: int, seed: int = 0) -> np.ndarray:  # [n, 3] uint8
    return np.random.default_rng(seed).integers(0, 256, (n, 3), dtype=np.uint8)


def random_splats(n: int, sh_degree: int = 3, seed: int = 0) -> dict[str, np.ndarray]:
    """Trained-looking Gaussians: means [n,3], scales [n,3] (log), quats [n,4], opacities [n],
    sh0 [n,1,3], shN [n,K,3], all float32 with arbitrary (non-round) values."""
    rng = np.random.default_rng(seed)
    f32 = np.float32
    return {
        "means": clustered_points(n, seed),
        "scales": rng.uniform(-6.0, -1.0, (n, 3)).astype(f32),
        "quats": rng.standard_normal((n, 4)).astype(f32),
        "opacities": rng.normal(0.0, 3.0, n).astype(f32),
        "sh0": rng.normal(0.0, 1.0, (n, 1, 3)).astype(f32),
        "shN": rng.normal(0.0, 0.3, (n, num_sh_rest(sh_degree), 3)).astype(f32),
    }


def look_at(eye: np.ndarray, target: np.ndarray, up: np.ndarray = np.array([0.0, 0.0, 1.0])) -> np.ndarray:
    """World-to-camera [4, 4] (OpenCV axes: x right, y down, z forward) of a camera at `eye` facing `target`."""
    forward = np.asarray(target, dtype=np.float64) - eye
    forward /= np.linalg.norm(forward)
    right = np.cross(forward, up)
    if np.linalg.norm(right) < 1e-9:  # looking along `up`: any perpendicular will do
        right = np.cross(forward, [1.0, 0.0, 0.0])
    right /= np.linalg.norm(right)
    down = np.cross(forward, right)
    R = np.stack([right, down, forward])
    viewmat = np.eye(4)
    viewmat[:3, :3] = R
    viewmat[:3, 3] = -R @ eye
    return viewmat


def pinhole_K(width: int, height: int, fov_x_deg: float) -> np.ndarray:  # [3, 3], principal point centred
    f = 0.5 * width / np.tan(np.radians(fov_x_deg) / 2)
    return np.array([[f, 0.0, width / 2], [0.0, f, height / 2], [0.0, 0.0, 1.0]])
