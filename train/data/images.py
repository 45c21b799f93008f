"""Images on disk: decoding (8- and 16-bit, JPG and PNG, grey/RGB/RGBA), the downscale + undistort step,
its on-disk cache, and the loader that turns a camera into a float image.

RGBA images are composited on the configured background, and their alpha is also returned as a mask.
Resampling is done on premultiplied colour, so transparent pixels do not bleed into their neighbours.
"""
from __future__ import annotations

import hashlib
import io
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import imagecodecs
import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, UnidentifiedImageError

from train.camera import Camera
from train.data.errors import ImageError
from train.data.fileio import atomic_write, read_bytes
from train.data.intrinsics import Intrinsics, undistort_map

_GREY16 = ("I;16", "I;16B", "I;16L", "I")
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@dataclass(frozen=True)
class ImageSource:
    """Where a camera's image comes from; kept in `Camera.extra["image"]`.

    path: the image in the input's image folder, as the input's intrinsics describe it.
    source: those intrinsics (with distortion), at the size of `path`.
    target: the pinhole camera at full size after undistortion (== source when not distorted).
    cache: the downscaled / undistorted copy (made on first use); None when `path` is used as it is.
    """

    path: Path
    source: Intrinsics
    target: Intrinsics
    cache: Path | None = None


def image_size(path: Path) -> tuple[int, int]:
    """(width, height) from the file's header, without decoding pixels."""
    try:
        with Image.open(path) as im:
            return im.size
    except FileNotFoundError:
        raise ImageError(path, "image file is missing") from None
    except (UnidentifiedImageError, OSError) as e:
        raise ImageError(path, f"not a readable image ({e})") from None


def png_bit_depth(header: bytes) -> int | None:
    """The bit depth in a PNG's first 26 bytes, or None if they are not a PNG header."""
    if len(header) < 26 or not header.startswith(_PNG_SIGNATURE) or header[12:16] != b"IHDR":
        return None
    return header[24]


def _read_png16(path: Path, data: bytes) -> np.ndarray:  # -> [H, W, C] uint16
    # Pillow reads 16-bit colour PNGs only as 8-bit; libpng (through imagecodecs) keeps every bit.
    try:
        image = imagecodecs.png_decode(data)
    except imagecodecs.PngError as e:
        raise ImageError(path, f"corrupt PNG ({e})") from None
    return image[..., None] if image.ndim == 2 else image


def read_image(path: Path) -> np.ndarray:  # -> [H, W, 3 or 4] uint8 or uint16
    data = read_bytes(path, ImageError)
    if png_bit_depth(data[:26]) == 16:
        image = _read_png16(path, data)
    else:
        try:
            with Image.open(io.BytesIO(data)) as im:
                image = _pil_to_array(im)
        except (UnidentifiedImageError, OSError, ValueError) as e:
            raise ImageError(path, f"not a readable image ({e})") from None
    if image.shape[2] in (1, 2):  # grey, grey + alpha
        image = np.concatenate([image[..., :1].repeat(3, axis=2), image[..., 1:]], axis=2)
    return image


def _pil_to_array(im: Image.Image) -> np.ndarray:  # [H, W, C]
    if im.mode in _GREY16:
        return np.asarray(im).astype(np.uint16)[..., None]
    has_alpha = im.mode in ("RGBA", "LA", "PA") or "transparency" in im.info
    return np.asarray(im.convert("RGBA" if has_alpha else "RGB"))


def encode_image(image: np.ndarray) -> bytes:  # [H, W, C] uint8 or uint16 -> PNG
    if image.dtype == np.uint16:
        return imagecodecs.png_encode(image, level=1)
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def to_float(image: np.ndarray) -> torch.Tensor:  # [H, W, C] integer -> [H, W, C] float32 in [0, 1]
    return torch.from_numpy(image.astype(np.float32) / np.iinfo(image.dtype).max)


def to_integer(image: torch.Tensor, dtype: np.dtype) -> np.ndarray:  # [H, W, C] in [0, 1] -> [H, W, C] dtype
    top = np.iinfo(dtype).max
    return (image.clamp(0.0, 1.0) * top).round().numpy().astype(dtype)


def resample(image: torch.Tensor, src: ImageSource, width: int, height: int) -> torch.Tensor:
    """Undistort (if the source is distorted) and resize to width x height: [H, W, C] -> [height, width, C]."""
    x = image.permute(2, 0, 1)[None]  # [1, C, H, W]
    alpha = x[:, 3:]
    if alpha.shape[1]:
        x = torch.cat([x[:, :3] * alpha, alpha], dim=1)
    if src.source.distorted:
        grid = torch.from_numpy(undistort_map(src.source, src.target))
        # grid_sample's coordinates: -1 and 1 are the outer edges of the border pixels.
        grid = grid / torch.tensor([src.source.width, src.source.height]) * 2.0 - 1.0
        x = F.grid_sample(x, grid[None], mode="bilinear", padding_mode="border", align_corners=False)
    if x.shape[-2:] != (height, width):
        x = F.interpolate(x, size=(height, width), mode="bilinear", antialias=True, align_corners=False)
    if alpha.shape[1]:
        a = x[:, 3:]
        x = torch.cat([torch.where(a > 0, x[:, :3] / a.clamp_min(1e-12), 0.0), a], dim=1)
    return x[0].permute(1, 2, 0).contiguous()


