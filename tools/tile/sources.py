"""Inputs of the tiler, each as rows read in ranges: points (means, colours) or trained Gaussians."""
from __future__ import annotations

import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from tools.ply import CompressedPly, PointPly, open_ply
from tools.ply.points import DEFAULT_GREY
from tools.tile.config import TileConfig, TileError

Rows = dict[str, np.ndarray]  # points: means [n,3] float32, colors [n,3] uint8; gaussians: gsplat's six parameters


@dataclass(frozen=True, eq=False)
class Source:
    description: str  # what was read, for the summary
    path: Path
    kind: str  # "points" or "gaussians"
    count: int  # rows, non-finite ones included
    read: Callable[[int, int], Rows]  # rows [start, stop)
    sh_degree: int | None = None  # a trained file's SH degree
    world_transform: np.ndarray = field(default_factory=lambda: np.eye(4))  # input frame -> rows' frame
    images: tuple[str, ...] = ()  # a dataset's image names: lets the trainer refuse another scene's images


def open_source(path: Path, cfg: TileConfig) -> Source:
    """Recognise and open SRC; dataset folders and transforms.json go through `train.data.load_scene`."""
    path = Path(path)
    if not path.exists():
        raise TileError(f"{path}: no such file or folder")
    suffix = path.suffix.lower()
    if path.is_dir() or suffix == ".json":
        source = _dataset(path, cfg)
    elif suffix == ".ply":
        source = _ply(path)
    elif suffix == ".npz":
        source = _npz(path)
    else:
        raise TileError(f"{path}: not a recognised input (a COLMAP or transforms.json dataset, .ply or .npz)")
    if source.count == 0:
        raise TileError(f"{path}: empty input (no points or Gaussians)")
    if cfg.voxel_size is not None:
        if source.kind != "points":
            raise TileError(f"{path}: --voxel-size applies to point clouds, not to trained Gaussians")
        source = voxel_downsample(source, cfg.voxel_size)
    return source


def points_source(
    description: str, path: Path, means: np.ndarray, colors: np.ndarray, transform: np.ndarray | None = None
) -> Source:
    """An in-memory point cloud as a source (means [n,3] any float, colors [n,3] uint8)."""
    means = np.asarray(means, dtype=np.float32)  # huge values become inf, dropped later as non-finite
    colors = np.asarray(colors, dtype=np.uint8)
    return Source(
        description, path, "points", len(means), lambda a, b: {"means": means[a:b], "colors": colors[a:b]},
        world_transform=np.eye(4) if transform is None else np.asarray(transform, dtype=np.float64),
    )  # fmt: skip


def _dataset(path: Path, cfg: TileConfig) -> Source:
    from train.data import DataConfig, DatasetError, load_scene  # heavy (torch): only for datasets

    try:
        data_cfg = DataConfig(data_factor=cfg.data_factor, normalize=True, check_images=False,
                              random_points=cfg.init_random, seed=cfg.seed,
                              allow_external_images=cfg.allow_external_images)  # fmt: skip
    except ValueError as e:
        raise TileError(f"{path}: {e}") from None
    try:
        scene = load_scene(path, data_cfg)
    except DatasetError as e:  # names the file (and line or record) already
        raise TileError(str(e)) from None
    what = "random" if scene.random_points else "SfM"
    description = f"{scene.kind} dataset {path} ({len(scene.points):,} {what} points, {len(scene.cameras)} cameras)"
    source = points_source(description, path, scene.points, scene.colors, scene.world_transform)
    return replace(source, images=tuple(sorted(c.name for c in scene.cameras)))


def _ply(path: Path) -> Source:
    reader = open_ply(path)
    if isinstance(reader, PointPly):
        colours = "with colours" if reader.color_names else f"no colours (grey {DEFAULT_GREY})"
        return Source(
            f"point-cloud PLY {path} ({reader.count:,} points, {colours})", path, "points", reader.count,
            lambda a, b: _point_rows(*reader.read(a, b)),
        )  # fmt: skip
    kind = "compressed 3DGS PLY" if isinstance(reader, CompressedPly) else "3DGS PLY"
    return Source(
        f"{kind} {path} ({reader.count:,} Gaussians, SH degree {reader.sh_degree})", path, "gaussians",
        reader.count, reader.read, sh_degree=reader.sh_degree,
    )  # fmt: skip


