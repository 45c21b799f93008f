"""tools.bench opensplat without OpenSplat: the no-binary path, the timing arithmetic, the A side
against a stand-in executable, and the dataset both programs read, checked against lund_door's
COLMAP text parsed here."""
from __future__ import annotations

import json
import os
import stat
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from scipy.spatial import cKDTree

from tools.bench import opensplat as bench
from tools.bench.train import BenchError
from train.data.transforms import read_transforms_scene


def test_without_a_binary_it_says_how_to_get_one_and_exits_0(tmp_path, capsys):
    assert bench.main([]) == 0
    assert "OpenSplat is needed" in capsys.readouterr().out
    (tmp_path / "opensplat").write_text("not executable")
    for path in (tmp_path / "missing", tmp_path, tmp_path / "opensplat"):
        assert bench.main(["--opensplat", str(path)]) == 0
        out = capsys.readouterr().out
        assert "not an executable file" in out and "docs/benchmarks.md" in out


def test_step_lines_give_seconds_per_iter():
    lines = [(0.5, "Using CPU"), (1.0, "Reading 10000 points"), (2.0, "Step 1: 0.31 [0%]")]
    lines += [(2.0 + 0.25 * s, f"Step {s}: 0.2 [{s // 2}%]") for s in range(2, 201)]
    lines.insert(50, (9.9, "Opacity reset"))
    times = bench.step_times(lines)
    assert sorted(times) == list(range(1, 201)) and times[1] == 2.0 and times[200] == 52.0
    assert bench.seconds_per_iter(times, 10, 200) == pytest.approx((52.0 - 4.5) / 190)
    with pytest.raises(BenchError):
        bench.seconds_per_iter({10: 1.0}, 10, 200)


def test_marginal_cost_per_1k_gaussians():
    # the figures: +76 ms and +66 ms from 10k to 50k are 1.9 and 1.65 ms per 1k more
    got = bench.marginal_ms_per_1k([(50_000, 0.371), (10_000, 0.295), (200_000, 0.971)])
    assert [(a, b) for a, b, _ in got] == [(10_000, 50_000), (50_000, 200_000)]
    assert got[0][2] == pytest.approx(1.9) and got[1][2] == pytest.approx(4.0)
    assert bench.marginal_ms_per_1k([(10_000, 0.0484), (50_000, 0.1146)])[0][2] == pytest.approx(1.655)


def test_cpu_seconds_reads_this_process():
    np.sort(np.random.default_rng(0).random(3_000_000))  # some CPU time to count
    times = os.times()
    assert bench.cpu_seconds(os.getpid()) == pytest.approx(times.user + times.system, abs=0.05)


def _stand_in(tmp_path: Path, body: str) -> Path:
    exe = tmp_path / "fake-opensplat"
    exe.write_text(f"#!{sys.executable}\nimport sys, time\n{body}\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return exe


def test_opensplat_side_against_a_stand_in(tmp_path):
    # prints as OpenSplat does, one flushed line a step, 20 ms apart
    exe = _stand_in(tmp_path, "print('Reading 1234 points', flush=True)\n"
                    "n = int(sys.argv[sys.argv.index('-n') + 1])\n"
                    "assert '--densify-until' in sys.argv and '--cpu' in sys.argv\n"
                    "for s in range(1, n + 1):\n    time.sleep(0.02)\n    print(f'Step {s}: 0.1 [0%]', flush=True)\n"
                    "time.sleep(60)")  # its save, which the bench does not wait for
    run = bench.run_opensplat(exe, tmp_path, tmp_path / "out", 30)
    assert run.gaussians == 1234 and 0.019 < run.seconds_per_step < 0.2 and 0.0 <= run.cores < 0.5  # loose: shared cores
    failing = _stand_in(tmp_path, "print('Step 1: 0.1 [0%]', flush=True)\nsys.exit('bad input')")
    with pytest.raises(BenchError, match="bad input"):
        bench.run_opensplat(failing, tmp_path, tmp_path / "out", 30)


def _quat_to_rotmat(*q: float) -> np.ndarray:
    w, x, y, z = np.array(q) / np.linalg.norm(q)  # the file's are unit to 6 digits
    return np.array([[1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)],
                     [2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)],
                     [2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)]])


