"""Images: downscale cache, read-only fallback, undistortion, RGBA, 16-bit PNG, background prefetch."""
from __future__ import annotations

import json
import shutil
import struct
import threading
import time
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from train.camera import Camera
from train.data import DataConfig, ImageError, ImagePrefetcher, load_scene
from train.data.images import encode_image, read_image


def _copy_vesta(shared_data, dst):
    shutil.copytree(shared_data / "vesta_colmap_bin", dst)
    for d in (dst, dst / "images", dst / "sparse"):  # the shared data is read-only; the copy must not be
        d.chmod(0o755)
    return dst


def _write_transforms(folder, frames, **meta):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "transforms.json").write_text(json.dumps({**meta, "frames": frames}))


def _frame(path, c2w=np.eye(4)):
    return {"file_path": path, "transform_matrix": np.asarray(c2w).tolist()}


def test_downscale_is_cached_next_to_the_images(shared_data, tmp_path):
    data = _copy_vesta(shared_data, tmp_path / "vesta")
    scene = load_scene(data, DataConfig(data_factor=4))
    cam = scene.train_cameras[0]
    assert (cam.width, cam.height) == (256, 256)
    cached = data / "images_4" / cam.name
    assert cam.extra["image"].cache == cached and not cached.exists()
    rgb = scene.load_image(cam)
    assert cached.is_file() and Image.open(cached).size == (256, 256)
    # Against an independent downscale of the original (Pillow's box filter).
    original = Image.open(data / "images" / cam.name).convert("RGB")
    reference = np.asarray(original.resize((256, 256), Image.BOX), dtype=np.float32) / 255
    assert np.abs(rgb.numpy() - reference).mean() < 0.01
    # Once cached, the original is no longer read.
    (data / "images" / cam.name).unlink()
    torch.testing.assert_close(load_scene(data, DataConfig(data_factor=4, check_images=False)).load_image(cam), rgb)


def test_read_only_dataset_caches_under_home(shared_data, tmp_path, monkeypatch):
    data = _copy_vesta(shared_data, tmp_path / "vesta")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    data.chmod(0o555)
    try:
        scene = load_scene(data, DataConfig(data_factor=8))
        cam = scene.test_cameras[0]
        scene.load_image(cam)
        cache = cam.extra["image"].cache
        assert cache.is_file() and (tmp_path / "home" / ".cache" / "octosplat") in cache.parents
        assert sorted(p.name for p in data.iterdir()) == ["images", "sparse"]
    finally:
        data.chmod(0o755)


def _blob_image(width, height, centres, sigma=1.5):  # [H, W] uint8, Gaussian spots at pixel positions
    v, u = np.mgrid[0:height, 0:width] + 0.5
    img = sum(np.exp(-((u - x) ** 2 + (v - y) ** 2) / (2 * sigma**2)) for x, y in centres)
    return np.round(np.clip(img, 0, 1) * 255).astype(np.uint8)


def test_undistortion_moves_every_pixel_where_the_lens_model_says(tmp_path):
    """Spots drawn where the distorted lens sees known rays end up at the pinhole projections of those rays."""
    k1, k2, p1, p2 = -0.15, 0.03, 0.002, -0.003
    fx, fy, cx, cy, w, h = 100.0, 104.0, 81.0, 59.0, 160, 120
    x, y = (a.ravel() for a in np.meshgrid(np.linspace(-0.6, 0.6, 5), np.linspace(-0.4, 0.4, 4)))
    r2 = x * x + y * y
    radial = 1 + k1 * r2 + k2 * r2 * r2
    xd = x * radial + 2 * p1 * x * y + p2 * (r2 + 2 * x * x)
    yd = y * radial + p1 * (r2 + 2 * y * y) + 2 * p2 * x * y
    Image.fromarray(_blob_image(w, h, np.stack([fx * xd + cx, fy * yd + cy], 1))).save(tmp_path / "a.png")
    _write_transforms(tmp_path, [_frame("a.png")], fl_x=fx, fl_y=fy, cx=cx, cy=cy, w=w, h=h, k1=k1, k2=k2,
                      p1=p1, p2=p2)
    scene = load_scene(tmp_path, DataConfig(normalize=False, test_every=0, cache_dir=tmp_path / "cache"))
    cam = scene.train_cameras[0]
    assert (cam.width, cam.height) != (w, h)  # the undistorted image has its own size
    img = scene.load_image(cam)[..., 0].numpy().astype(np.float64)
    expected = np.stack([cam.K[0, 0] * x + cam.K[0, 2], cam.K[1, 1] * y + cam.K[1, 2]], 1)
    v, u = np.mgrid[0:cam.height, 0:cam.width] + 0.5
    for ex, ey in expected:
        win = (np.abs(u - ex) < 5) & (np.abs(v - ey) < 5)
        weight = img * win
        centroid = np.array([(weight * u).sum(), (weight * v).sum()]) / weight.sum()
        assert np.linalg.norm(centroid - [ex, ey]) < 0.2


