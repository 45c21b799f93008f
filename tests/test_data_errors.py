"""Every bad-input path: one clear DatasetError naming the file (and line or record), and a CLI that says
`error: ...` and exits 1 without a traceback."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from train.data import (ColmapError, DataConfig, DatasetError, ImageError, TransformsError, load_scene, read_colmap,
                        write_colmap_binary)
from train.data.__main__ import main

CAMERAS = "# Number of cameras: 1\n1 PINHOLE 8 6 10 10 4 3\n"
IMAGES = "# Number of images: 2\n1 1 0 0 0 0 0 0 1 a.png\n4 3 7\n2 1 0 0 0 -1 0 0 1 b.png\n2 3 7\n"
POINTS = "# Number of points: 1\n7 0 0 5 255 0 0 0.5 1 0 2 0\n"


def _colmap(root: Path, cameras=CAMERAS, images=IMAGES, points=POINTS) -> Path:
    (root / "sparse").mkdir(parents=True)
    (root / "images").mkdir()
    for name, text in (("cameras", cameras), ("images", images), ("points3D", points)):
        (root / "sparse" / f"{name}.txt").write_text(text)
    for name in ("a.png", "b.png"):
        Image.new("RGB", (8, 6), (9, 9, 9)).save(root / "images" / name)
    return root


def _binary(root: Path, mutate=lambda model: model) -> Path:
    """The valid model converted to binary, with `mutate` applied to the model first."""
    _colmap(root)
    model = mutate(read_colmap(root))
    for f in (root / "sparse").iterdir():
        f.unlink()
    write_colmap_binary(model, root / "sparse")
    return root


def _rewrite(root: Path, name: str, change) -> Path:
    """Replace the bytes of sparse/<name> by change(bytes)."""
    path = root / "sparse" / name
    path.write_bytes(change(path.read_bytes()))
    return root


def _transforms(root: Path, text: str, images=("a.png",)) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name in images:
        Image.new("RGB", (8, 6)).save(root / name)
    (root / "transforms.json").write_text(text)
    return root


def _frames(**frame_fields):
    frame = {"file_path": "a.png", "transform_matrix": np.eye(4).tolist(), **frame_fields}
    return json.dumps({"fl_x": 10.0, "frames": [frame]})


def _set_pose(value):
    def mutate(model):
        img = model.images[1]
        images = dict(model.images)
        images[1] = replace(img, tvec=np.array([value, 0.0, 0.0]))
        return replace(model, images=images)
    return mutate


def _bad_image(root: Path, write) -> Path:
    _colmap(root)
    write(root / "images" / "b.png")
    return root


# name -> (build the broken dataset in a folder, error type, substrings the message must hold)
CASES = {
    "cameras_header_count": (lambda r: _colmap(r, cameras="# Number of cameras: 2\n1 PINHOLE 8 6 10 10 4 3\n"),
                             ColmapError, ["cameras.txt", "declares 2 cameras", "holds 1"]),
    "cameras_param_count": (lambda r: _colmap(r, cameras="1 PINHOLE 8 6 10 10 4\n"),
                            ColmapError, ["cameras.txt", "line 1", "takes 4 parameters, got 3"]),
    "cameras_unknown_model": (lambda r: _colmap(r, cameras="1 FANCY 8 6 10 10 4 3\n"),
                              ColmapError, ["cameras.txt", "line 1", "unknown camera model 'FANCY'"]),
    "cameras_not_a_number": (lambda r: _colmap(r, cameras="1 PINHOLE 8 six 10 10 4 3\n"),
                             ColmapError, ["cameras.txt", "line 1", "height", "'six'"]),
    "focal_not_positive": (lambda r: _colmap(r, cameras="1 PINHOLE 8 6 0 10 4 3\n"),
                           ColmapError, ["cameras.txt", "line 1", "camera 1", "focal length [0.0, 10.0]"]),
    "camera_unused": (lambda r: _colmap(r, cameras="1 PINHOLE 8 6 10 10 4 3\n2 PINHOLE 8 6 10 10 4 3\n"),
                      ColmapError, ["cameras.txt", "line 2", "camera 2 is used by no image"]),
    "unsupported_model": (lambda r: _colmap(r, cameras="1 OPENCV_FISHEYE 8 6 10 10 4 3 0 0 0 0\n"),
                          ColmapError, ["cameras.txt", "line 1", "OPENCV_FISHEYE is not supported"]),
    "images_truncated_line": (lambda r: _colmap(r, images=IMAGES[: IMAGES.index("-1") - 3]),
                              ColmapError, ["images.txt", "line 4", "expected IMAGE_ID"]),
    "images_truncated_no_points_line": (lambda r: _colmap(r, images=IMAGES.rsplit("\n", 2)[0] + "\n"),
                                        ColmapError, ["images.txt", "line 4", "no POINTS2D line"]),
    "images_points_not_triples": (lambda r: _colmap(r, images=IMAGES.replace("4 3 7", "4 3 7 5")),
                                  ColmapError, ["images.txt", "line 3", "not triples"]),
    "image_names_missing_camera": (lambda r: _colmap(r, images=IMAGES.replace("0 0 1 b.png", "0 0 9 b.png")),
                                   ColmapError, ["images.txt", "line 4", "'b.png'", "names camera 9"]),
    "pose_nan": (lambda r: _colmap(r, images=IMAGES.replace("1 1 0 0 0 0 0 0", "1 nan 0 0 0 0 0 0")),
                 ColmapError, ["images.txt", "line 2", "'a.png'", "non-finite pose"]),
    "pose_infinite": (lambda r: _colmap(r, images=IMAGES.replace("0 -1 0 0", "0 inf 0 0")),
                      ColmapError, ["images.txt", "line 4", "non-finite pose"]),
    "images_not_text": (lambda r: _rewrite(_colmap(r), "images.txt", lambda b: b"\x00\xff\xfe garbage"),
                        ColmapError, ["images.txt", "not UTF-8"]),
    "observes_missing_point": (lambda r: _colmap(r, images=IMAGES.replace("4 3 7", "4 3 8")),
                               ColmapError, ["images.txt", "line 2", "observes point 8"]),
    "points_truncated_track": (lambda r: _colmap(r, points=POINTS[:-3] + "\n"),
                               ColmapError, ["points3D.txt", "line 2", "pairs"]),
    "points_track_missing_image": (lambda r: _colmap(r, points=POINTS.replace("1 0 2 0", "1 0 3 0")),
                                   ColmapError, ["points3D.txt", "point 7", "track names image 3"]),
    "points_track_wrong_index": (lambda r: _colmap(r, points=POINTS.replace("1 0 2 0", "1 0 2 5")),
                                 ColmapError, ["points3D.txt", "point 7", "(image 2, index 5)"]),
    "points_bad_colour": (lambda r: _colmap(r, points=POINTS.replace("255 0 0", "256 0 0")),
                          ColmapError, ["points3D.txt", "line 2", "colour"]),
    "bin_cameras_truncated": (lambda r: _rewrite(_binary(r), "cameras.bin", lambda b: b[:50]),
                              ColmapError, ["cameras.bin", "record 0", "truncated"]),
    "bin_images_truncated": (lambda r: _rewrite(_binary(r), "images.bin", lambda b: b[:160]),
                             ColmapError, ["images.bin", "record 1", "truncated"]),
    "bin_images_count_too_large": (lambda r: _rewrite(_binary(r), "images.bin", lambda b: b[:100]),
                                   ColmapError, ["images.bin", "declares 2 images", "truncated or corrupt"]),
    "bin_points_corrupt_count": (lambda r: _rewrite(_binary(r), "points3D.bin", lambda b: b"\xff" * 8 + b[8:]),
                                 ColmapError, ["points3D.bin", "declares", "points"]),
    "bin_unknown_model_id": (lambda r: _rewrite(_binary(r), "cameras.bin", lambda b: b[:12] + b"\x63" + b[13:]),
                             ColmapError, ["cameras.bin", "record 0", "unknown camera model id 99"]),
    "bin_trailing_bytes": (lambda r: _rewrite(_binary(r), "cameras.bin", lambda b: b + b"xyz"),
                           ColmapError, ["cameras.bin", "3 unexpected bytes"]),
    "bin_pose_nan": (lambda r: _binary(r, _set_pose(np.nan)), ColmapError, ["images.bin", "record 0", "non-finite pose"]),
    "bin_pose_infinite": (lambda r: _binary(r, _set_pose(np.inf)), ColmapError, ["images.bin", "record 0", "non-finite"]),
    "image_size_mismatch": (lambda r: _bad_image(r, lambda p: Image.new("RGB", (9, 6)).save(p)),
                            ImageError, ["b.png", "9x6", "8x6"]),
    "image_unreadable": (lambda r: _bad_image(r, lambda p: p.write_bytes(b"not an image")),
                         ImageError, ["b.png", "not a readable image"]),
    "image_missing": (lambda r: _bad_image(r, lambda p: p.unlink()), ImageError, ["b.png", "missing"]),
    "image_folder_missing": (lambda r: [f.unlink() for f in (_colmap(r) / "images").iterdir()]
                             and (r / "images").rmdir() or r, ImageError, ["images", "folder is missing"]),
    "not_a_dataset": (lambda r: r.mkdir() or r, DatasetError, ["neither a COLMAP dataset"]),
    "transforms_not_json": (lambda r: _transforms(r, '{"frames": [\n\n  {oops}]}'),
                            TransformsError, ["transforms.json", "line 3", "not JSON"]),
    "transforms_no_frames": (lambda r: _transforms(r, '{"fl_x": 10}'), TransformsError, ["transforms.json", "no frames"]),
    "transforms_empty_frames": (lambda r: _transforms(r, '{"frames": []}'),
                                TransformsError, ["transforms.json", "no frames"]),
    "transforms_pose_nan": (lambda r: _transforms(r, _frames(transform_matrix=[[float("nan")] * 4] * 4)),
                            TransformsError, ["transforms.json", "frames[0] (a.png)", "NaN or infinite"]),
    "transforms_pose_scaled": (lambda r: _transforms(r, _frames(transform_matrix=(2 * np.eye(4)).tolist())),
                               TransformsError, ["transforms.json", "frames[0]", "not a rotation"]),
    "transforms_focal_negative": (lambda r: _transforms(r, _frames(fl_x=-3.0)),
                                  TransformsError, ["transforms.json", "frames[0]", "not positive"]),
    "transforms_no_focal": (lambda r: _transforms(r, json.dumps({"frames": [{"file_path": "a.png",
                                                                            "transform_matrix": np.eye(4).tolist()}]})),
                            TransformsError, ["transforms.json", "frames[0]", "no focal length"]),
    "transforms_all_images_missing": (lambda r: _transforms(r, _frames(file_path="gone.png"), images=()),
                                      TransformsError, ["transforms.json", "none of the 1 frames"]),
    "transforms_fisheye": (lambda r: _transforms(r, json.dumps({"camera_model": "OPENCV_FISHEYE", "frames": [{}]})),
                           TransformsError, ["transforms.json", "OPENCV_FISHEYE"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_gives_one_clear_error(case, tmp_path, capsys):
    build, error_type, parts = CASES[case]
    root = build(tmp_path / "data")
    with pytest.raises(error_type) as info:
        load_scene(root, DataConfig(cache_dir=tmp_path / "cache"))
    for part in parts:
        assert part in str(info.value)
    # The CLI reports the same message and exits non-zero.
    assert main([str(root), "--cache-dir", str(tmp_path / "cache")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(info.value) in err


def test_valid_corpus_base_loads(tmp_path):
    """The broken cases above differ from this valid dataset only by their one defect."""
    scene = load_scene(_colmap(tmp_path / "text"), DataConfig(cache_dir=tmp_path / "cache"))
    assert len(scene.cameras) == 2 and len(scene.points) == 1
    assert len(load_scene(_binary(tmp_path / "bin"), DataConfig(cache_dir=tmp_path / "cache")).cameras) == 2


def test_size_mismatch_also_caught_when_loading_lazily(tmp_path):
    root = _bad_image(tmp_path / "data", lambda p: Image.new("RGB", (9, 6)).save(p))
    scene = load_scene(root, DataConfig(check_images=False))
    with pytest.raises(ImageError, match="b.png.*9x6"):
        scene.load_image(scene.cameras[1])


def test_cli_process_exits_1_without_traceback(tmp_path):
    root = _colmap(tmp_path / "data", images=IMAGES.replace("0 0 1 b.png", "0 0 9 b.png"))
    proc = subprocess.run([sys.executable, "-m", "train.data", str(root)], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: ") and "names camera 9" in proc.stderr and "Traceback" not in proc.stderr
