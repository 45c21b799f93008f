"""transforms.json scenes (nerfstudio and instant-ngp flavours) generated with known poses."""
from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image
from plyfile import PlyData, PlyElement

from train.data import DataConfig, DatasetError, DatasetWarning, load_scene

POINTS = np.array([[0.0, 0.0, 0.0], [0.5, -0.3, 0.2], [-0.4, 0.6, -0.1], [0.2, 0.2, 0.7]])


def _look_at(centre, target=np.zeros(3), up=np.array([0.0, 0.0, 1.0])):  # OpenCV camera-to-world
    z = (target - centre) / np.linalg.norm(target - centre)
    x = np.cross(z, up)
    x /= np.linalg.norm(x)
    c2w = np.eye(4)
    c2w[:3, :3] = np.stack([x, np.cross(z, x), z], axis=1)  # x right, y down, z forward
    c2w[:3, 3] = centre
    return c2w


def _ring(n, radius=4.0, height=1.0):
    angles = np.linspace(0, 2 * np.pi, n, endpoint=False)
    return [_look_at(np.array([radius * np.cos(a), radius * np.sin(a), height])) for a in angles]


def _opengl(c2w):  # what transforms.json stores: camera y up, z backwards
    return (c2w @ np.diag([1.0, -1.0, -1.0, 1.0])).tolist()


def _write_scene(folder, poses, size=(32, 24), ext=".png", name_ext=True, **meta):
    (folder / "images").mkdir(parents=True, exist_ok=True)
    frames = []
    for i, c2w in enumerate(poses):
        Image.new("RGB", size, (i, 2 * i, 3 * i)).save(folder / "images" / f"f{i:03d}{ext}")
        frames.append({"file_path": f"images/f{i:03d}{ext if name_ext else ''}", "transform_matrix": _opengl(c2w)})
    (folder / "transforms.json").write_text(json.dumps({**meta, "frames": frames}))


def _project(camera, xyz):
    p = xyz @ camera.viewmat[:3, :3].T + camera.viewmat[:3, 3]
    return p[:, :2] / p[:, 2:] @ camera.K[:2, :2].T + camera.K[:2, 2]


@pytest.mark.parametrize("normalize", [False, True])
def test_opengl_poses_become_opencv_cameras(tmp_path, normalize):
    poses = _ring(8)
    _write_scene(tmp_path, poses, fl_x=30.0, fl_y=31.0, cx=16.5, cy=11.5, w=32, h=24)
    scene = load_scene(tmp_path, DataConfig(normalize=normalize, random_points=500))
    assert len(scene.cameras) == 8 and [c.name for c in scene.test_cameras] == ["images/f000.png"]
    points = np.c_[POINTS, np.ones(len(POINTS))] @ scene.world_transform[:3].T
    for cam, c2w in zip(scene.cameras, poses):
        cam_pts = (POINTS - c2w[:3, 3]) @ c2w[:3, :3]  # known OpenCV camera coordinates
        assert (cam_pts[:, 2] > 0).all()  # all in front: a wrong axis flip would put them behind
        expected = cam_pts[:, :2] / cam_pts[:, 2:] * [30.0, 31.0] + [16.5, 11.5]
        np.testing.assert_allclose(_project(cam, points), expected, atol=1e-9)


def test_ngp_flavour_camera_angle_and_extensionless_paths(tmp_path):
    _write_scene(tmp_path, _ring(3), size=(40, 30), name_ext=False, camera_angle_x=1.2)
    scene = load_scene(tmp_path, DataConfig(normalize=False, test_every=0))
    cam = scene.cameras[0]
    assert (cam.width, cam.height) == (40, 30)  # read from the image, as the file gives no w, h
    np.testing.assert_allclose(cam.K, [[20 / np.tan(0.6), 0, 20], [0, 20 / np.tan(0.6), 15], [0, 0, 1]])
    assert cam.extra["image_path"].endswith("f000.png")


def test_per_frame_intrinsics_override_global(tmp_path):
    _write_scene(tmp_path, _ring(2), fl_x=30.0, w=32, h=24)
    meta = json.loads((tmp_path / "transforms.json").read_text())
    meta["frames"][1].update(fl_x=45.0, cx=10.0)
    (tmp_path / "transforms.json").write_text(json.dumps(meta))
    a, b = load_scene(tmp_path, DataConfig(normalize=False, test_every=0)).cameras
    assert (a.K[0, 0], a.K[0, 2], b.K[0, 0], b.K[1, 1], b.K[0, 2]) == (30.0, 16.0, 45.0, 45.0, 10.0)