def test_rgba_is_composited_and_alpha_kept(tmp_path):
    rng = np.random.default_rng(1)
    rgba = rng.integers(0, 256, (12, 16, 4), dtype=np.uint8)
    Image.fromarray(rgba, "RGBA").save(tmp_path / "a.png")
    _write_transforms(tmp_path, [_frame("a.png")], fl_x=20.0, w=16, h=12)
    bg = (0.2, 0.4, 1.0)
    scene = load_scene(tmp_path, DataConfig(normalize=False, test_every=0, background=bg))
    rgb, alpha = scene.load_rgba(scene.train_cameras[0])
    a = rgba[..., 3:] / 255.0
    np.testing.assert_allclose(alpha.numpy(), a, atol=1e-6)
    np.testing.assert_allclose(rgb.numpy(), rgba[..., :3] / 255.0 * a + np.array(bg) * (1 - a), atol=1e-6)


def test_sixteen_bit_png_keeps_its_precision(tmp_path):
    open3d = pytest.importorskip("open3d")
    v, u = np.mgrid[0:40, 0:60]
    img = np.stack([u * 1000 + v, v * 1500 + 7, (u * v * 37) % 65536], -1).astype(np.uint16)
    # libpng (in open3d) chooses its own scanline filters, so every filter type gets decoded.
    open3d.io.write_image(str(tmp_path / "a.png"), open3d.geometry.Image(img))
    np.testing.assert_array_equal(read_image(tmp_path / "a.png"), img)
    _write_transforms(tmp_path, [_frame("a.png")], fl_x=50.0)
    scene = load_scene(tmp_path, DataConfig(normalize=False, test_every=0))
    np.testing.assert_allclose(scene.load_image(scene.train_cameras[0]).numpy(), img / 65535.0, atol=1e-7)
    half = load_scene(tmp_path, DataConfig(normalize=False, test_every=0, data_factor=2))
    cam = half.train_cameras[0]
    half.load_image(cam)
    cached = read_image(cam.extra["image"].cache)
    assert cached.dtype == np.uint16 and cached.shape == (20, 30, 3)
    # A smooth ramp downscales to the mean of each 2x2 block (to the filter's rounding).
    block_mean = img[:, :, :2].astype(np.float64).reshape(20, 2, 30, 2, 2).mean(axis=(1, 3))
    np.testing.assert_allclose(cached[1:-1, 1:-1, :2], block_mean[1:-1, 1:-1], atol=1.0)


def _png16(image: np.ndarray, sub_filter: bool) -> bytes:  # [H, W, C] uint16 -> PNG bytes
    """A 16-bit PNG written by hand from the format's definition: an independent encoder."""
    height, width, channels = image.shape
    rows = image.astype(">u2").reshape(height, -1).view(np.uint8).astype(np.int32)
    if sub_filter:  # filter 1: each byte minus the byte one pixel to its left
        bpp = 2 * channels
        rows = np.concatenate([rows[:, :bpp], (rows[:, bpp:] - rows[:, :-bpp]) & 0xFF], axis=1)
    raw = np.concatenate([np.full((height, 1), int(sub_filter)), rows], axis=1).astype(np.uint8)

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ctype = {1: 0, 2: 4, 3: 2, 4: 6}[channels]
    header = struct.pack(">IIBBBBB", width, height, 16, ctype, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw.tobytes()))
            + chunk(b"IEND", b""))


@pytest.mark.parametrize("channels", [1, 2, 3, 4], ids=["grey", "grey-alpha", "rgb", "rgba"])
@pytest.mark.parametrize("sub_filter", [False, True], ids=["none", "sub"])
def test_sixteen_bit_png_every_colour_type(tmp_path, channels, sub_filter):
    rng = np.random.default_rng(channels)
    img = rng.integers(0, 65536, (9, 13, channels), dtype=np.uint16)
    (tmp_path / "a.png").write_bytes(_png16(img, sub_filter))
    got = read_image(tmp_path / "a.png")
    colour = img[..., :1].repeat(3, axis=2) if channels <= 2 else img[..., :3]  # grey is spread over RGB
    want = np.concatenate([colour, img[..., 3:]] if channels == 4 else [colour, img[..., 1:]] if channels == 2
                          else [colour], axis=2)
    assert got.dtype == np.uint16
    np.testing.assert_array_equal(got, want)
    # and what we write back (the downscale cache) reads as the same values
    (tmp_path / "b.png").write_bytes(encode_image(got))
    np.testing.assert_array_equal(read_image(tmp_path / "b.png"), want)


