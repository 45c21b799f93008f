"""Generated image datasets for tests, demos and benchmarks, written as nerfstudio transforms.json.

Each scene is a set of ground-truth Gaussians and cameras; `make_scene` renders the images with our
CPU renderer and writes what a real capture would give the trainer: images, cameras and a noisy
partial point cloud, plus the ground truth for later checks. Every camera sees only a part of the
scene, so a block cache smaller than the scene pages and rank regions exchange only boundary splats.

- `wall`: a 60 m x 4 m textured facade with a ground strip, seen by a row of cameras 5-6 m away;
  small and fast, for tests and demos.
- `city`: `tools.city.generate_city` with 2 x 2 city blocks and its street-level cameras; for benchmarks.
- `object`: a 2 m brick cube with a ball on top, seen from all around by cameras on a sphere
  8 m away; the one scene here whose cameras enclose it, so a tiler's random initial points
  (drawn in the box around the cameras, `tools.tile --init-random`) surround it as they would a
  NeRF-synthetic object: for training from no point cloud. (Not every camera sees a small part.)
"""
from __future__ import annotations

import json
import os
import shutil
import time
import zipfile
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from plyfile import PlyData, PlyElement

from tools.city import CityConfig, generate_city
from tools.ply.compressed import SH_C0
from tools.synthetic import look_at, pinhole_K
from train.camera import Camera
from train.render import render
from train.render.semantics import MAX_SH_DEGREE, num_sh_bases

KINDS = ("wall", "city", "object")
GROUND_TRUTH = "ground_truth.npz"
POINTS = "points3d.ply"
_OPENGL_TO_OPENCV = np.diag([1.0, -1.0, -1.0, 1.0])  # flips the camera's y and z axes; its own inverse
_ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)  # fixed member timestamps, so the same scene gives the same npz bytes

# The wall scene (metres, z up): the facade is the plane y = 0, x in [0, cfg.wall_length], z in [0, _WALL_HEIGHT],
# facing -y; the ground strip is z = 0, y in [-_GROUND_DEPTH, 0]; the cameras stand in a row at y < 0.
_WALL_HEIGHT = 4.0
_GROUND_DEPTH = 2.0
# Every camera sees the wall from its foot to its top and a strip of ground, 11-13% of the wall's length.
_WALL_FOV_X = 65.0  # degrees (vertical: 51 degrees at 4:3)
_CAMERA_DISTANCE = (5.0, 6.0)  # metres from the wall, uniform per camera
_CAMERA_HEIGHT = (1.9, 2.1)
_CAMERA_PITCH = (-2.5, -1.0)  # degrees, slightly down: the wall's top stays in view, the ground comes in
_CAMERA_YAW = 5.0  # degrees of jitter either side of facing the wall
_ROW_MARGIN = 3.5  # the row's end cameras stand this far inside the wall's ends and see to them
_OVERLAP = 0.8  # in-plane sigma relative to the mean spacing of the Gaussians, so neighbours overlap
_THIN = 0.1  # normal sigma relative to the in-plane sigma: the Gaussians lie flat on their surface
_FACING_WALL = np.array([np.sqrt(0.5), np.sqrt(0.5), 0.0, 0.0])  # wxyz, a quarter turn about x: +z to -y
_FACING_UP = np.array([1.0, 0.0, 0.0, 0.0])
_CITY_COVERAGE = 0.5  # share of a city camera's image (in coarse cells) the city must fill
# The object scene (metres, z up): a cube of side _CUBE centred at the origin and a ball of radius
# _BALL resting on it; the cameras stand on a sphere of radius _ORBIT around the origin, from
# _ELEVATION[0] to _ELEVATION[1] degrees, so the box around them holds the object with room to spare.
_CUBE = 2.0
_BALL = 0.7
_ORBIT = 8.0
_ELEVATION = (-35.0, 50.0)
_OBJECT_FOV_X = 40.0  # the object fills about half of the image's width


