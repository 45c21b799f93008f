"""load_scene on the real data: split, intrinsics, normalisation, reprojection through the loaded cameras."""
from __future__ import annotations

import numpy as np
import pytest

from train.data import DataConfig, load_scene, read_colmap

K_LUND = -0.0336422  # SIMPLE_RADIAL k of lund_door's camera


@pytest.fixture(scope="module")
def lund(shared_data, tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    return load_scene(shared_data / "lund_door", DataConfig(data_factor=4, cache_dir=cache))


def _project(camera, xyz):  # [P, 3] -> [P, 2] pixels, [P] depth
    p = xyz @ camera.viewmat[:3, :3].T + camera.viewmat[:3, 3]
    uv = p[:, :2] / p[:, 2:] @ camera.K[:2, :2].T + camera.K[:2, 2]
    return uv, p[:, 2]


def test_split_is_every_eighth_in_name_order(lund, shared_data):
    assert [c.name for c in lund.test_cameras] == ["DSC_0001.JPG", "DSC_0009.JPG"]
    assert len(lund.train_cameras) == 10
    every3 = load_scene(shared_data / "lund_door", DataConfig(test_every=3, check_images=False))
    assert [c.name for c in every3.test_cameras] == [f"DSC_{k:04d}.JPG" for k in (1, 4, 7, 10)]
    none = load_scene(shared_data / "lund_door", DataConfig(test_every=0, check_images=False))
    assert not none.test_cameras and len(none.train_cameras) == 12


def test_cameras_only_of_a_colmap_model_are_its_cameras_in_its_frame_without_points(lund, shared_data, tmp_path):
    only = load_scene(shared_data / "lund_door", DataConfig(data_factor=4, cache_dir=tmp_path, point_cloud=False))
    assert only.points.shape == (0, 3) and only.colors.shape == (0, 3) and not only.random_points
    assert len(lund.points) > 1000  # the full load keeps them, and normalised both by them
    for a, b in zip(only.train_cameras + only.test_cameras, lund.train_cameras + lund.test_cameras, strict=True):
        assert a.name == b.name
        np.testing.assert_array_equal(a.viewmat, b.viewmat)


def test_undistorted_intrinsics_at_factor(lund):
    cam = lund.train_cameras[0]
    src = cam.extra["image"]
    # The undistorted full-size camera keeps COLMAP's focal length; the downscaled one divides it.
    assert src.target.fx == src.target.fy == 2435.38
    assert (cam.width, cam.height) == (round(src.target.width / 4), round(src.target.height / 4))
    np.testing.assert_allclose(cam.K[0, 0], 2435.38 * cam.width / src.target.width)
    # No blank pixels: every pixel centre of the undistorted image maps inside the photo...
    t, s = src.target, src.source
    u, v = np.meshgrid(np.arange(t.width) + 0.5, np.arange(t.height) + 0.5)
    x, y = (u - t.cx) / t.fx, (v - t.cy) / t.fy
    radial = 1 + K_LUND * (x * x + y * y)
    px, py = s.fx * x * radial + s.cx, s.fy * y * radial + s.cy
    assert px.min() >= 0 and py.min() >= 0 and px.max() <= 1296 and py.max() <= 1936
    # ...and it is as large as that allows (within a pixel of the photo's edge on every side).
    assert px.min() < 1.5 and py.min() < 1.5 and px.max() > 1294.5 and py.max() > 1934.5


def test_loaded_cameras_reproject_sfm_points(lund, shared_data):
    """Normalised, undistorted, downscaled cameras and points land on COLMAP's raw observations."""
    model = read_colmap(shared_data / "lund_door")
    by_name = {c.name: c for c in lund.cameras}
    pts = model.points
    index = np.repeat(np.arange(len(pts)), np.diff(pts.track_offsets))
    errors = []
    for img in model.images.values():
        cam = by_name[img.name]
        t = cam.extra["image"].target
        sel = pts.track_image_ids == img.image_id
        uv, depth = _project(cam, lund.points[index[sel]])
        assert (depth > 0).all()
        # Back to the full-size undistorted image, then through the SIMPLE_RADIAL lens.
        full = uv * [t.width / cam.width, t.height / cam.height]
        x, y = (full[:, 0] - t.cx) / t.fx, (full[:, 1] - t.cy) / t.fy
        radial = 1 + K_LUND * (x * x + y * y)
        raw = np.stack([2435.38 * x * radial + 648, 2435.38 * y * radial + 968], axis=1)
        errors.append(np.linalg.norm(raw - img.xys[pts.track_point2d_idx[sel]], axis=1))
    errors = np.concatenate(errors)
    assert np.median(errors) < 1.0 and np.percentile(errors, 95) < 4.0


def test_normalisation_is_gsplats(lund):
    T = lund.world_transform
    s = np.linalg.norm(T[:3, 0])
    R = T[:3, :3] / s
    np.testing.assert_allclose(R.T @ R, np.eye(3), atol=1e-12)
    assert np.linalg.det(R) > 0
    p = lund.points
    # Principal axes on x, y, z with the spread decreasing; centred on the median (taken before the
    # rotation, so only near it after); not upside down.
    cov = np.cov(p - np.median(p, axis=0), rowvar=False)
    assert np.abs(cov - np.diag(np.diag(cov))).max() < 1e-9 * np.abs(cov).max()
    assert cov[0, 0] > cov[1, 1] > cov[2, 2]
    assert (np.abs(np.median(p, axis=0)) < 0.25 * np.sqrt(np.diag(cov))).all()
    assert np.median(p[:, 2]) <= np.mean(p[:, 2])
    centres = np.array([c.center for c in lund.cameras])
    assert lund.scene_scale == pytest.approx(1.1 * np.linalg.norm(centres - centres.mean(0), axis=1).max())


def test_raw_scene_moved_by_the_transform_equals_the_normalised_scene(lund, shared_data, tmp_path):
    raw = load_scene(shared_data / "lund_door", DataConfig(data_factor=4, normalize=False, cache_dir=tmp_path))
    np.testing.assert_array_equal(raw.world_transform, np.eye(4))
    moved = raw.with_transform(lund.world_transform)
    np.testing.assert_allclose(moved.world_transform, lund.world_transform)
    np.testing.assert_allclose(moved.points, lund.points, atol=1e-12)
    assert moved.scene_scale == pytest.approx(lund.scene_scale, rel=1e-12)
    for a, b in zip(moved.cameras, lund.cameras):
        assert a.name == b.name and (a.width, a.height) == (b.width, b.height)
        np.testing.assert_allclose(a.viewmat, b.viewmat, atol=1e-12)
        np.testing.assert_array_equal(a.K, b.K)
    # Pixels do not depend on the frame: raw points through raw cameras land where normalised ones do.
    uv_raw, _ = _project(raw.cameras[3], raw.points)
    uv_norm, _ = _project(lund.cameras[3], lund.points)
    np.testing.assert_allclose(uv_raw, uv_norm, atol=1e-6)


def test_vesta_binary_pinhole_scene(shared_data):
    scene = load_scene(shared_data / "vesta_colmap_bin")
    assert scene.kind == "colmap-binary" and len(scene.points) == 1465 and not scene.random_points
    assert [c.name for c in scene.test_cameras] == ["00000000.png"]
    cam = scene.train_cameras[0]
    assert (cam.width, cam.height) == (1024, 1024) and cam.extra["image"].cache is None
    np.testing.assert_allclose(cam.K[[0, 1, 0, 1], [0, 1, 2, 2]], [10714.9921875, 10721.8828125, 511.00089545,
                                                                   511.00090736])
