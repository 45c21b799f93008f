"""Generated datasets (`tools.scenes`, `python -m tools.make_scene`): written as the loader and the tiler
read them, rendered from the cameras the loader gives back, each camera seeing only part of the scene."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.spatial import cKDTree

import tools.scenes.make as scenes_make
from tools.make_scene import main
from octree.semantics import SH_C0
from tools.scenes import GROUND_TRUTH, SceneConfig, SceneError, build_scene, holdout_slots, make_scene
from train.data import DataConfig, load_scene
from train.render import project, render

REPO = Path(__file__).resolve().parents[1]
# 10 cameras: names 0 and 8 are held out, the last name (9) is not.
SMALL = SceneConfig(seed=3, width=64, height=48, cameras=10, gaussians=6000)
TINY_ARGS = ["--width", "16", "--height", "12", "--cameras", "3", "--gaussians", "500"]
SPLAT_KEYS = ("means", "scales", "quats", "opacities", "sh0", "shN")


@pytest.fixture(scope="module")
def wall(tmp_path_factory):
    out = tmp_path_factory.mktemp("scenes") / "wall"
    info = make_scene("wall", out, SMALL)
    return info, load_scene(out, DataConfig(normalize=False))


@pytest.fixture(scope="module")
def truth(wall):
    with np.load(wall[0].out_dir / GROUND_TRUTH) as gt:
        return {k: gt[k] for k in gt.files}


def _splats(truth) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(truth[k]) for k in SPLAT_KEYS}


def _pinhole(camera, xyz):  # [N, 3] -> uv [N, 2], depth [N], in plain numpy
    p = xyz @ camera.viewmat[:3, :3].T + camera.viewmat[:3, 3]
    return p[:, :2] / p[:, 2:] @ camera.K[:2, :2].T + camera.K[:2, 2], p[:, 2]


def test_loader_gives_back_the_generators_cameras(wall, truth):
    info, scene = wall
    assert [c.name for c in scene.cameras] == [c.name for c in info.cameras] == list(truth["names"])
    for loaded, made, viewmat in zip(scene.cameras, info.cameras, truth["viewmats"]):
        np.testing.assert_allclose(loaded.viewmat, made.viewmat, atol=1e-6)
        np.testing.assert_allclose(loaded.viewmat, viewmat, atol=1e-6)
        np.testing.assert_allclose(loaded.K, made.K, atol=1e-6)
        assert (loaded.width, loaded.height) == (64, 48)
        # Physically right, not only self-consistent: the camera faces the wall (+y), image y points down.
        assert loaded.viewmat[2, 1] > 0.9 and loaded.viewmat[1, 2] < -0.9
    assert [c.name for c in scene.test_cameras] == info.test_names == ["images/wall_0000.png", "images/wall_0008.png"]


def test_held_out_cameras_stand_between_training_cameras(wall):
    _, scene = wall
    train_x = np.array([c.center[0] for c in scene.train_cameras])
    for cam in scene.test_cameras:
        assert train_x.min() < cam.center[0] < train_x.max()
    for every in range(2, 11):
        for n in range(3 if every > 2 else 4, 41):  # two of three cameras held out: no way
            slots = holdout_slots(n, every)
            assert sorted(slots) == list(range(n))
            held = slots[::every]
            assert ((held > 0) & (held < n - 1)).all(), (n, every)


def test_images_are_the_renders_of_the_loaded_cameras(wall, truth):
    _, scene = wall
    for cam in scene.cameras:
        image = scene.load_image(cam)
        assert image.shape == (48, 64, 3)
        assert float(image.std()) > 0.05  # textured, not flat
        assert float((image.amax(-1) > 0.02).float().mean()) > 0.95  # the wall and ground fill the frame
    splats = _splats(truth)
    for cam in (scene.train_cameras[3], scene.test_cameras[1]):
        rgb, _, _ = render(splats, cam, int(truth["sh_degree"]), torch.from_numpy(truth["background"]).float())
        # The file holds the render rounded to 8 bits: within half a level, plus float noise.
        assert float((scene.load_image(cam) - rgb.clamp(0, 1)).abs().max()) <= 0.5 / 255 + 1e-4


def test_each_camera_sees_a_small_part_of_the_scene(wall, truth):
    """Measured: 13-15% of the Gaussians project into each camera at these settings (11-13% at the
    defaults); together the cameras see 99.7% of them (98%: the rest lie at the wall's ends and the far
    edge of the ground strip)."""
    info, scene = wall
    splats = _splats(truth)
    means = truth["means"].astype(np.float64)
    seen = np.zeros(len(means), dtype=bool)
    for cam, share in zip(scene.cameras, info.visible):
        with torch.no_grad():
            s2d = project(splats, cam, int(truth["sh_degree"]))
        ids = s2d.ids.numpy()
        uv, depth = _pinhole(cam, means)
        # The renderer's splat centres are the pinhole projections of the means, inside the image
        # (give or take the splat's radius).
        np.testing.assert_allclose(s2d.means2d.numpy(), uv[ids], atol=1e-2)
        r = s2d.radii.numpy()
        assert (depth[ids] > 0).all()
        assert ((uv[ids] > -r) & (uv[ids] < np.array([cam.width, cam.height]) + r)).all()
        # And nothing in clear view is missing.
        clear = (depth > 0.5) & ((uv > 2) & (uv < np.array([cam.width, cam.height]) - 2)).all(axis=1)
        assert np.isin(np.flatnonzero(clear), ids).all()
        assert len(ids) / len(means) == pytest.approx(share)
        assert 0.05 < share < 0.2
        seen[ids] = True
    assert seen.mean() > 0.95


def test_point_cloud_is_a_noisy_subsample(wall, truth):
    info, scene = wall
    assert scene.points.shape == (info.points, 3) and info.points == round(0.4 * 6000)
    assert scene.colors.dtype == np.uint8 and not scene.random_points
    dist, nearest = cKDTree(truth["means"]).query(scene.points)
    # Positional noise of 3 cm per axis: a median offset near 4.5 cm, none beyond a few sigma.
    assert 0.03 < np.median(dist) < 0.07 and dist.max() < 0.25
    gt_rgb = np.clip(truth["sh0"][nearest, 0] * SH_C0 + 0.5, 0, 1) * 255
    error = np.abs(scene.colors - gt_rgb)
    assert 6 < np.median(error) < 12  # colour noise of 12 levels (median |N(0, 12)| is 8)


def test_same_seed_same_bytes(wall, tmp_path):
    info, _ = wall
    again = make_scene("wall", tmp_path / "again", SMALL)
    files = sorted(p.relative_to(info.out_dir) for p in info.out_dir.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again.out_dir) for p in again.out_dir.rglob("*") if p.is_file())
    assert len(files) == 13  # transforms.json, points3d.ply, ground_truth.npz, 10 images
    for f in files:
        assert (info.out_dir / f).read_bytes() == (again.out_dir / f).read_bytes(), f
    other = build_scene("wall", SceneConfig(seed=4, gaussians=6000, cameras=10))
    assert not np.array_equal(other.splats["means"], build_scene("wall", SMALL).splats["means"])


def test_tiler_reads_the_dataset(wall, tmp_path):
    info, _ = wall
    run = subprocess.run([sys.executable, "-m", "tools.tile", str(info.out_dir), "--out", str(tmp_path / "s.zarr")],
                         cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 0, run.stderr
    assert int(re.search(r"Gaussians\s+([\d,]+)", run.stdout).group(1).replace(",", "")) == info.points
    assert "transforms dataset" in run.stdout and "10 cameras" in run.stdout


def test_city_scene(tmp_path):
    info = make_scene("city", tmp_path / "city", SceneConfig(cameras=4, width=48, height=27, gaussians=8000))
    assert abs(info.gaussians - 8000) < 800  # the density is scaled from a trial city; counts are Poisson
    scene = load_scene(tmp_path / "city", DataConfig(normalize=False))
    for loaded, made in zip(scene.cameras, info.cameras):
        np.testing.assert_allclose(loaded.viewmat, made.viewmat, atol=1e-6)
        image = scene.load_image(loaded)
        # Cameras looking out of the city were dropped: the city fills most of every image.
        assert float((image.amax(-1) > 0.02).float().mean()) > 0.5
    assert len(scene.points) == info.points == round(0.4 * info.gaussians)


def test_object_scene_is_enclosed_by_its_cameras(tmp_path):
    """What the object scene is for: the box the loader draws random points in (around the camera
    centres) holds the whole object, and every camera sees all of it."""
    out = tmp_path / "object"
    info = make_scene("object", out, SceneConfig(cameras=8, width=64, height=48, gaussians=4000))
    (out / "transforms.json").write_text(
        re.sub(r'"ply_file_path": "[^"]*",\s*', "", (out / "transforms.json").read_text()))
    scene = load_scene(out, DataConfig(normalize=False, random_points=2000))
    assert scene.random_points
    with np.load(out / GROUND_TRUTH) as gt:
        means, quats, scales = gt["means"], gt["quats"], gt["scales"]
    lo, hi = scene.points.min(axis=0), scene.points.max(axis=0)
    assert ((means > lo) & (means < hi)).all()
    assert info.visible.min() > 0.97
    # Flat Gaussians lie on their surface: the thin axis is the cube face's or the ball's normal.
    w, x, y, z = quats.T.astype(np.float64)
    thin = np.column_stack([2 * (x * z + w * y), 2 * (y * z - w * x), 1 - 2 * (x * x + y * y)])  # R @ e_z
    assert (scales[:, 2] < scales[:, 0]).all()
    on_cube = np.abs(means).max(axis=1) <= 1.0 + 1e-5
    face = np.argmax(np.abs(means[on_cube]), axis=1)
    expected = np.zeros((on_cube.sum(), 3))
    expected[np.arange(len(face)), face] = np.sign(means[on_cube][np.arange(len(face)), face])
    np.testing.assert_allclose(thin[on_cube], expected, atol=1e-5)
    ball = means[~on_cube] - [0.0, 0.0, 1.7]
    np.testing.assert_allclose(thin[~on_cube], ball / np.linalg.norm(ball, axis=1, keepdims=True), atol=1e-5)


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_cli_refuses_to_clobber(tmp_path, capsys):
    out = tmp_path / "scene"
    assert main(["wall", str(out), *TINY_ARGS]) == 0
    assert "Gaussians     500" in capsys.readouterr().out
    before = _snapshot(out)
    assert main(["wall", str(out), *TINY_ARGS, "--seed", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(out) in err and "--overwrite" in err
    assert _snapshot(out) == before
    assert main(["wall", str(out), *TINY_ARGS, "--seed", "1", "--overwrite"]) == 0
    with np.load(out / GROUND_TRUTH) as gt:
        assert int(gt["seed"]) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["scene"]  # no partial or old copies left
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    assert main(["wall", str(other), *TINY_ARGS, "--overwrite"]) == 1
    assert "not a generated scene" in capsys.readouterr().err and (other / "keep.txt").read_text() == "mine"


def test_cli_bad_config(tmp_path, capsys):
    assert main(["wall", str(tmp_path / "x"), "--cameras", "2"]) == 1
    assert "error: scene config: cameras must be at least 3" in capsys.readouterr().err
    assert main(["wall", str(tmp_path / "x"), "--sh-degree", "4"]) == 1
    assert "sh_degree" in capsys.readouterr().err
    with pytest.raises(SceneError, match="unknown scene kind 'moon'"):
        make_scene("moon", tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_failure_leaves_no_output(tmp_path, monkeypatch, capsys):
    def disk_full(path, *_):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(scenes_make, "write_points", disk_full)
    assert main(["wall", str(tmp_path / "scene"), *TINY_ARGS]) == 1
    assert "No space left on device" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
