"""A COLMAP sparse model in memory, where to find one, and the checks that make it safe to use.

`read_colmap` reads text or binary (`colmap_text`, `colmap_binary`) and then `validate` checks the
cross references, so both formats fail alike and with the file and record named.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from train.data.errors import ColmapError
from train.data.intrinsics import image_size_problem

# COLMAP's camera models: name -> (model id, number of parameters, number of focal lengths).
CAMERA_MODELS: dict[str, tuple[int, int, int]] = {
    "SIMPLE_PINHOLE": (0, 3, 1),
    "PINHOLE": (1, 4, 2),
    "SIMPLE_RADIAL": (2, 4, 1),
    "RADIAL": (3, 5, 1),
    "OPENCV": (4, 8, 2),
    "OPENCV_FISHEYE": (5, 8, 2),
    "FULL_OPENCV": (6, 12, 2),
    "FOV": (7, 5, 2),
    "SIMPLE_RADIAL_FISHEYE": (8, 4, 1),
    "RADIAL_FISHEYE": (9, 5, 1),
    "THIN_PRISM_FISHEYE": (10, 12, 2),
    "RAD_TAN_THIN_PRISM_FISHEYE": (11, 16, 2),
}
MODEL_NAMES: dict[int, str] = {mid: name for name, (mid, _, _) in CAMERA_MODELS.items()}
FILE_STEMS = ("cameras", "images", "points3D")


@dataclass(frozen=True, eq=False)
class ColmapCamera:
    camera_id: int
    model: str  # a key of CAMERA_MODELS
    width: int
    height: int
    params: np.ndarray  # [n] float64, in COLMAP's order for the model
    origin: str = ""  # "line 4" or "record 0": where it was read, for error messages


@dataclass(frozen=True, eq=False)
class ColmapImage:
    image_id: int
    qvec: np.ndarray  # [4] float64, world-to-camera rotation as a quaternion (w, x, y, z)
    tvec: np.ndarray  # [3] float64, world-to-camera translation
    camera_id: int
    name: str  # path relative to the image folder
    xys: np.ndarray  # [M, 2] float64 observations in pixels (pixel centres at +0.5)
    point3d_ids: np.ndarray  # [M] int64, the observed point or -1
    origin: str = ""

    @property
    def viewmat(self) -> np.ndarray:  # [4, 4] world-to-camera, OpenCV axes
        vm = np.eye(4)
        vm[:3, :3] = quat_to_rotmat(self.qvec)
        vm[:3, 3] = self.tvec
        return vm


@dataclass(frozen=True, eq=False)
class ColmapPoints:
    """The points3D file as flat arrays; tracks are stored compressed (CSR) so large models stay small."""

    ids: np.ndarray  # [P] int64
    xyz: np.ndarray  # [P, 3] float64
    rgb: np.ndarray  # [P, 3] uint8
    error: np.ndarray  # [P] float64
    track_offsets: np.ndarray  # [P + 1] int64, track of point i is [offsets[i], offsets[i + 1])
    track_image_ids: np.ndarray  # [T] int32
    track_point2d_idx: np.ndarray  # [T] int32

    def __len__(self) -> int:
        return len(self.ids)

    def track(self, i: int) -> tuple[np.ndarray, np.ndarray]:  # ([L] image ids, [L] 2D point indices)
        a, b = self.track_offsets[i], self.track_offsets[i + 1]
        return self.track_image_ids[a:b], self.track_point2d_idx[a:b]

    @staticmethod
    def empty() -> "ColmapPoints":
        return ColmapPoints(
            np.zeros(0, np.int64), np.zeros((0, 3)), np.zeros((0, 3), np.uint8), np.zeros(0),
            np.zeros(1, np.int64), np.zeros(0, np.int32), np.zeros(0, np.int32),
        )


@dataclass(frozen=True, eq=False)
class ColmapModel:
    cameras: dict[int, ColmapCamera]
    images: dict[int, ColmapImage]
    points: ColmapPoints
    files: dict[str, Path] = field(default_factory=dict)  # "cameras" / "images" / "points3D" -> file read

    @property
    def binary(self) -> bool:
        return self.files.get("cameras", Path()).suffix == ".bin"


def quat_to_rotmat(q: np.ndarray) -> np.ndarray:  # [4] (w, x, y, z) -> [3, 3]
    w, x, y, z = np.asarray(q, dtype=np.float64) / np.linalg.norm(q)
    return np.array([
        [1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)],
        [2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)],
        [2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)],
    ])


def find_sparse_dir(data_dir: str | Path) -> Path:
    """The folder holding the model: `sparse/0/`, `sparse/`, or `data_dir` itself (first that has one)."""
    data_dir = Path(data_dir)
    for d in (data_dir / "sparse" / "0", data_dir / "sparse", data_dir):
        if any((d / f"cameras{ext}").is_file() for ext in (".bin", ".txt")):
            return d
    raise ColmapError(data_dir, "no COLMAP model (cameras.bin or cameras.txt in sparse/0/, sparse/ or here)")


def read_colmap(path: str | Path) -> ColmapModel:
    """Read and validate the COLMAP model in `path` (a dataset folder or the sparse folder itself).

    Binary is preferred when both formats are present, as COLMAP does.
    """
    from train.data import colmap_binary, colmap_text

    sparse = find_sparse_dir(path)
    binary = (sparse / "cameras.bin").is_file()
    ext, reader = (".bin", colmap_binary.read_model) if binary else (".txt", colmap_text.read_model)
    files = {stem: sparse / f"{stem}{ext}" for stem in FILE_STEMS}
    if not files["images"].is_file():
        raise ColmapError(files["images"], "missing (the model has a cameras file but not this one)")
    if not files["points3D"].is_file():  # a model without points: the scene starts from random points
        del files["points3D"]
    model = reader(files)
    validate(model)
    return model


def focal_lengths(camera: ColmapCamera) -> np.ndarray:  # [1] or [2]
    return camera.params[: CAMERA_MODELS[camera.model][2]]


def validate(model: ColmapModel) -> None:
    """Check what the parsers cannot see line by line: values and cross references."""
    cam_file, img_file, pts_file = (model.files.get(s, Path(s)) for s in FILE_STEMS)
    for cam in model.cameras.values():
        where = f"{cam.origin} (camera {cam.camera_id})"
        problem = image_size_problem(cam.width, cam.height)
        if problem:
            raise ColmapError(cam_file, problem, where)
        if not np.isfinite(cam.params).all():
            raise ColmapError(cam_file, f"non-finite parameters {cam.params.tolist()}", where)
        if (focal_lengths(cam) <= 0).any():
            raise ColmapError(cam_file, f"focal length {focal_lengths(cam).tolist()} is not positive", where)
    used = set()
    for img in model.images.values():
        where = f"{img.origin} (image {img.image_id} {img.name!r})"
        if img.camera_id not in model.cameras:
            raise ColmapError(img_file, f"names camera {img.camera_id}, which {cam_file.name} lacks", where)
        used.add(img.camera_id)
        if not (np.isfinite(img.qvec).all() and np.isfinite(img.tvec).all()):
            raise ColmapError(img_file, f"non-finite pose q={img.qvec.tolist()} t={img.tvec.tolist()}", where)
        if np.linalg.norm(img.qvec) < 1e-8:
            raise ColmapError(img_file, "zero rotation quaternion", where)
        if not np.isfinite(img.xys).all():
            raise ColmapError(img_file, "non-finite 2D observation", where)
    unused = sorted(set(model.cameras) - used)
    if unused:
        cam = model.cameras[unused[0]]
        raise ColmapError(cam_file, f"camera {cam.camera_id} is used by no image in {img_file.name}", cam.origin)
    _validate_points(model, pts_file)


def _validate_points(model: ColmapModel, pts_file: Path) -> None:
    pts = model.points
    bad = np.flatnonzero(~np.isfinite(pts.xyz).all(axis=1))
    if len(bad):
        raise ColmapError(pts_file, f"non-finite position {pts.xyz[bad[0]].tolist()}", f"point {pts.ids[bad[0]]}")
    if len(np.unique(pts.ids)) != len(pts.ids):
        dup = pts.ids[np.flatnonzero(np.diff(np.sort(pts.ids)) == 0)[0]]
        raise ColmapError(pts_file, "point id appears more than once", f"point {dup}")
    image_ids = np.array(sorted(model.images), dtype=np.int64)
    unknown = np.flatnonzero(~np.isin(pts.track_image_ids, image_ids))
    if len(unknown):
        owner = np.searchsorted(pts.track_offsets, unknown[0], side="right") - 1
        raise ColmapError(pts_file, f"track names image {pts.track_image_ids[unknown[0]]}, which the images file "
                          "lacks", f"point {pts.ids[owner]}")
    images = list(model.images.values())
    if "points3D" not in model.files or not images:
        return
    observed = np.concatenate([img.point3d_ids for img in images])
    owner = np.repeat(np.arange(len(images)), [len(img.point3d_ids) for img in images])
    missing = np.flatnonzero((observed >= 0) & ~np.isin(observed, pts.ids))
    if len(missing):
        img = images[owner[missing[0]]]
        raise ColmapError(model.files["images"], f"observes point {observed[missing[0]]}, which the points3D "
                          "file lacks", f"{img.origin} (image {img.image_id} {img.name!r})")
    _validate_tracks(model, images, observed)


def _validate_tracks(model: ColmapModel, images: list[ColmapImage], observed: np.ndarray) -> None:
    """Each track entry (image, index) must be an observation of that very point in images.

    Images stored without observations (models written from known poses) are not checked.
    """
    pts = model.points
    image_ids = np.array([img.image_id for img in images])
    sizes = np.array([len(img.point3d_ids) for img in images])
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    order = np.argsort(image_ids)
    slot = order[np.searchsorted(image_ids, pts.track_image_ids, sorter=order)]
    point_of_entry = np.repeat(pts.ids, np.diff(pts.track_offsets))
    idx = pts.track_point2d_idx.astype(np.int64)
    checked = sizes[slot] > 0
    in_range = (idx >= 0) & (idx < sizes[slot])
    matches = np.zeros(len(idx), bool)
    matches[in_range] = observed[starts[slot[in_range]] + idx[in_range]] == point_of_entry[in_range]
    bad = np.flatnonzero(checked & ~matches)
    if len(bad):
        e = bad[0]
        img = images[slot[e]]
        raise ColmapError(model.files["points3D"], f"track entry (image {img.image_id}, index {idx[e]}) is not an "
                          f"observation of this point in the images file ({img.origin})", f"point {point_of_entry[e]}")