def _writable(folder: Path) -> bool:
    # Root may write anywhere; a folder with no write bit at all is still meant to be read-only.
    try:
        return os.access(folder, os.W_OK) and bool(folder.stat().st_mode & 0o222)
    except OSError:
        return False


def cache_folder(image_root: Path, factor: int, undistorted: bool, cache_dir: Path | None) -> Path:
    """Where processed copies of the images in `image_root` go (`images_4/`, `images_undistorted_1/`)."""
    name = f"{image_root.name}_undistorted_{factor}" if undistorted else f"{image_root.name}_{factor}"
    if cache_dir is None and _writable(image_root.parent):
        return image_root.parent / name
    base = Path(cache_dir) if cache_dir is not None else Path.home() / ".cache" / "octosplat"
    key = hashlib.sha1(str(image_root.resolve()).encode()).hexdigest()[:12]
    return base / f"{image_root.parent.name}-{key}" / name


def check_size(path: Path, size: tuple[int, int], expected: tuple[int, int], what: str) -> None:
    if tuple(size) != tuple(expected):
        raise ImageError(path, f"image is {size[0]}x{size[1]} but {what} says {expected[0]}x{expected[1]}")


class ImageLoader:
    """Loads a camera's image on demand: no image is read before it is asked for.

    The first load of a downscaled or undistorted image makes its cached copy; later loads read that.
    Decoded pixels (integers, as in the file) are kept in memory up to `memory_bytes`, the least
    recently used dropped first: training asks for every image once an epoch, and decoding a PNG
    again each time cost as much CPU as a tenth of a CPU training step. Safe to call from the
    prefetcher's threads.
    """

    def __init__(self, background: tuple[float, float, float] = (0.0, 0.0, 0.0), memory_bytes: int = 0) -> None:
        self.background = torch.tensor(background, dtype=torch.float32)
        self._memory = _PixelMemory(memory_bytes)

    def load_rgba(self, camera: Camera) -> tuple[torch.Tensor, torch.Tensor | None]:
        """rgb [H, W, 3] float32 in [0, 1] (composited on the background) and alpha [H, W, 1] or None."""
        image = to_float(self._pixels(camera))
        if image.shape[2] == 3:
            return image, None
        alpha = image[..., 3:]
        return image[..., :3] * alpha + self.background * (1.0 - alpha), alpha

    def load_image(self, camera: Camera) -> torch.Tensor:  # [H, W, 3] float32 in [0, 1]
        return self.load_rgba(camera)[0]

    def _pixels(self, camera: Camera) -> np.ndarray:  # [H, W, C] integer, at the camera's size, read-only
        src: ImageSource = camera.extra["image"]
        key = (src.path, src.cache, camera.width, camera.height)
        image = self._memory.get(key)
        if image is None:
            image = self._decode(camera, src)
            image.flags.writeable = False  # shared by every later load of this camera
            self._memory.put(key, image)
        return image

    def _decode(self, camera: Camera, src: ImageSource) -> np.ndarray:
        size = (camera.width, camera.height)
        if src.cache is not None and src.cache.is_file():
            image = read_image(src.cache)
            check_size(src.cache, image.shape[1::-1], size, f"camera {camera.name!r} (delete the cached copy?)")
            return image
        image = read_image(src.path)
        check_size(src.path, image.shape[1::-1], (src.source.width, src.source.height), f"camera {camera.name!r}")
        if src.cache is None:
            return image
        image = to_integer(resample(to_float(image), src, *size), image.dtype)
        atomic_write(src.cache, encode_image(image))
        return image


class _PixelMemory:
    """A byte-bounded LRU map of decoded images, shared by the loading threads."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[tuple, np.ndarray] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: tuple) -> np.ndarray | None:
        with self._lock:
            image = self._items.get(key)
            if image is not None:
                self._items.move_to_end(key)
            return image

    def put(self, key: tuple, image: np.ndarray) -> None:
        if image.nbytes > self.capacity:
            return
        with self._lock:
            if key in self._items:
                return
            self._items[key] = image
            self._bytes += image.nbytes
            while self._bytes > self.capacity:
                self._bytes -= self._items.popitem(last=False)[1].nbytes
