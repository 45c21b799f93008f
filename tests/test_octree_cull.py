"""Frustum culling never drops a block whose Gaussians make a splat, checked against gsplat's own
pure-torch projection of every Gaussian (radius > 0 means the splat reaches the image)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gsplat.cuda._torch_impl import _fully_fused_projection, _quat_scale_to_covar_preci

from octree import build_octree, extent_boxes, frustum_cull
from octree.bounds import EMPTY_BOX
from tools.scenes import clustered_points, look_at


def splat_visible(means, log_scales, quats, viewmat, K, width, height, near, far) -> np.ndarray:  # [N] bool
    covars, _ = _quat_scale_to_covar_preci(
        torch.from_numpy(quats), torch.from_numpy(np.exp(log_scales)), compute_preci=False, triu=False
    )
    radii, *_ = _fully_fused_projection(
        torch.from_numpy(means),
        covars,
        torch.from_numpy(viewmat).float()[None],
        torch.from_numpy(K).float()[None],
        width,
        height,
        near_plane=near,
        far_plane=far,
    )
    return (radii[0] > 0).any(dim=-1).numpy()


def random_camera(rng):
    width, height = int(rng.integers(40, 320)), int(rng.integers(40, 320))
    f = rng.uniform(0.3, 3.0) * width
    K = np.array(
        [[f, 0, width * rng.uniform(0.2, 0.8)], [0, f * rng.uniform(0.7, 1.3), height * rng.uniform(0.2, 0.8)], [0, 0, 1]]
    )
    return K, width, height


def check_conservative(means, log_scales, quats, cap, viewmat, K, width, height, near, far):
    """Cull the octree's blocks; return (blocks needed, blocks kept) after asserting needed <= kept."""
    tree = build_octree(means, cap)
    boxes = extent_boxes(means[tree.order], log_scales[tree.order], tree.starts)
    keep = frustum_cull(boxes, viewmat, K, width, height, near, far)
    visible = splat_visible(means, log_scales, quats, viewmat, K, width, height, near, far)
    needed = np.zeros(len(keep), dtype=bool)
    needed[tree.labels()[visible]] = True
    dropped = np.flatnonzero(needed & ~keep)
    assert len(dropped) == 0, f"culled {len(dropped)} blocks with visible Gaussians, e.g. {tree.keys[dropped[0]]}"
    return int(needed.sum()), int(keep.sum()), len(keep)


@pytest.mark.parametrize("seed", range(6))
def test_scene_blocks_never_dropped(seed):
    rng = np.random.default_rng(seed)
    n = 6000
    means = clustered_points(n, seed=seed)
    log_scales = rng.uniform(-6, 0.5, (n, 3)).astype(np.float32)
    quats = rng.standard_normal((n, 4)).astype(np.float32)
    K, width, height = random_camera(rng)
    # Some cameras stand inside the scene, some outside; near and far planes cut through it.
    viewmat = look_at(rng.uniform(-14, 14, 3), rng.uniform(-5, 5, 3))
    near, far = rng.uniform(0.01, 2.0), rng.uniform(5.0, 30.0)
    cap = [1, 16, 128][seed % 3]
    needed, kept, total = check_conservative(means, log_scales, quats, cap, viewmat, K, width, height, near, far)
    assert kept < total  # culling does something


@pytest.mark.parametrize("seed", range(8))
def test_gaussians_straddling_the_image_border(seed):
    """One isotropic Gaussian per block placed so its 3.33-sigma splat ends near an image edge:
    the tightest case for the bound (a single Gaussian's box is exactly its own cube)."""
    rng = np.random.default_rng(100 + seed)
    K, width, height = random_camera(rng)
    n = 3000
    z = rng.uniform(0.3, 20.0, n)
    s = z * rng.uniform(1e-3, 0.2, n) * width / K[0, 0] / 10
    rx = 3.33 * np.sqrt((s * K[0, 0] / z) ** 2 + 0.3)
    ry = 3.33 * np.sqrt((s * K[1, 1] / z) ** 2 + 0.3)
    side, w = rng.integers(0, 4, n), rng.uniform(0.8, 1.3, n)
    u, v = rng.uniform(0, width, n), rng.uniform(0, height, n)
    u = np.where(side == 0, -rx * w, np.where(side == 1, width + rx * w, u))
    v = np.where(side == 2, -ry * w, np.where(side == 3, height + ry * w, v))
    cam = np.stack([(u - K[0, 2]) / K[0, 0] * z, (v - K[1, 2]) / K[1, 1] * z, z], axis=1)
    rot = np.linalg.qr(rng.standard_normal((3, 3)))[0]
    rot *= np.sign(np.linalg.det(rot))
    viewmat = np.eye(4)
    viewmat[:3, :3], viewmat[:3, 3] = rot, rng.normal(0, 3, 3)
    means = ((cam - viewmat[:3, 3]) @ rot).astype(np.float32)
    log_scales = np.repeat(np.log(s)[:, None], 3, axis=1).astype(np.float32)
    quats = np.tile(np.float32([1, 0, 0, 0]), (n, 1))
    needed, kept, total = check_conservative(means, log_scales, quats, 1, viewmat, K, width, height, 0.5, 15.0)
    assert 0 < needed < total  # the set really straddles visibility


def test_simple_cases_and_bad_planes():
    K = np.array([[100.0, 0, 50], [0, 100.0, 50], [0, 0, 1]])
    viewmat = np.eye(4)  # camera at the origin looking down +z
    boxes = np.array(
        [
            [-1, -1, 4, 1, 1, 6],  # straight ahead
            [-1, -1, -6, 1, 1, -4],  # behind
            [50, -1, 4, 52, 1, 6],  # far to the right
            [-1, -1, 200, 1, 1, 210],  # beyond far
            EMPTY_BOX,
        ]
    )
    assert frustum_cull(boxes, viewmat, K, 100, 100, near=0.1, far=100).tolist() == [True, False, False, False, False]
    with pytest.raises(ValueError, match="near"):
        frustum_cull(boxes, viewmat, K, 100, 100, near=0.0)
