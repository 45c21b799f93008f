"""Synthetic Gaussians without a scene: clustered point clouds, random trained-looking splats, and
store blocks for the storage benchmarks.

Everything is seeded and float32 where the real data is, with gsplat's parameter names.
"""
from __future__ import annotations

import numpy as np

from octree.semantics import SH_C0
from storage.schema import block_schema, num_sh_rest


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


def scene_block(points: np.ndarray, colors: np.ndarray, rows: int, sh_degree: int, seed: int, trained: bool = True) -> dict[str, np.ndarray]:
    """rows Gaussians at real scene points (sampled, jittered) with trained-looking values, or
    (trained=False) as right after initialisation: shN, Adam state and statistics all zero."""
    rng = np.random.default_rng(seed)
    pick = rng.integers(0, len(points), rows)
    f32 = np.float32
    k = num_sh_rest(sh_degree)
    params = {
        "means": (points[pick] + rng.normal(0, 1e-3, (rows, 3))).astype(f32),
        "scales": rng.uniform(-6.0, -1.0, (rows, 3)).astype(f32),
        "quats": rng.standard_normal((rows, 4)).astype(f32),
        "opacities": rng.normal(0.0, 3.0, rows).astype(f32),
        "sh0": ((colors[pick].astype(f32) / 255 - 0.5) / SH_C0)[:, None, :],
        "shN": rng.normal(0.0, 0.1, (rows, k, 3)).astype(f32),
    }
    block = dict(params)
    for name, a in params.items():
        block[f"exp_avg_{name}"] = rng.normal(0.0, 1e-3, a.shape).astype(f32)
        block[f"exp_avg_sq_{name}"] = (rng.normal(0.0, 1e-3, a.shape) ** 2).astype(f32)
    block["adam_step"] = rng.integers(0, 7000, rows).astype(np.int32)
    block["grad2d"] = np.abs(rng.normal(0, 1e-4, rows)).astype(f32)
    block["count"] = rng.integers(0, 500, rows).astype(np.int32)
    block["max_radii"] = rng.uniform(0, 0.05, rows).astype(f32)
    if not trained:
        block = {n: a if n in ("means", "scales", "quats", "opacities", "sh0") else np.zeros_like(a) for n, a in block.items()}
    assert set(block) == set(block_schema(sh_degree))
    return block
