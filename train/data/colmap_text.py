"""COLMAP's text format (cameras.txt, images.txt, points3D.txt): read with line numbers in every error, and write."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from train.data.colmap import CAMERA_MODELS, ColmapCamera, ColmapImage, ColmapModel, ColmapPoints
from train.data.errors import ColmapError
from train.data.fileio import atomic_write, read_text

_DECLARED = re.compile(r"#\s*Number of (cameras|images|points):\s*(\d+)")


def read_model(files: dict[str, Path]) -> ColmapModel:
    points = read_points(files["points3D"]) if "points3D" in files else ColmapPoints.empty()
    return ColmapModel(read_cameras(files["cameras"]), read_images(files["images"]), points, dict(files))


def _lines(path: Path) -> tuple[list[str], int | None]:
    """The file's lines, and the count its COLMAP header declares (None without one)."""
    lines = read_text(path, ColmapError).splitlines()
    declared = None
    for line in lines[:8]:
        m = _DECLARED.match(line.strip())
        if m:
            declared = int(m.group(2))
    return lines, declared


def _check_count(path: Path, declared: int | None, found: int, noun: str) -> None:
    if declared is not None and declared != found:
        raise ColmapError(path, f"header declares {declared} {noun} but the file holds {found} (truncated?)")


def _parse(path: Path, lineno: int, what: str, conv, text: str):
    try:
        return conv(text)
    except (ValueError, OverflowError):  # Overflow: an integer beyond int64
        raise ColmapError(path, f"cannot parse {what} from {text!r:.80}", f"line {lineno}") from None


def _id(text: str) -> int:
    """An id, held in int64 arrays later: a larger one must fail here, naming its line."""
    value = int(text)
    if not -(2**63) <= value < 2**63:
        raise OverflowError(text)
    return value


def _floats(path: Path, lineno: int, what: str, tokens: list[str]) -> np.ndarray:
    return _parse(path, lineno, what, lambda t: np.array(t.split(), dtype=np.float64), " ".join(tokens))


def _is_data(line: str) -> bool:
    return bool(line) and not line.startswith("#")


def read_cameras(path: Path) -> dict[int, ColmapCamera]:
    lines, declared = _lines(path)
    cameras: dict[int, ColmapCamera] = {}
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not _is_data(line):
            continue
        tok = line.split()
        if len(tok) < 4:
            raise ColmapError(path, f"expected CAMERA_ID MODEL WIDTH HEIGHT PARAMS..., got {line!r}", f"line {n}")
        cid = _parse(path, n, "camera id", _id, tok[0])
        if tok[1] not in CAMERA_MODELS:
            raise ColmapError(path, f"unknown camera model {tok[1]!r}", f"line {n}")
        nparams = CAMERA_MODELS[tok[1]][1]
        if len(tok) != 4 + nparams:
            raise ColmapError(path, f"model {tok[1]} takes {nparams} parameters, got {len(tok) - 4}", f"line {n}")
        if cid in cameras:
            raise ColmapError(path, f"camera id {cid} appears twice (also {cameras[cid].origin})", f"line {n}")
        width = _parse(path, n, "width", int, tok[2])
        height = _parse(path, n, "height", int, tok[3])
        params = _floats(path, n, "parameters", tok[4:])
        cameras[cid] = ColmapCamera(cid, tok[1], width, height, params, f"line {n}")
    _check_count(path, declared, len(cameras), "cameras")
    return cameras


