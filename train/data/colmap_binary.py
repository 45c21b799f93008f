"""COLMAP's binary format (cameras.bin, images.bin, points3D.bin): read with bounds checks on every record, and write."""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from train.data.colmap import CAMERA_MODELS, MODEL_NAMES, ColmapCamera, ColmapImage, ColmapModel, ColmapPoints
from train.data.errors import ColmapError
from train.data.fileio import atomic_write, read_bytes

_OBSERVATION = np.dtype([("xy", "<f8", (2,)), ("id", "<i8")])
_TRACK_ENTRY = np.dtype([("image", "<i4"), ("idx", "<i4")])
_MAX_POINT_ID = 2**63 - 1  # stored as uint64, used as int64 (-1: no point) everywhere


class _Reader:
    """A cursor over a file's bytes that reports a short read as the record it happened in."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data = read_bytes(path, ColmapError)
        self.pos = 0
        self.record = "header"

    def _take(self, n: int) -> int:
        if n < 0 or self.pos + n > len(self.data):
            raise ColmapError(self.path, f"truncated: needs {n} bytes at offset {self.pos}, file has "
                              f"{len(self.data)}", self.record)
        start, self.pos = self.pos, self.pos + n
        return start

    def unpack(self, fmt: str) -> tuple:
        s = struct.Struct("<" + fmt)
        return s.unpack_from(self.data, self._take(s.size))

    def array(self, dtype: np.dtype, count: int) -> np.ndarray:
        return np.frombuffer(self.data, dtype, count, self._take(dtype.itemsize * count))

    def name(self) -> str:
        end = self.data.find(b"\0", self.pos)
        if end < 0:
            raise ColmapError(self.path, f"truncated: image name at offset {self.pos} has no terminating NUL",
                              self.record)
        raw = self.data[self._take(end - self.pos + 1): end]
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ColmapError(self.path, f"image name {raw[:40]!r} is not UTF-8", self.record) from None

    def count(self, noun: str, min_record_bytes: int) -> int:
        (n,) = self.unpack("Q")
        # A corrupt count must fail here, not in a huge allocation or a long loop.
        if n * min_record_bytes > len(self.data) - self.pos:
            raise ColmapError(self.path, f"declares {n} {noun} but only {len(self.data) - self.pos} bytes "
                              "follow (truncated or corrupt)", self.record)
        return n

    def finish(self) -> None:
        if self.pos != len(self.data):
            raise ColmapError(self.path, f"{len(self.data) - self.pos} unexpected bytes after the last record")


def read_model(files: dict[str, Path]) -> ColmapModel:
    points = read_points(files["points3D"]) if "points3D" in files else ColmapPoints.empty()
    return ColmapModel(read_cameras(files["cameras"]), read_images(files["images"]), points, dict(files))


def read_cameras(path: Path) -> dict[int, ColmapCamera]:
    r = _Reader(path)
    cameras: dict[int, ColmapCamera] = {}
    for i in range(r.count("cameras", 24)):
        r.record = f"record {i}"
        cid, model_id, width, height = r.unpack("iiQQ")
        if model_id not in MODEL_NAMES:
            raise ColmapError(path, f"unknown camera model id {model_id}", r.record)
        name = MODEL_NAMES[model_id]
        params = r.array(np.dtype("<f8"), CAMERA_MODELS[name][1]).astype(np.float64)
        if cid in cameras:
            raise ColmapError(path, f"camera id {cid} appears twice (also {cameras[cid].origin})", r.record)
        cameras[cid] = ColmapCamera(cid, name, width, height, params, r.record)
    r.finish()
    return cameras


def read_images(path: Path) -> dict[int, ColmapImage]:
    r = _Reader(path)
    images: dict[int, ColmapImage] = {}
    for i in range(r.count("images", 73)):
        r.record = f"record {i}"
        iid, *pose, cid = r.unpack("i7di")
        name = r.name()
        obs = r.array(_OBSERVATION, r.count("2D points", _OBSERVATION.itemsize))
        if iid in images:
            raise ColmapError(path, f"image id {iid} appears twice (also {images[iid].origin})", r.record)
        pose = np.array(pose)
        images[iid] = ColmapImage(iid, pose[:4], pose[4:], cid, name, obs["xy"].astype(np.float64),
                                  obs["id"].astype(np.int64), r.record)
    r.finish()
    return images


def read_points(path: Path) -> ColmapPoints:
    r = _Reader(path)
    n = r.count("points", 51)
    ids, xyz, rgb, err = np.zeros(n, np.int64), np.zeros((n, 3)), np.zeros((n, 3), np.uint8), np.zeros(n)
    offsets, tracks = np.zeros(n + 1, np.int64), []
    for i in range(n):
        r.record = f"record {i}"
        pid, *xyz[i], rgb[i, 0], rgb[i, 1], rgb[i, 2], err[i] = r.unpack("Q3d3Bd")
        if pid > _MAX_POINT_ID:
            raise ColmapError(path, f"point id {pid} is beyond the int64 point ids COLMAP's files hold", r.record)
        ids[i] = pid
        track = r.array(_TRACK_ENTRY, r.count("track entries", _TRACK_ENTRY.itemsize))
        offsets[i + 1] = offsets[i] + len(track)
        tracks.append(track)
    r.finish()
    track = np.concatenate(tracks) if tracks else np.zeros(0, _TRACK_ENTRY)
    return ColmapPoints(ids, xyz, rgb, err, offsets, track["image"].astype(np.int32), track["idx"].astype(np.int32))


def write_model(model: ColmapModel, folder: str | Path) -> None:
    """Write `model` as cameras.bin, images.bin and points3D.bin (COLMAP's little-endian layout)."""
    folder = Path(folder)
    out = [struct.pack("<Q", len(model.cameras))]
    for c in model.cameras.values():
        out.append(struct.pack("<iiQQ", c.camera_id, CAMERA_MODELS[c.model][0], c.width, c.height))
        out.append(c.params.astype("<f8").tobytes())
    atomic_write(folder / "cameras.bin", b"".join(out))
    out = [struct.pack("<Q", len(model.images))]
    for im in model.images.values():
        out.append(struct.pack("<i7di", im.image_id, *im.qvec.tolist(), *im.tvec.tolist(), im.camera_id))
        out.append(im.name.encode("utf-8") + b"\0")
        obs = np.zeros(len(im.xys), _OBSERVATION)
        obs["xy"], obs["id"] = im.xys, im.point3d_ids
        out.append(struct.pack("<Q", len(obs)) + obs.tobytes())
    atomic_write(folder / "images.bin", b"".join(out))
    pts = model.points
    out = [struct.pack("<Q", len(pts))]
    for i in range(len(pts)):
        image_ids, idx = pts.track(i)
        track = np.zeros(len(image_ids), _TRACK_ENTRY)
        track["image"], track["idx"] = image_ids, idx
        out.append(struct.pack("<Q3d3BdQ", pts.ids[i], *pts.xyz[i].tolist(), *pts.rgb[i].tolist(), pts.error[i],
                               len(track)) + track.tobytes())
    atomic_write(folder / "points3D.bin", b"".join(out))