class SceneError(ValueError):
    """A scene that cannot be made: a bad configuration or an output folder in the way."""


@dataclass(frozen=True)
class SceneConfig:
    """How `make_scene` builds a scene; fields left None take the kind's default (in brackets: wall, city).

    seed: the only source of randomness; the same config gives the same files, byte for byte.
    width, height: image size in pixels (160 x 120, 320 x 180).
    cameras: how many cameras (24, 64).
    gaussians: ground-truth Gaussians (30,000; for the city the surface density is scaled to give
        about this many, None keeps `CityConfig`'s 2 per m^2, about 126k Gaussians).
    sh_degree: SH degree of the ground truth; above 0 it gets a little view dependence.
    view_dependence: standard deviation of the SH coefficients above degree 0.
    background: RGB in [0, 1] behind the Gaussians (black, the trainer's default).
    wall_length: the wall's length in metres (60): each camera sees about 7 m of it, so a longer wall
        makes each camera see a smaller share of the scene.
    point_fraction: share of the ground-truth means that become the initial point cloud.
    point_noise: standard deviation of the point cloud's positional noise (metres).
    color_noise: standard deviation of the point cloud's colour noise (8-bit levels).
    test_every: the loader's hold-out period (`DataConfig.test_every`); cameras are named so that
        the held-out ones lie between training cameras.
    overwrite: replace an existing scene at the output folder.
    """

    seed: int = 0
    width: int | None = None
    height: int | None = None
    cameras: int | None = None
    gaussians: int | None = None
    sh_degree: int = 1
    view_dependence: float = 0.1
    background: tuple[float, float, float] = (0.0, 0.0, 0.0)
    wall_length: float = 60.0
    point_fraction: float = 0.4
    point_noise: float = 0.03
    color_noise: float = 12.0
    test_every: int = 8
    overwrite: bool = False

    def __post_init__(self) -> None:
        for name in ("width", "height", "cameras", "gaussians"):
            value = getattr(self, name)
            if value is not None and (int(value) != value or value < 1):
                raise SceneError(f"scene config: {name} must be a positive integer, got {value!r}")
        if self.cameras is not None and self.cameras < 3:
            raise SceneError(f"scene config: cameras must be at least 3 (held-out cameras lie between "
                             f"training cameras), got {self.cameras}")
        if not 0 <= self.sh_degree <= MAX_SH_DEGREE:
            raise SceneError(f"scene config: sh_degree must be in 0..{MAX_SH_DEGREE}, got {self.sh_degree}")
        if len(self.background) != 3 or not all(0.0 <= c <= 1.0 for c in self.background):
            raise SceneError(f"scene config: background must be three values in [0, 1], got {self.background!r}")
        if not 0.0 < self.point_fraction <= 1.0:
            raise SceneError(f"scene config: point_fraction must be in (0, 1], got {self.point_fraction}")
        for name in ("view_dependence", "point_noise", "color_noise"):
            if not getattr(self, name) >= 0:
                raise SceneError(f"scene config: {name} must be non-negative, got {getattr(self, name)}")
        if self.test_every < 0 or self.test_every == 1:
            raise SceneError(f"scene config: test_every must be 0 or at least 2, got {self.test_every}")

    def resolved(self, kind: str) -> "SceneConfig":
        """This config with the kind's defaults filled in."""
        if kind not in KINDS:
            raise SceneError(f"unknown scene kind {kind!r} (choose from {', '.join(KINDS)})")
        width, height, cameras, gaussians = {"wall": (160, 120, 24, 30_000), "city": (320, 180, 64, None),
                                             "object": (160, 120, 32, 30_000)}[kind]
        return replace(self, width=self.width or width, height=self.height or height,
                       cameras=self.cameras or cameras, gaussians=self.gaussians or gaussians)