def _point_rows(means: np.ndarray, colors: np.ndarray) -> Rows:
    return {"means": means.astype(np.float32), "colors": colors}


# Deflate's largest ratio (258-byte matches in 2-bit codes): no member can justify more bytes than this
# times its compressed size, so a larger array header is corrupt or hostile.
_MAX_DEFLATE_RATIO = 1032


def _check_npz_member(path: Path, archive: zipfile.ZipFile, name: str) -> None:
    """Refuse an array whose header declares more bytes than its zip member can hold, before
    numpy allocates them."""
    info = archive.getinfo(f"{name}.npy")
    with archive.open(info) as f:
        version = np.lib.format.read_magic(f)
        if version not in ((1, 0), (2, 0), (3, 0)):
            raise ValueError(f"unknown .npy format version {version}")
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, dtype = read(f, max_header_size=10_000)
        header = f.tell()
    have = min(info.file_size, info.compress_size * _MAX_DEFLATE_RATIO) - header
    need = int(np.prod(shape, dtype=object)) * dtype.itemsize
    if need > have:
        raise TileError(f"{path}: array '{name}' declares shape {shape} ({need:,} bytes) but its file holds "
                        f"at most {max(have, 0):,} (truncated or corrupt)")


def _npz(path: Path) -> Source:
    try:
        with np.load(path) as data:
            if "means3d" not in data:
                raise TileError(f"{path}: npz lacks the 'means3d' array (has {sorted(data.keys())})")
            for name in ("means3d", "colors"):
                if name in data:
                    _check_npz_member(path, data.zip, name)
            means = data["means3d"]
            colors = data["colors"] if "colors" in data else None
    except (OSError, ValueError, zipfile.BadZipFile, zlib.error, EOFError, KeyError) as e:  # zlib: corrupt deflate
        raise TileError(f"{path}: unreadable npz ({e})") from None
    if means.ndim != 2 or means.shape[1] != 3 or means.dtype.kind not in "fiu":
        raise TileError(f"{path}: 'means3d' must be a numeric [N, 3] array, got {means.dtype} {means.shape}")
    if colors is None:
        colors = np.full((len(means), 3), DEFAULT_GREY, dtype=np.uint8)
    elif colors.shape != means.shape:
        raise TileError(f"{path}: 'colors' has shape {colors.shape}, 'means3d' {means.shape}")
    elif colors.dtype.kind == "f":  # floats in [0, 1]
        bad = ~np.isfinite(colors).all(axis=1)
        if bad.any():  # dropped and counted as a NaN position is, rather than made black
            means = means.astype(np.float32)
            means[bad] = np.nan
        colors = np.clip(np.round(np.nan_to_num(colors) * 255.0), 0, 255).astype(np.uint8)
    return points_source(f"npz {path} ({len(means):,} points)", path, means, colors)


def voxel_downsample(source: Source, voxel_size: float) -> Source:
    """Average the points (and colours) in each voxel with open3d. Needs the cloud in memory."""
    import open3d as o3d

    rows = source.read(0, source.count)
    finite = np.isfinite(rows["means"]).all(axis=1)
    cloud = o3d.geometry.PointCloud(o3d.utility.Vector3dVector(rows["means"][finite].astype(np.float64)))
    cloud.colors = o3d.utility.Vector3dVector(rows["colors"][finite].astype(np.float64) / 255.0)
    down = cloud.voxel_down_sample(voxel_size)
    colors = np.clip(np.round(np.asarray(down.colors) * 255.0), 0, 255).astype(np.uint8)
    description = f"{source.description}, voxel-downsampled at {voxel_size:g} to {len(down.points):,} points"
    if not finite.all():
        description += f" ({int((~finite).sum()):,} non-finite points dropped)"
    return points_source(description, source.path, np.asarray(down.points), colors, source.world_transform)