def read_images(path: Path) -> dict[int, ColmapImage]:
    # Two lines per image; the second (observations) may be empty, so blank lines are data here.
    lines, declared = _lines(path)
    images: dict[int, ColmapImage] = {}
    n = 0
    while n < len(lines):
        line = lines[n].strip()
        n += 1
        if not _is_data(line):
            continue
        tok = line.split(maxsplit=9)
        if len(tok) < 10:
            raise ColmapError(path, "expected IMAGE_ID QW QX QY QZ TX TY TZ CAMERA_ID NAME, got "
                              f"{line!r}", f"line {n}")
        iid = _parse(path, n, "image id", _id, tok[0])
        pose = _floats(path, n, "pose", tok[1:8])
        cid = _parse(path, n, "camera id", _id, tok[8])
        if n >= len(lines):
            raise ColmapError(path, f"image {iid} has no POINTS2D line (truncated?)", f"line {n}")
        obs = _floats(path, n + 1, "POINTS2D", [lines[n]])
        if len(obs) % 3:
            raise ColmapError(path, f"POINTS2D holds {len(obs)} numbers, not triples (X, Y, POINT3D_ID)",
                              f"line {n + 1}")
        obs = obs.reshape(-1, 3)
        if iid in images:
            raise ColmapError(path, f"image id {iid} appears twice (also {images[iid].origin})", f"line {n}")
        images[iid] = ColmapImage(iid, pose[:4], pose[4:], cid, tok[9], obs[:, :2].copy(),
                                  obs[:, 2].astype(np.int64), f"line {n}")
        n += 1
    _check_count(path, declared, len(images), "images")
    return images


def read_points(path: Path) -> ColmapPoints:
    lines, declared = _lines(path)
    ids, xyz, rgb, err, lengths, tracks = [], [], [], [], [], []
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not _is_data(line):
            continue
        tok = line.split()
        if len(tok) < 8 or (len(tok) - 8) % 2:
            raise ColmapError(path, "expected POINT3D_ID X Y Z R G B ERROR and (IMAGE_ID, POINT2D_IDX) pairs, "
                              f"got {len(tok)} fields", f"line {n}")
        ids.append(_parse(path, n, "point id", _id, tok[0]))
        values = _floats(path, n, "point", tok[1:8])
        colour = values[3:6]
        if not ((colour >= 0) & (colour <= 255) & (colour == np.round(colour))).all():
            raise ColmapError(path, f"colour {tok[4:7]} is not three integers in 0..255", f"line {n}")
        xyz.append(values[:3])
        rgb.append(colour)
        err.append(values[6])
        track = _parse(path, n, "track", lambda t: np.array(t.split(), dtype=np.int64), " ".join(tok[8:]))
        if ((track < -(2**31)) | (track >= 2**31)).any():  # stored as int32: it would wrap onto another image
            raise ColmapError(path, "track holds a value beyond int32", f"line {n}")
        lengths.append(len(track) // 2)
        tracks.append(track)
    _check_count(path, declared, len(ids), "points")
    if not ids:
        return ColmapPoints.empty()
    track = np.concatenate(tracks).reshape(-1, 2)
    return ColmapPoints(
        np.array(ids, np.int64), np.array(xyz), np.array(rgb).astype(np.uint8), np.array(err),
        np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        track[:, 0].astype(np.int32), track[:, 1].astype(np.int32),
    )


def write_model(model: ColmapModel, folder: str | Path) -> None:
    """Write `model` as cameras.txt, images.txt and points3D.txt; floats keep every bit (repr)."""
    folder = Path(folder)
    cams = [f"{c.camera_id} {c.model} {c.width} {c.height} " + " ".join(map(repr, c.params.tolist()))
            for c in model.cameras.values()]
    atomic_write(folder / "cameras.txt", _text(f"# Number of cameras: {len(cams)}", cams))
    imgs = []
    for im in model.images.values():
        pose = " ".join(map(repr, im.qvec.tolist() + im.tvec.tolist()))
        imgs.append(f"{im.image_id} {pose} {im.camera_id} {im.name}")
        imgs.append(" ".join(f"{x!r} {y!r} {p}" for (x, y), p in zip(im.xys.tolist(), im.point3d_ids.tolist())))
    atomic_write(folder / "images.txt", _text(f"# Number of images: {len(model.images)}", imgs))
    pts = model.points
    rows = []
    for i in range(len(pts)):
        image_ids, idx = pts.track(i)
        track = " ".join(f"{a} {b}" for a, b in zip(image_ids.tolist(), idx.tolist()))
        xyz = " ".join(map(repr, pts.xyz[i].tolist()))
        rows.append(f"{pts.ids[i]} {xyz} {' '.join(map(str, pts.rgb[i].tolist()))} {float(pts.error[i])!r} {track}".rstrip())
    atomic_write(folder / "points3D.txt", _text(f"# Number of points: {len(rows)}", rows))


def _text(header: str, rows: list[str]) -> bytes:
    return ("\n".join([header, *rows]) + "\n").encode("utf-8")