def test_corrupt_sixteen_bit_png_is_an_image_error(tmp_path):
    noise = np.random.default_rng(0).integers(0, 65536, (16, 16, 3), dtype=np.uint16)
    data = _png16(noise, False)
    (tmp_path / "a.png").write_bytes(data[: len(data) // 2])  # header intact, pixels cut off
    with pytest.raises(ImageError, match="a.png"):
        read_image(tmp_path / "a.png")


class _RecordingLoader:
    """Hands out tiny images, counting how far the prefetcher runs ahead of its consumer."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.lock = threading.Lock()
        self.loaded = self.consumed = self.max_ahead = 0
        self.fail_at = fail_at

    def load_rgba(self, camera):
        time.sleep(0.002)
        if camera.image_id == self.fail_at:
            raise ImageError(camera.name, "unreadable")
        with self.lock:
            self.loaded += 1
            self.max_ahead = max(self.max_ahead, self.loaded - self.consumed)
        return torch.full((2, 2, 3), float(camera.image_id)), None


def _cameras(n):
    K = np.array([[10.0, 0, 5], [0, 10.0, 5], [0, 0, 1]])
    return [Camera(np.eye(4), K, 10, 10, image_id=i, name=f"c{i}") for i in range(n)]


def test_prefetcher_keeps_order_and_bounds_memory():
    loader = _RecordingLoader()
    seen = []
    with ImagePrefetcher(loader, _cameras(40), depth=3) as images:
        for sample in images:
            seen.append((sample.camera.image_id, int(sample.rgb[0, 0, 0])))
            with loader.lock:
                loader.consumed += 1
    assert seen == [(i, i) for i in range(40)]
    assert loader.max_ahead <= 3 + 1  # the queue plus the sample the consumer holds


def test_prefetcher_raises_a_failed_load_at_its_turn():
    images = ImagePrefetcher(_RecordingLoader(fail_at=5), _cameras(20), depth=4)
    got = []
    with pytest.raises(ImageError, match="c5"):
        for sample in images:
            got.append(sample.camera.image_id)
    assert got == [0, 1, 2, 3, 4]


def test_prefetcher_yields_what_the_loader_loads(shared_data):
    scene = load_scene(shared_data / "vesta_colmap_bin")
    with scene.prefetcher(scene.cameras, depth=2) as images:
        for sample in images:
            torch.testing.assert_close(sample.rgb, scene.load_image(sample.camera))
            assert sample.alpha is not None and sample.alpha.shape == (1024, 1024, 1)


def test_decoded_images_stay_in_memory_within_their_budget(shared_data, tmp_path):
    data = _copy_vesta(shared_data, tmp_path / "vesta")
    one_image = 128 * 128 * 4  # data_factor 8: 128x128 RGBA, 8 bits
    scene = load_scene(data, DataConfig(data_factor=8, image_memory_mb=1.5 * one_image / 2**20))
    a, b = scene.train_cameras[:2]
    first = scene.load_image(a)
    reference = load_scene(data, DataConfig(data_factor=8, image_memory_mb=0)).load_image(a)  # decoded afresh
    first.fill_(0.5)  # what a caller does to its tensor must not reach the kept pixels
    for gone in (data / "images" / a.name, data / "images_8" / a.name):
        gone.unlink()
    # From memory: neither the original nor its cached copy is read.
    torch.testing.assert_close(scene.load_image(a), reference, rtol=0, atol=0)
    # The budget holds one image: loading b drops a, which then has no file left to come from.
    scene.load_image(b)
    with pytest.raises(ImageError, match=a.name):
        scene.load_image(a)
    torch.testing.assert_close(scene.load_image(b), load_scene(data, DataConfig(data_factor=8, check_images=False)).load_image(b))


def test_no_image_memory_reads_the_file_every_time(shared_data, tmp_path):
    data = _copy_vesta(shared_data, tmp_path / "vesta")
    scene = load_scene(data, DataConfig(data_factor=8, image_memory_mb=0))
    cam = scene.train_cameras[0]
    scene.load_image(cam)
    (data / "images" / cam.name).unlink()
    (data / "images_8" / cam.name).unlink()
    with pytest.raises(ImageError, match=cam.name):
        scene.load_image(cam)


@pytest.mark.parametrize("mb", [-1.0, float("nan"), float("inf")])
def test_image_memory_must_be_a_finite_size(mb):
    with pytest.raises(ValueError, match="image_memory_mb"):
        DataConfig(image_memory_mb=mb)
