"""COLMAP readers on the real data: counts, reprojection of SfM points onto their observations, text <-> binary."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from train.data import read_colmap, write_colmap_binary, write_colmap_text


def _rotation(q):  # independent of the reader's: the rotation that takes v to q v q*
    w, x, y, z = q / np.linalg.norm(q)
    v = np.eye(3)
    qv = np.array([x, y, z])
    return np.stack([e + 2 * w * np.cross(qv, e) + 2 * np.cross(qv, np.cross(qv, e)) for e in v], axis=1)


def _reprojection_errors(model):
    """Pixel distance between every track entry's observation and its point projected with the raw model."""
    (cam,) = model.cameras.values()
    pts = model.points
    point = np.repeat(np.arange(len(pts)), np.diff(pts.track_offsets))
    errors = []
    for image_id in np.unique(pts.track_image_ids):
        img = model.images[int(image_id)]
        sel = pts.track_image_ids == image_id
        p = pts.xyz[point[sel]] @ _rotation(img.qvec).T + img.tvec
        x, y = p[:, 0] / p[:, 2], p[:, 1] / p[:, 2]
        if cam.model == "SIMPLE_RADIAL":
            f, cx, cy, k = cam.params
            radial = 1 + k * (x * x + y * y)
            uv = np.stack([f * x * radial + cx, f * y * radial + cy], axis=1)
        else:  # PINHOLE
            fx, fy, cx, cy = cam.params
            uv = np.stack([fx * x + cx, fy * y + cy], axis=1)
        errors.append(np.linalg.norm(uv - img.xys[pts.track_point2d_idx[sel]], axis=1))
    return np.concatenate(errors)


def test_lund_door_counts(shared_data):
    m = read_colmap(shared_data / "lund_door")
    assert not m.binary
    (cam,) = m.cameras.values()
    assert (cam.model, cam.width, cam.height) == ("SIMPLE_RADIAL", 1296, 1936)
    np.testing.assert_array_equal(cam.params, [2435.38, 648, 968, -0.0336422])
    assert len(m.images) == 12 and len(m.points) == 11384
    # images.txt's header: "mean observations per image: 6110.583333333333" (those with a 3D point)
    observed = sum(int((i.point3d_ids >= 0).sum()) for i in m.images.values())
    assert observed == round(6110.583333333333 * 12) == m.points.track_offsets[-1]
    assert {i.name for i in m.images.values()} == {f"DSC_{k:04d}.JPG" for k in range(1, 13)}


def test_vesta_counts(shared_data):
    m = read_colmap(shared_data / "vesta_colmap_bin")
    assert m.binary
    (cam,) = m.cameras.values()
    assert (cam.model, cam.width, cam.height) == ("PINHOLE", 1024, 1024)
    assert len(m.images) == 4 and len(m.points) == 1465
    assert sorted(i.name for i in m.images.values()) == ["00000000.png", "00000001.png", "00000002.png", "00000004.png"]


@pytest.mark.parametrize("name", ["lund_door", "vesta_colmap_bin"])
def test_points_project_onto_their_observations(shared_data, name):
    err = _reprojection_errors(read_colmap(shared_data / name))
    assert len(err) > 4000
    assert np.median(err) < 1.0 and np.percentile(err, 95) < 4.0


def _assert_models_equal(a, b):
    assert a.cameras.keys() == b.cameras.keys() and a.images.keys() == b.images.keys()
    for k, c in a.cameras.items():
        d = b.cameras[k]
        assert (c.model, c.width, c.height) == (d.model, d.width, d.height)
        np.testing.assert_array_equal(c.params, d.params)
    for k, i in a.images.items():
        j = b.images[k]
        assert (i.name, i.camera_id) == (j.name, j.camera_id)
        for f in ("qvec", "tvec", "xys", "point3d_ids"):
            np.testing.assert_array_equal(getattr(i, f), getattr(j, f))
    for f in ("ids", "xyz", "rgb", "error", "track_offsets", "track_image_ids", "track_point2d_idx"):
        np.testing.assert_array_equal(getattr(a.points, f), getattr(b.points, f))


def test_text_to_binary_agrees(shared_data, tmp_path):
    text = read_colmap(shared_data / "lund_door")
    write_colmap_binary(text, tmp_path / "sparse" / "0")
    binary = read_colmap(tmp_path)
    assert binary.binary
    _assert_models_equal(text, binary)


def test_binary_to_text_agrees_and_binary_writer_is_byte_exact(shared_data, tmp_path):
    src = shared_data / "vesta_colmap_bin" / "sparse"
    binary = read_colmap(src)
    write_colmap_text(binary, tmp_path / "text")
    text = read_colmap(tmp_path / "text")
    assert not text.binary
    _assert_models_equal(binary, text)
    # Written back from text, the binary files are COLMAP's own bytes.
    write_colmap_binary(text, tmp_path / "bin")
    for stem in ("cameras", "images", "points3D"):
        assert (tmp_path / "bin" / f"{stem}.bin").read_bytes() == (src / f"{stem}.bin").read_bytes()


def test_sparse_dir_lookup_prefers_sparse_0(shared_data, tmp_path):
    shutil.copytree(shared_data / "vesta_colmap_bin" / "sparse", tmp_path / "sparse" / "0")
    (tmp_path / "sparse" / "cameras.txt").write_text("garbage that must not be read\n")
    assert read_colmap(tmp_path).files["cameras"] == tmp_path / "sparse" / "0" / "cameras.bin"