def _colmap_text(sparse: Path) -> tuple[list[float], dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """(w, h, f, cx, cy), name -> world-to-camera, points, colours: lund_door's model read here."""
    cam = next(ln for ln in (sparse / "cameras.txt").read_text().splitlines() if not ln.startswith("#")).split()
    rows = [ln for ln in (sparse / "images.txt").read_text().splitlines() if ln and not ln.startswith("#")]
    poses = {}
    for row in rows[::2]:  # every image's second line lists its 2D points
        t = row.split()
        w2c = np.eye(4)
        w2c[:3, :3] = _quat_to_rotmat(*map(float, t[1:5]))
        w2c[:3, 3] = list(map(float, t[5:8]))
        poses[t[9]] = w2c
    pts = np.array([ln.split()[1:7] for ln in (sparse / "points3D.txt").read_text().splitlines()
                    if not ln.startswith("#")], dtype=np.float64)
    return [float(v) for v in cam[2:7]], poses, pts[:, :3], pts[:, 3:].astype(np.uint8)


def _ply(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """The layout OpenSplat's reader expects (its binary path reads 3 floats, then 3 bytes, a vertex)."""
    header, body = path.read_bytes().split(b"end_header\n", 1)
    lines = header.decode().splitlines()
    assert lines[:2] == ["ply", "format binary_little_endian 1.0"] and lines[2].startswith("element vertex ")
    assert lines[3:] == ["property float x", "property float y", "property float z",
                         "property uchar red", "property uchar green", "property uchar blue"]
    n = int(lines[2].split()[-1])
    assert len(body) == n * 15
    rows = np.frombuffer(body, dtype=[("xyz", "<f4", 3), ("rgb", "u1", 3)])
    return rows["xyz"], rows["rgb"]


@pytest.fixture(scope="module")
def lund(shared_data):
    return shared_data / "lund_door", _colmap_text(shared_data / "lund_door" / "sparse")


def test_dataset_cameras_and_photos(lund, tmp_path):
    source, ((w, h, f, cx, cy), poses, _, _) = lund
    data = bench.make_dataset(source, tmp_path, 500)
    meta = json.loads((data / "transforms.json").read_text())
    assert meta["ply_file_path"] == "points.ply" and len(meta["frames"]) == len(poses) == 12
    for frame in meta["frames"]:
        name = Path(frame["file_path"]).stem + ".JPG"
        c2w_gl = np.array(frame["transform_matrix"])
        np.testing.assert_allclose(np.linalg.inv(c2w_gl @ np.diag([1.0, -1, -1, 1])), poses[name], atol=1e-9)
        assert (frame["w"], frame["h"]) == (270, 480)
        assert frame["fl_x"] == pytest.approx(f * 270 / w) and frame["fl_y"] == pytest.approx(f * 480 / h)
        assert (frame["cx"], frame["cy"]) == (pytest.approx(cx * 270 / w), pytest.approx(cy * 480 / h))
        with Image.open(data / frame["file_path"]) as im:
            assert im.size == (270, 480) and im.mode == "RGB"
    scene = read_transforms_scene(data)  # our trainer's reader takes it as it is
    assert len(scene.views) == 12 and len(scene.points) == 500
    for view in scene.views:
        np.testing.assert_allclose(view.viewmat, poses[Path(view.name).stem + ".JPG"], atol=1e-9)


def test_dataset_points_subsampled_and_jittered(lund, tmp_path):
    source, (_, _, points, colors) = lund
    # lund_door's model repeats some points (418 of 11,384): a subsample drawn without replacement
    # holds each (position, colour) at most as often as the model does
    source_rows = Counter(zip(map(tuple, points.astype(np.float32)), map(tuple, colors)))
    xyz, rgb = _ply(bench.make_dataset(source, tmp_path, 500, seed=3) / "points.ply")
    drawn = Counter(zip(map(tuple, xyz), map(tuple, rgb)))
    assert len(xyz) == 500 and all(source_rows[row] >= k for row, k in drawn.items())
    again, _ = _ply(bench.make_dataset(source, tmp_path / "again", 500, seed=3) / "points.ply")
    np.testing.assert_array_equal(xyz, again)  # the seed fixes the cloud

    size = len(points) + 4000
    xyz, rgb = _ply(bench.make_dataset(source, tmp_path, size) / "points.ply")
    assert len(xyz) == size
    np.testing.assert_array_equal(xyz[: len(points)], points.astype(np.float32))
    np.testing.assert_array_equal(rgb[: len(points)], colors)
    spacing = np.median(cKDTree(points).query(points, k=2)[0][:, 1])
    dist, _ = cKDTree(points).query(xyz[len(points):])
    assert np.all(dist < 8 * spacing) and np.median(dist) > 0.2 * spacing  # moved, but near the surface
    assert len(np.unique(xyz[len(points):], axis=0)) == 4000