@dataclass(frozen=True, eq=False)
class GroundTruth:
    """Ground-truth Gaussians (gsplat's names and storage conventions, float32) and the cameras
    in the order they stand (along the row, or along a nearest-neighbour tour of the city)."""

    splats: dict[str, np.ndarray]
    cameras: list[Camera]
    sh_degree: int

    @property
    def colors(self) -> np.ndarray:  # [N, 3] view-independent colour in [0, 1]
        return np.clip(self.splats["sh0"][:, 0] * SH_C0 + 0.5, 0.0, 1.0)


@dataclass(frozen=True, eq=False)
class SceneInfo:
    """What `make_scene` wrote."""

    kind: str
    out_dir: Path
    cameras: list[Camera]  # in name order; a name is the frame's file_path ("images/wall_0003.png")
    test_names: list[str]  # the cameras `load_scene` holds out (every `test_every`-th name)
    gaussians: int
    points: int
    visible: np.ndarray  # [C] share of the Gaussians that project into each camera's image (name order)
    seconds: float


def holdout_slots(n: int, every: int) -> np.ndarray:  # -> [n] int64
    """Which of n cameras standing in a sequence gets the i-th name, so that the names a loader holds
    out (i % every == 0) all stand between training cameras: the first two names swap places, and so
    do the last two when the last name would be held out (this works for every n >= 3 but n = 3 with
    every = 2, where two of the three cameras are held out)."""
    slots = np.arange(n)
    if every >= 2 and n >= 3:
        slots[[0, 1]] = [1, 0]
        if (n - 1) % every == 0 and n - 2 > 1:
            slots[[n - 2, n - 1]] = [n - 1, n - 2]
    return slots


def build_scene(kind: str, cfg: SceneConfig = SceneConfig()) -> GroundTruth:
    """The ground truth of a scene: Gaussians and cameras (nothing rendered or written)."""
    cfg = cfg.resolved(kind)
    rng = np.random.default_rng(cfg.seed)
    if kind == "wall":
        splats, cameras = _wall_gaussians(cfg, rng), _wall_cameras(cfg, rng)
    elif kind == "object":
        splats, cameras = _object_gaussians(cfg, rng), _object_cameras(cfg, rng)
    else:
        splats, cameras = _city(cfg)
    n = len(splats["means"])
    rest = num_sh_bases(cfg.sh_degree) - 1
    splats["shN"] = (cfg.view_dependence * rng.standard_normal((n, rest, 3))).astype(np.float32)
    return GroundTruth(splats, cameras, cfg.sh_degree)


