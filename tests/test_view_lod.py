"""The viewer's level of detail (`tools/view/lod.py`): a merge is the moment match of the Gaussians
it replaces (checked against the mixture's moments computed here from scipy's rotations), a lone
Gaussian comes back as it was, the level follows the block's size on screen, and a merged frame
stays within a bound of the exact one while projecting far fewer Gaussians."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.spatial.transform import Rotation

from storage import Store
from storage.table import BlockInfo
from train.camera import Camera
from tools.view.cameras import orbit
from tools.view.lod import lod_levels, merge_block
from tools.view.render import FrustumRenderer
from tools.view.scene import load_blocks


def random_block(n: int, seed: int, extent: float = 10.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "means": torch.rand(n, 3, generator=g) * extent,
        "scales": torch.randn(n, 3, generator=g) * 0.5 - 3.0,
        "quats": torch.randn(n, 4, generator=g),
        "opacities": torch.randn(n, generator=g),
        "sh0": torch.randn(n, 1, 3, generator=g),
        "shN": torch.randn(n, 15, 3, generator=g),
    }


def covariances(p: dict[str, torch.Tensor]) -> np.ndarray:  # [N, 3, 3], from scipy's rotations (x y z w order)
    q = p["quats"].double().numpy()
    R = Rotation.from_quat(q[:, [1, 2, 3, 0]]).as_matrix()
    s = np.exp(p["scales"].double().numpy())
    return np.einsum("nij,nj,nkj->nik", R, s**2, R)


def test_a_lone_gaussian_comes_back_unchanged() -> None:
    block = random_block(40, seed=1)
    merged = merge_block(block, (0, 0, 0, 10, 10, 10), level=12)  # cubes of 2.4 mm: one Gaussian each
    assert merged["means"].shape[0] == 40
    order = np.lexsort(block["means"].numpy().T[::-1])  # merged cubes come in code order, not input order
    back = np.lexsort(merged["means"].numpy().T[::-1])
    for name in ("means", "opacities", "sh0", "shN"):
        np.testing.assert_allclose(merged[name].numpy()[back], block[name].numpy()[order], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(covariances(merged)[back], covariances(block)[order], rtol=1e-4, atol=1e-9)


def test_a_merge_is_the_moment_match_of_its_cube() -> None:
    block = random_block(7, seed=2, extent=1.0)
    merged = merge_block(block, (0, 0, 0, 1, 1, 1), level=0)  # one cube: everything merges
    alpha = 1 / (1 + np.exp(-block["opacities"].double().numpy()))
    s = np.sort(np.exp(block["scales"].double().numpy()), axis=1)
    w = alpha * s[:, 1] * s[:, 2]  # opacity times face-on area
    mu = block["means"].double().numpy()
    mean = (w[:, None] * mu).sum(0) / w.sum()
    d = mu - mean
    cov = (w[:, None, None] * (covariances(block) + d[:, :, None] * d[:, None, :])).sum(0) / w.sum()
    np.testing.assert_allclose(merged["means"].numpy()[0], mean, rtol=1e-5)
    np.testing.assert_allclose(covariances(merged)[0], cov, rtol=1e-4)
    for name in ("sh0", "shN"):
        expected = (w[:, None, None] * block[name].double().numpy()).sum(0) / w.sum()
        np.testing.assert_allclose(merged[name].numpy()[0], expected, rtol=1e-4, atol=1e-6)
    # The opacity keeps the weighted area: alpha * (the two largest sigmas) = sum of w.
    sm = np.sort(np.exp(merged["scales"].double().numpy()[0]))
    alpha_m = 1 / (1 + np.exp(-merged["opacities"].double().numpy()[0]))
    assert alpha_m * sm[1] * sm[2] == pytest.approx(min(w.sum(), 0.999 * sm[1] * sm[2]), rel=1e-4)
    q = merged["quats"].double().numpy()
    assert np.linalg.norm(q, axis=1) == pytest.approx(1.0, abs=1e-6)


def _info(count: int, lo: float = 0.0, hi: float = 1.0) -> BlockInfo:
    box = (lo, lo, lo, hi, hi, hi)
    return BlockInfo(key="1-0", version=0, count=count, cell=box, tight=box, extent=box)


def _camera_at(z: float, width: int = 640, focal: float = 500.0) -> Camera:
    """Looking down +z at the unit cube from z (negative: in front of it)."""
    view = np.eye(4)
    view[:3, 3] = [-0.5, -0.5, -z]
    K = np.array([[focal, 0, width / 2], [0, focal, width / 2], [0, 0, 1]])
    return Camera(view, K, width, width)


def lod_level(info: BlockInfo, camera: Camera, pixels: float) -> int | None:
    (level,) = lod_levels([info], camera, pixels)
    return level


def test_the_level_follows_the_blocks_size_on_screen() -> None:
    info = _info(10**6)
    far = _camera_at(-100.0)  # the cube's near face at depth 100: 1 m is 5 px
    assert lod_level(info, far, 1.0) == 3  # 2^3 cubes a side: 0.625 px each
    assert lod_level(info, far, 0.5) == 4
    assert lod_level(info, _camera_at(-200.0), 1.0) == 2  # twice as far, one level coarser
    assert lod_level(info, far, 0.0) is None  # 0: exact
    assert lod_level(info, _camera_at(-0.5), 1.0) is None  # inside the extent
    assert lod_level(_info(64), far, 1.0) is None  # 4^3 >= 64: each Gaussian could keep its own cube


def test_a_merged_frame_is_close_to_the_exact_one_and_projects_fewer(lund_store: Path) -> None:
    with Store.open(lund_store, mode="r") as store:
        scene = load_blocks(store, str(lund_store), 1, [])
        cam = orbit(scene.bounds(), 3, 160, 120, scene.up)[0]
        exact = FrustumRenderer(store, 64 << 20)
        ref, st = exact.render(cam)
        exact.close()
        assert st.lod.blocks == 0 and st.projected == st.gaussians == sum(i.count for i in store.table.values())
        for pixels, floor_db in ((1.0, 40.0), (2.0, 33.0)):
            r = FrustumRenderer(store, 64 << 20, lod_pixels=pixels)
            try:
                img, stats = r.render(cam)
                psnr = float(-10 * torch.log10(((img - ref) ** 2).mean()))
                assert psnr >= floor_db, (pixels, psnr)
                assert stats.lod.blocks > 0 and stats.projected <= st.projected // 2, (pixels, stats)
                assert stats.projected == st.projected - stats.lod.gaussians + stats.lod.proxies
                # Blocks and proxies share the budget: what the proxies hold is reserved in the block cache.
                assert r.cache.working_bytes == r.proxies.nbytes() > 0
                assert r.cache.nbytes() <= r.budget
                # The merged blocks come from the proxy cache: with no block resident, only the others are read.
                r.cache.release([b.key for b in r.cache.resident()])
                again, second = r.render(cam)
                assert torch.equal(again, img)
                assert second.paged_in == second.blocks - second.lod.blocks
            finally:
                r.close()


def test_the_proxy_cache_reuses_a_finer_merge_and_evicts_the_oldest() -> None:
    from tools.view.lod import ProxyCache

    proxy = {"means": torch.zeros(10, 3)}  # 120 bytes
    cache = ProxyCache(budget=250)
    cache.put(("a", 1, 3), proxy)
    cache.put(("a", 1, 5), None)  # merging at 5 did not pay: never drawn from
    assert cache.choose("a", 1, 2) == ("a", 1, 3)  # the finer merge held serves a coarser level
    assert cache.choose("a", 1, 4) == ("a", 1, 4)  # nothing finer worth drawing: make level 4
    assert cache.choose("a", 1, 5) == ("a", 1, 5) and cache.get(("a", 1, 5)) is None
    assert cache.choose("a", 2, 2) == ("a", 2, 2)  # another version of the block shares nothing
    cache.put(("b", 1, 1), proxy)
    cache.get(("a", 1, 3))  # used last: b's is now the oldest
    cache.put(("c", 1, 1), proxy)  # 360 bytes > 250: the oldest goes
    assert ("b", 1, 1) not in cache and ("a", 1, 3) in cache and ("c", 1, 1) in cache
    assert cache.nbytes() == 240
    cache.put(("d", 1, 1), {"means": torch.zeros(100, 3)})  # larger than the whole budget: not kept
    assert ("d", 1, 1) not in cache and cache.nbytes() == 240


def test_the_jacobi_eigensolver_matches_lapack_on_round_flat_and_tiny_covariances() -> None:
    from tools.view.lod import _eigh3

    rng = np.random.default_rng(1)
    B = rng.normal(size=(600, 3, 3))
    A = B @ B.transpose(0, 2, 1)
    A[:100] *= 1e-10  # tiny Gaussians
    Q, _ = np.linalg.qr(rng.normal(size=(100, 3, 3)))
    A[100:200] = Q @ (np.array([1e-12, 1.0, 2.0])[None, :, None] * Q.transpose(0, 2, 1))  # flat
    A[200:300] = np.eye(3) * 0.5  # round: every axis an eigenvector
    A[300:400] = np.diag([3.0, 1.0, 1.0])  # two equal
    vals, vecs = _eigh3(A)
    size = np.abs(A).max(axis=(1, 2))  # [M]
    assert (np.abs(vals - np.linalg.eigvalsh(A)).max(axis=1) <= 1e-12 * size).all()
    np.testing.assert_allclose(vecs.transpose(0, 2, 1) @ vecs, np.broadcast_to(np.eye(3), A.shape), atol=1e-12)
    rebuilt = vecs @ (vals[:, :, None] * vecs.transpose(0, 2, 1))
    assert (np.abs(rebuilt - A).max(axis=(1, 2)) <= 1e-12 * size).all()