def test_missing_images_are_skipped_with_one_warning(tmp_path):
    _write_scene(tmp_path, _ring(6), fl_x=30.0, w=32, h=24)
    for i in (1, 4):
        (tmp_path / "images" / f"f{i:03d}.png").unlink()
    with pytest.warns(DatasetWarning, match="skipped 2 of 6 frames") as caught:
        scene = load_scene(tmp_path, DataConfig(normalize=False))
    assert len(caught) == 1
    assert [c.name for c in scene.cameras] == [f"images/f{i:03d}.png" for i in (0, 2, 3, 5)]


def test_random_points_fill_the_camera_bounds_or_the_aabb(tmp_path):
    _write_scene(tmp_path / "a", _ring(5, radius=3.0, height=2.0), fl_x=30.0, w=32, h=24)
    scene = load_scene(tmp_path / "a", DataConfig(normalize=False, random_points=2000, seed=3))
    assert scene.random_points and scene.points.shape == (2000, 3) and scene.colors.shape == (2000, 3)
    centres = np.array([c.center for c in scene.cameras])
    lo, hi = centres.min(0), centres.max(0)
    assert (scene.points[:, :2] >= lo[:2] - 1e-9).all() and (scene.points[:, :2] <= hi[:2] + 1e-9).all()
    again = load_scene(tmp_path / "a", DataConfig(normalize=False, random_points=2000, seed=3))
    np.testing.assert_array_equal(again.points, scene.points)  # seeded
    _write_scene(tmp_path / "b", _ring(5), fl_x=30.0, w=32, h=24, aabb_scale=4)
    ngp = load_scene(tmp_path / "b", DataConfig(normalize=False, random_points=2000))
    half = 4 / (2 * 0.33)  # instant-ngp's box in the input frame (default scale 0.33)
    assert np.abs(ngp.points).max() <= half and np.abs(ngp.points).max() > 0.9 * half


def test_normalisation_without_points_uses_the_cameras(tmp_path):
    poses = [_look_at(np.array([4 * np.cos(a) + 10, 4 * np.sin(a) - 3, 1.0 + 0.3 * np.sin(3 * a)]),
                      target=np.array([10.0, -3.0, 0.0])) for a in np.linspace(0, 6, 7)]
    _write_scene(tmp_path, poses, fl_x=30.0, w=32, h=24)
    scene = load_scene(tmp_path, DataConfig())
    centres = np.array([c.center for c in scene.cameras])
    # gsplat's similarity_from_cameras: mean camera up onto -y, median distance to the origin 1.
    assert np.median(np.linalg.norm(centres, axis=1)) == pytest.approx(1.0)
    ups = np.array([-c.camtoworld[:3, 1] for c in scene.cameras]).mean(0)
    np.testing.assert_allclose(ups / np.linalg.norm(ups), [0, -1, 0], atol=1e-9)


def test_ply_point_cloud_is_the_initial_points(tmp_path):
    _write_scene(tmp_path, _ring(3), fl_x=30.0, w=32, h=24, ply_file_path="points.ply")
    vertex = np.array([tuple(p) + (10 * i, 20, 30) for i, p in enumerate(POINTS)],
                      dtype=[("x", "f4"), ("y", "f4"), ("z", "f4"), ("red", "u1"), ("green", "u1"), ("blue", "u1")])
    PlyData([PlyElement.describe(vertex, "vertex")]).write(str(tmp_path / "points.ply"))
    scene = load_scene(tmp_path, DataConfig(normalize=False))
    assert not scene.random_points
    np.testing.assert_allclose(scene.points, POINTS, atol=1e-7)
    np.testing.assert_array_equal(scene.colors[:, 0], [0, 10, 20, 30])
    cameras_only = load_scene(tmp_path, DataConfig(normalize=False, point_cloud=False))
    assert cameras_only.points.shape == (0, 3) and not cameras_only.random_points
    assert [c.name for c in cameras_only.train_cameras] == [c.name for c in scene.train_cameras]


def test_cameras_only_neither_reads_nor_checks_the_point_cloud(tmp_path):
    """The trainer's load (its store holds the Gaussians): a 44 M-point cloud cost it 2.2 GB."""
    _write_scene(tmp_path, _ring(3), fl_x=30.0, w=32, h=24, ply_file_path="points.ply")
    (tmp_path / "points.ply").write_bytes(b"not a ply")
    with pytest.raises(DatasetError, match="points.ply.*unreadable"):
        load_scene(tmp_path, DataConfig(normalize=False))
    scene = load_scene(tmp_path, DataConfig(normalize=False, point_cloud=False))
    assert len(scene.points) == 0 and len(scene.train_cameras) == 2