def make_scene(kind: str, out_dir: str | os.PathLike, cfg: SceneConfig = SceneConfig()) -> SceneInfo:
    """Render scene `kind` and write it to `out_dir` as a nerfstudio dataset (transforms.json, images/,
    points3d.ply) plus ground_truth.npz. The folder appears complete or not at all."""
    start = time.perf_counter()
    cfg = cfg.resolved(kind)
    out = Path(out_dir)
    _check_output(out, cfg.overwrite)
    gt = build_scene(kind, cfg)
    slots = holdout_slots(len(gt.cameras), cfg.test_every)
    cameras = [replace(gt.cameras[s], image_id=i, name=f"images/{kind}_{i:04d}.png") for i, s in enumerate(slots)]
    rng = np.random.default_rng([cfg.seed, 1])  # a stream of its own: the point cloud does not shift the scene
    points, colors = _initial_points(gt, cfg, rng)
    partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        (partial / "images").mkdir(parents=True)
        visible = _render_images(gt, cameras, cfg.background, partial)
        _write_transforms(partial / "transforms.json", cameras)
        _write_points(partial / POINTS, points, colors)
        _write_ground_truth(partial / GROUND_TRUTH, gt, cameras, kind, cfg)
        _replace(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    test_names = [c.name for i, c in enumerate(cameras) if cfg.test_every and i % cfg.test_every == 0]
    return SceneInfo(kind, out, cameras, test_names, len(gt.splats["means"]), len(points), visible,
                     time.perf_counter() - start)


def _check_output(out: Path, overwrite: bool) -> None:
    if not out.exists():
        return
    if not overwrite:
        raise SceneError(f"{out}: already exists (pass overwrite / --overwrite to replace it)")
    # Replacing a folder is destructive: only a scene this tool wrote (or nothing at all) goes.
    if not out.is_dir() or (any(out.iterdir()) and not (out / GROUND_TRUTH).is_file()):
        raise SceneError(f"{out}: exists and is not a generated scene (no {GROUND_TRUTH}); not replacing it")


def _replace(partial: Path, out: Path) -> None:
    """Move the finished `partial` folder to `out`, setting an old scene aside until the move is done."""
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        os.replace(out, old)
    try:
        os.replace(partial, out)
    except OSError:
        if old.exists():
            os.replace(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _palette(t: np.ndarray) -> np.ndarray:  # [N] -> [N, 3] in [0.15, 0.85]
    """A rainbow along t (period 1): each camera of the row sees colours of its own."""
    return 0.5 + 0.35 * np.cos(2 * np.pi * (t[:, None] + np.array([0.0, 1 / 3, 2 / 3])))


def _facade_colors(x: np.ndarray, z: np.ndarray, length: float) -> np.ndarray:  # [N], [N] -> [N, 3]
    """Brick courses (0.5 x 0.25 m, alternate rows offset) over a rainbow, two storeys of dark windows,
    and light pilasters every 5 m: detail at several scales, so a blurry fit scores a low PSNR."""
    row = np.floor(z / 0.25)
    brick = np.floor(x / 0.5 + 0.5 * (row % 2))
    shade = np.where((brick + row) % 2 == 0, 1.0, 0.75)
    colors = _palette(x / length) * shade[:, None]
    window = (np.abs((x % 2.5) - 1.25) < 0.5) & ((np.abs(z - 1.3) < 0.6) | (np.abs(z - 3.1) < 0.6))
    colors[window] = (0.12, 0.16, 0.25)
    colors[np.abs((x % 5.0) - 2.5) > 2.35] = (0.9, 0.88, 0.8)
    return colors


def _ground_colors(x: np.ndarray, y: np.ndarray) -> np.ndarray:  # [N], [N] -> [N, 3]
    """Grey paving with a dashed yellow line along the wall."""
    colors = np.tile([0.35, 0.35, 0.37], (len(x), 1))
    colors[(np.abs(y + 0.6) < 0.08) & (x % 2.0 < 1.0)] = (0.9, 0.75, 0.1)
    return colors


def _wall_gaussians(cfg: SceneConfig, rng: np.random.Generator) -> dict[str, np.ndarray]:
    wall_area, ground_area = cfg.wall_length * _WALL_HEIGHT, cfg.wall_length * _GROUND_DEPTH
    n = cfg.gaussians
    n_wall = int(round(n * wall_area / (wall_area + ground_area)))
    x = rng.uniform(0.0, cfg.wall_length, n)
    across = rng.uniform(0.0, 1.0, n)  # height on the wall, depth on the ground
    on_wall = np.arange(n) < n_wall
    z = np.where(on_wall, across * _WALL_HEIGHT, 0.0)
    y = np.where(on_wall, 0.0, -across * _GROUND_DEPTH)
    colors = np.where(on_wall[:, None], _facade_colors(x, z, cfg.wall_length), _ground_colors(x, y))
    colors = np.clip(colors + rng.normal(0.0, 0.03, (n, 3)), 0.0, 1.0)
    spacing = 1.0 / np.sqrt(n / (wall_area + ground_area))
    sigma = _OVERLAP * spacing * np.exp(rng.normal(0.0, 0.2, (n, 1)))
    return {
        "means": np.column_stack([x, y, z]).astype(np.float32),
        "scales": np.log(sigma * [1.0, 1.0, _THIN]).astype(np.float32),
        "quats": np.where(on_wall[:, None], _FACING_WALL, _FACING_UP).astype(np.float32),
        "opacities": rng.normal(2.5, 0.7, n).astype(np.float32),
        "sh0": ((colors - 0.5) / SH_C0)[:, None, :].astype(np.float32),
    }


def _wall_cameras(cfg: SceneConfig, rng: np.random.Generator) -> list[Camera]:
    n = cfg.cameras
    x = np.linspace(_ROW_MARGIN, cfg.wall_length - _ROW_MARGIN, n)
    eye = np.column_stack([x, -rng.uniform(*_CAMERA_DISTANCE, n), rng.uniform(*_CAMERA_HEIGHT, n)])
    yaw = np.radians(90.0 + rng.uniform(-_CAMERA_YAW, _CAMERA_YAW, n))
    pitch = np.radians(rng.uniform(*_CAMERA_PITCH, n))
    forward = np.column_stack([np.cos(pitch) * np.cos(yaw), np.cos(pitch) * np.sin(yaw), np.sin(pitch)])
    K = pinhole_K(cfg.width, cfg.height, _WALL_FOV_X)
    return [Camera(look_at(eye[i], eye[i] + forward[i]), K, cfg.width, cfg.height) for i in range(n)]


def _object_gaussians(cfg: SceneConfig, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Flat Gaussians on the cube's six faces (the facade's bricks and windows on the sides, a
    rainbow on the top and bottom) and on the ball (colour bands by latitude and longitude), in
    proportion to the areas."""
    h = _CUBE / 2.0
    cube_area, ball_area = 6 * _CUBE**2, 4 * np.pi * _BALL**2
    n = cfg.gaussians
    n_cube = int(round(n * cube_area / (cube_area + ball_area)))
    face = rng.integers(0, 6, n_cube)  # 0..3 the sides (+x, +y, -x, -y), 4 the top, 5 the bottom
    u, v = rng.uniform(-h, h, n_cube), rng.uniform(-h, h, n_cube)
    normal = np.array([[1, 0, 0], [0, 1, 0], [-1, 0, 0], [0, -1, 0], [0, 0, 1], [0, 0, -1]], float)[face]
    across = np.array([[0, 1, 0], [-1, 0, 0], [0, -1, 0], [1, 0, 0], [1, 0, 0], [1, 0, 0]], float)[face]
    up = np.cross(normal, across)
    cube = h * normal + u[:, None] * across + v[:, None] * up
    side = face < 4
    # Along the sides u runs once round the cube (8 m), so the bricks continue from face to face.
    colors = np.where(side[:, None], _facade_colors(face * _CUBE + u + h, v + h, 4 * _CUBE),
                      _palette((u + v) / _CUBE) * 0.8)
    z_axis = rng.standard_normal((n - n_cube, 3))
    z_axis /= np.linalg.norm(z_axis, axis=1, keepdims=True)
    ball = z_axis * _BALL + [0.0, 0.0, h + _BALL]
    lat, lon = np.arcsin(z_axis[:, 2]), np.arctan2(z_axis[:, 1], z_axis[:, 0])
    ball_colors = _palette(lon / (2 * np.pi)) * np.where(np.floor(lat / 0.3) % 2 == 0, 1.0, 0.55)[:, None]
    colors = np.clip(np.concatenate([colors, ball_colors]) + rng.normal(0.0, 0.03, (n, 3)), 0.0, 1.0)
    normals = np.concatenate([normal, z_axis])
    spacing = 1.0 / np.sqrt(n / (cube_area + ball_area))
    sigma = _OVERLAP * spacing * np.exp(rng.normal(0.0, 0.2, (n, 1)))
    return {
        "means": np.concatenate([cube, ball]).astype(np.float32),
        "scales": np.log(sigma * [1.0, 1.0, _THIN]).astype(np.float32),
        "quats": _quat_to_normal(normals).astype(np.float32),
        "opacities": rng.normal(2.5, 0.7, n).astype(np.float32),
        "sh0": ((colors - 0.5) / SH_C0)[:, None, :].astype(np.float32),
    }


def _quat_to_normal(normals: np.ndarray) -> np.ndarray:  # [N, 3] unit -> [N, 4] wxyz
    """The shortest rotation taking +z (a flat Gaussian's thin axis) onto each normal."""
    w = 1.0 + normals[:, 2]
    q = np.column_stack([w, -normals[:, 1], normals[:, 0], np.zeros(len(normals))])
    flipped = w < 1e-9  # the normal is -z: half a turn about x
    q[flipped] = (0.0, 1.0, 0.0, 0.0)
    return q / np.linalg.norm(q, axis=1, keepdims=True)


def _object_cameras(cfg: SceneConfig, rng: np.random.Generator) -> list[Camera]:
    """Round the object in azimuth (in sequence, so held-out cameras stand between training
    ones), each at a random elevation, looking at a jittered point near its middle."""
    n = cfg.cameras
    azimuth = np.linspace(0.0, 2 * np.pi, n, endpoint=False) + rng.uniform(-0.05, 0.05, n)
    elevation = np.radians(rng.uniform(*_ELEVATION, n))
    eye = _ORBIT * np.column_stack([np.cos(elevation) * np.cos(azimuth), np.cos(elevation) * np.sin(azimuth),
                                    np.sin(elevation)])
    target = rng.normal(0.0, 0.15, (n, 3)) + [0.0, 0.0, _BALL / 2]
    K = pinhole_K(cfg.width, cfg.height, _OBJECT_FOV_X)
    return [Camera(look_at(eye[i], target[i]), K, cfg.width, cfg.height) for i in range(n)]


def _city(cfg: SceneConfig) -> tuple[dict[str, np.ndarray], list[Camera]]:
    # A camera at the city's edge may look out of it at an almost empty image: draw twice the cameras and
    # keep, in their order, those whose image the city fills at least half (topped up with the best-filled others).
    city_cfg = CityConfig(blocks=2, cameras=2 * cfg.cameras, width=cfg.width, height=cfg.height, seed=cfg.seed)
    if cfg.gaussians is not None:
        # Counts are Poisson in the density, so one trial city tells the density that gives about N.
        trial = len(generate_city(city_cfg))
        city_cfg = replace(city_cfg, density=city_cfg.density * cfg.gaussians / trial)
    city = generate_city(city_cfg)
    coverage = np.array([_coverage(c, city.means) for c in city.cameras])
    kept = np.sort(np.argsort(-np.minimum(coverage, _CITY_COVERAGE), kind="stable")[:cfg.cameras])
    cameras = [city.cameras[i] for i in kept]
    return city.splats(), [cameras[i] for i in _tour([c.center for c in cameras])]


def _coverage(camera: Camera, means: np.ndarray, cells: int = 16) -> float:  # means [N, 3]
    """Share of a cells x cells grid over the image into which some mean projects: a cheap stand-in
    for how much of the image the scene fills."""
    cam = camera.viewmat[:3, :3] @ means.T + camera.viewmat[:3, 3:]  # [3, N]
    ahead = cam[2] > 0.1
    uv = (camera.K[:2, :2] @ (cam[:2, ahead] / cam[2, ahead]) + camera.K[:2, 2:]) / [[camera.width], [camera.height]]
    inside = ((uv >= 0) & (uv < 1)).all(axis=0)
    cell = np.floor(uv[:, inside] * cells).astype(np.int64)
    return len(np.unique(cell[0] * cells + cell[1])) / cells**2


def _tour(centres: list[np.ndarray]) -> list[int]:
    """A greedy nearest-neighbour walk through the points from the one nearest the origin, so
    neighbours in the sequence stand near each other (what `holdout_slots` relies on)."""
    points = np.asarray(centres)
    left = list(range(len(points)))
    order = [left.pop(int(np.argmin(np.linalg.norm(points, axis=1))))]
    while left:
        d = np.linalg.norm(points[left] - points[order[-1]], axis=1)
        order.append(left.pop(int(np.argmin(d))))
    return order


def _initial_points(gt: GroundTruth, cfg: SceneConfig, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A noisy subsample of the ground truth, as SfM would give: xyz [P, 3] float32, rgb [P, 3] uint8."""
    means = gt.splats["means"]
    keep = np.sort(rng.choice(len(means), max(1, round(cfg.point_fraction * len(means))), replace=False))
    xyz = means[keep] + rng.normal(0.0, cfg.point_noise, (len(keep), 3))
    rgb = gt.colors[keep] * 255.0 + rng.normal(0.0, cfg.color_noise, (len(keep), 3))
    return xyz.astype(np.float32), np.clip(np.round(rgb), 0, 255).astype(np.uint8)


def _render_images(gt: GroundTruth, cameras: list[Camera], background: tuple[float, float, float],
                   folder: Path) -> np.ndarray:  # -> [C] visible share per camera
    splats = {k: torch.from_numpy(v) for k, v in gt.splats.items()}
    visible = np.zeros(len(cameras))
    with torch.no_grad():
        for i, cam in enumerate(cameras):
            rgb, _, meta = render(splats, cam, gt.sh_degree, background, backend="cpu")
            pixels = np.round(rgb.clamp(0.0, 1.0).numpy() * 255.0).astype(np.uint8)
            Image.fromarray(pixels, "RGB").save(folder / cam.name, format="PNG")
            visible[i] = len(meta["ids"]) / len(gt.splats["means"])
    return visible


def _write_transforms(path: Path, cameras: list[Camera]) -> None:
    """nerfstudio's layout: shared pinhole intrinsics (every camera of a scene has the same K) and
    camera-to-world matrices in OpenGL camera axes (x right, y up, z backwards)."""
    cam = cameras[0]
    K = cam.K
    meta = {
        "camera_model": "PINHOLE",
        "fl_x": K[0, 0], "fl_y": K[1, 1], "cx": K[0, 2], "cy": K[1, 2], "w": cam.width, "h": cam.height,
        "ply_file_path": POINTS,
        "frames": [{"file_path": c.name, "transform_matrix": (c.camtoworld @ _OPENGL_TO_OPENCV).tolist()}
                   for c in cameras],
    }
    path.write_text(json.dumps(meta, indent=1))


def _write_points(path: Path, xyz: np.ndarray, rgb: np.ndarray) -> None:  # xyz [P, 3] float32, rgb [P, 3] uint8
    rows = np.empty(len(xyz), dtype=[(c, "f4") for c in "xyz"] + [(c, "u1") for c in ("red", "green", "blue")])
    for j, c in enumerate("xyz"):
        rows[c] = xyz[:, j]
    for j, c in enumerate(("red", "green", "blue")):
        rows[c] = rgb[:, j]
    PlyData([PlyElement.describe(rows, "vertex")], byte_order="<").write(str(path))


def _write_ground_truth(path: Path, gt: GroundTruth, cameras: list[Camera], kind: str, cfg: SceneConfig) -> None:
    arrays = dict(gt.splats)
    arrays.update(
        viewmats=np.stack([c.viewmat for c in cameras]), Ks=np.stack([c.K for c in cameras]),
        names=np.array([c.name for c in cameras]), width=np.array(cfg.width), height=np.array(cfg.height),
        sh_degree=np.array(gt.sh_degree), background=np.array(cfg.background), seed=np.array(cfg.seed),
        kind=np.array(kind),
    )
    # np.savez stamps members with the current time; fixed stamps keep a scene's bytes reproducible.
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, array in arrays.items():
            info = zipfile.ZipInfo(f"{name}.npy", date_time=_ZIP_EPOCH)
            info.compress_type = zipfile.ZIP_DEFLATED
            with archive.open(info, "w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.asarray(array), allow_pickle=False)
