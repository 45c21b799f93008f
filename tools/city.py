"""A street-level synthetic city: a grid of streets between city blocks of box buildings, with
Gaussians on facades, roofs and street ground (and optional trees and cars), and cameras 1.7 m
above the streets looking along them. Units are metres, z is up, the ground is z = 0.

Everything is a pure function of `CityConfig` (seeded), vectorised over Gaussians. The layout:
streets of width W run along x and along y every P = block + W metres, starting at 0, so the
city spans [0, n * P + W] on each axis and city block (i, j) is [i P + W, (i + 1) P] x [j P + W, (j + 1) P].
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TypeVar

import numpy as np

from tools.ply.compressed import SH_C0
from tools.synthetic import look_at, pinhole_K
from train.camera import Camera

# What each Gaussian lies on (`City.kind`).
GROUND, FACADE, ROOF, TREE, CAR = 0, 1, 2, 3, 4

_CAR_SIZE = (4.5, 1.8, 1.2)  # length, width, body height above its clearance (m)
_CAR_CLEARANCE = 0.3
_THIN = 0.1  # a surface Gaussian's normal sigma relative to its in-plane sigma
_OVERLAP = 0.6  # in-plane sigma relative to the mean spacing 1/sqrt(density): neighbours overlap


class CityError(ValueError):
    """A city configuration that cannot be built; the message names the field."""


@dataclass(frozen=True)
class CityConfig:
    """A city; the defaults are the benchmark's (about 1.1M Gaussians, 256 cameras).

    blocks: city blocks along x and y (a blocks x blocks grid, streets between and around them).
    block_size: edge of a city block (m).
    street_width: width of every street (m).
    max_parcels: each city block is cut into 1..max_parcels parcels along each axis.
    park_fraction: chance that a parcel holds no building (open ground).
    setback: (min, max) gap between a building and its parcel's edges (m).
    building_height: (min, max) building height (m); blocks near the centre draw taller buildings.
    density: Gaussians per square metre of every surface (Poisson counts, uniform positions).
    trees / cars: street trees along the kerbs and parked cars in the lanes, as clutter.
    tree_spacing / car_spacing: distance between candidate spots (m); each is filled with
        probability 0.7.
    cameras: how many cameras; each stands on a street at eye_height above the ground,
        looks along the street (yaw jittered uniformly by +- yaw_jitter degrees) with a pitch drawn
        from pitch (degrees, positive is up).
    width / height / fov_x: pinhole image size (pixels) and horizontal field of view (degrees),
        principal point at the image centre.
    seed: the only source of randomness.
    """

    blocks: int = 6
    block_size: float = 60.0
    street_width: float = 14.0
    max_parcels: int = 3
    park_fraction: float = 0.1
    setback: tuple[float, float] = (1.0, 4.0)
    building_height: tuple[float, float] = (8.0, 45.0)
    density: float = 2.0
    trees: bool = True
    cars: bool = True
    tree_spacing: float = 12.0
    car_spacing: float = 9.0
    cameras: int = 256
    eye_height: float = 1.7
    yaw_jitter: float = 20.0
    pitch: tuple[float, float] = (-5.0, 12.0)
    width: int = 1280
    height: int = 720
    fov_x: float = 75.0
    seed: int = 0

    def __post_init__(self) -> None:
        positive = ("blocks", "block_size", "street_width", "max_parcels", "density", "tree_spacing",
                    "car_spacing", "cameras", "eye_height", "width", "height")
        for name in positive:
            if not getattr(self, name) > 0:
                raise CityError(f"city config: {name} must be positive, got {getattr(self, name)}")
        for name in ("setback", "building_height", "pitch"):
            lo, hi = getattr(self, name)
            if not lo <= hi:
                raise CityError(f"city config: {name} must be (min, max) with min <= max, got {(lo, hi)}")
        if self.setback[0] < 0 or 2 * self.setback[1] >= self.block_size / self.max_parcels:
            raise CityError(f"city config: setback {self.setback} leaves no room for a building on a "
                            f"parcel of {self.block_size / self.max_parcels:g} m")
        if self.building_height[0] <= 0:
            raise CityError(f"city config: building_height must be positive, got {self.building_height}")
        if not 0 <= self.park_fraction <= 1:
            raise CityError(f"city config: park_fraction must be in [0, 1], got {self.park_fraction}")
        if not 0 < self.fov_x < 180:
            raise CityError(f"city config: fov_x must be in (0, 180) degrees, got {self.fov_x}")
        if not (-90 < self.pitch[0] and self.pitch[1] < 90):
            raise CityError(f"city config: pitch must lie in (-90, 90) degrees, got {self.pitch}")

    @property
    def grid_step(self) -> float:  # distance between parallel street centre lines
        return self.block_size + self.street_width

    @property
    def extent(self) -> float:  # the city is the square [0, extent]^2
        return self.blocks * self.grid_step + self.street_width

    def on_street(self, xy: np.ndarray) -> np.ndarray:  # [M, 2] -> [M] bool
        """Whether ground points lie on a street (inside the city, outside every city block)."""
        xy = np.asarray(xy, dtype=np.float64)
        inside = ((xy >= 0) & (xy <= self.extent)).all(axis=1)
        return inside & (np.mod(xy, self.grid_step) <= self.street_width).any(axis=1)


@dataclass(frozen=True, eq=False)
class City:
    """Gaussians in gsplat's storage conventions (log scales, wxyz quats, logit opacities) plus
    plain colours, what each lies on, and the cameras."""

    config: CityConfig
    means: np.ndarray  # [N, 3] float32
    scales: np.ndarray  # [N, 3] float32 log sigma; the third axis is the surface normal
    quats: np.ndarray  # [N, 4] float32 wxyz, unit
    opacities: np.ndarray  # [N] float32 logits
    colors: np.ndarray  # [N, 3] float32 RGB in [0, 1]
    kind: np.ndarray  # [N] int8: GROUND, FACADE, ROOF, TREE or CAR
    part: np.ndarray  # [N] int32 index into buildings (FACADE, ROOF), trees, cars; -1 for GROUND
    buildings: np.ndarray  # [K, 6] float64 boxes (x0, y0, 0, x1, y1, h)
    trees: np.ndarray  # [T, 4] float64 crown centre (x, y, z) and radius
    cars: np.ndarray  # [V, 6] float64 boxes
    cameras: list[Camera]

    def __len__(self) -> int:
        return len(self.means)

    def splats(self) -> dict[str, np.ndarray]:
        """gsplat's parameter dict at SH degree 0 (sh0 from the colours, shN empty)."""
        n = len(self)
        return {
            "means": self.means,
            "scales": self.scales,
            "quats": self.quats,
            "opacities": self.opacities,
            "sh0": ((self.colors - np.float32(0.5)) / np.float32(SH_C0)).reshape(n, 1, 3),
            "shN": np.zeros((n, 0, 3), dtype=np.float32),
        }


@dataclass
class _Surfaces:
    """Parallelograms origin + a u + b v (a, b in [0, 1]) with what they belong to."""

    origin: np.ndarray  # [S, 3]
    u: np.ndarray  # [S, 3]
    v: np.ndarray  # [S, 3]
    kind: np.ndarray  # [S] int8
    part: np.ndarray  # [S] int32
    color: np.ndarray  # [S, 3] base colour of the surface


def _box_surfaces(boxes: np.ndarray, side_kind: int, top_kind: int, colors: np.ndarray) -> _Surfaces:
    """The four sides and the top of axis-aligned boxes [K, 6] (no bottom: they stand on something)."""
    lo, hi = boxes[:, :3], boxes[:, 3:]
    d = hi - lo
    zero = np.zeros_like(d[:, 0])
    ex = np.stack([d[:, 0], zero, zero], 1)
    ey = np.stack([zero, d[:, 1], zero], 1)
    ez = np.stack([zero, zero, d[:, 2]], 1)
    origin = np.concatenate([lo, lo + ex, lo, lo + ey, lo + ez])
    u = np.concatenate([ey, ey, ex, ex, ex])
    v = np.concatenate([ez, ez, ez, ez, ey])
    k = len(boxes)
    kind = np.repeat(np.array([side_kind] * 4 + [top_kind], dtype=np.int8), k)
    part = np.tile(np.arange(k, dtype=np.int32), 5)
    return _Surfaces(origin, u, v, kind, part, np.tile(colors, (5, 1)))


def _quats_from_normals(normals: np.ndarray) -> np.ndarray:  # [N, 3] unit -> [N, 4] wxyz
    """The rotation taking +z to each normal: q = (1 + z.n, z x n), normalised; -z turns about x."""
    q = np.stack([1.0 + normals[:, 2], -normals[:, 1], normals[:, 0], np.zeros(len(normals))], 1)
    flipped = q[:, 0] < 1e-9
    q[flipped] = (0.0, 1.0, 0.0, 0.0)
    return q / np.linalg.norm(q, axis=1, keepdims=True)


@dataclass
class _Gaussians:
    means: np.ndarray  # [N, 3]
    normals: np.ndarray  # [N, 3]
    kind: np.ndarray  # [N]
    part: np.ndarray  # [N]
    color: np.ndarray  # [N, 3]


_T = TypeVar("_T")


def _concat(items: list[_T]) -> _T:
    """Row-wise concatenation of dataclasses of arrays (all of one type)."""
    return type(items[0])(*(np.concatenate([getattr(x, f.name) for x in items]) for f in fields(items[0])))


def _sample_surfaces(s: _Surfaces, density: float, rng: np.random.Generator) -> _Gaussians:
    normal = np.cross(s.u, s.v)
    area = np.linalg.norm(normal, axis=1)
    which = np.repeat(np.arange(len(area)), rng.poisson(area * density))
    a, b = rng.uniform(0.0, 1.0, (2, len(which), 1))
    means = s.origin[which] + a * s.u[which] + b * s.v[which]
    return _Gaussians(means, (normal / area[:, None])[which], s.kind[which], s.part[which], s.color[which])


def _sample_spheres(spheres: np.ndarray, density: float, kind: int, color: np.ndarray,
                    rng: np.random.Generator) -> _Gaussians:  # spheres [T, 4] centre and radius
    area = 4 * np.pi * spheres[:, 3] ** 2
    which = np.repeat(np.arange(len(spheres)), rng.poisson(area * density))
    normals = rng.standard_normal((len(which), 3))
    normals /= np.linalg.norm(normals, axis=1, keepdims=True)
    means = spheres[which, :3] + spheres[which, 3:] * normals
    return _Gaussians(means, normals, np.full(len(which), kind, np.int8), which.astype(np.int32),
                      np.broadcast_to(color, (len(which), 3)))


def _buildings(cfg: CityConfig, rng: np.random.Generator) -> np.ndarray:  # -> [K, 6]
    boxes = []
    centre = cfg.extent / 2
    for i in range(cfg.blocks):
        for j in range(cfg.blocks):
            lo = np.array([i, j]) * cfg.grid_step + cfg.street_width
            # Downtown: blocks near the centre draw from the upper end of the height range.
            closeness = 1.0 - np.linalg.norm(lo + cfg.block_size / 2 - centre) / (centre * np.sqrt(2))
            cuts = [np.sort(rng.uniform(0, 1, rng.integers(0, cfg.max_parcels))) for _ in range(2)]
            edges = [lo[a] + cfg.block_size * np.concatenate([[0.0], _spaced(cuts[a], cfg), [1.0]]) for a in range(2)]
            for x0, x1 in zip(edges[0][:-1], edges[0][1:]):
                for y0, y1 in zip(edges[1][:-1], edges[1][1:]):
                    if rng.uniform() < cfg.park_fraction:
                        continue
                    back = rng.uniform(*cfg.setback, 4)
                    low, high = cfg.building_height
                    h = low + (high - low) * rng.uniform() ** (2.0 - closeness)
                    boxes.append((x0 + back[0], y0 + back[1], 0.0, x1 - back[2], y1 - back[3], h))
    return np.array(boxes, dtype=np.float64).reshape(-1, 6)


def _spaced(cuts: np.ndarray, cfg: CityConfig) -> np.ndarray:
    """Parcel cuts (fractions of a block) moved apart so every parcel fits two maximal setbacks."""
    min_gap = (2 * cfg.setback[1] + 1.0) / cfg.block_size
    n = len(cuts)
    # Parcels of at least min_gap each, then the rest shared in proportion to the random cuts.
    slack = 1.0 - (n + 1) * min_gap
    if slack <= 0:
        return np.linspace(0, 1, n + 2)[1:-1]
    return min_gap * np.arange(1, n + 1) + slack * cuts


def _street_spots(cfg: CityConfig, spacing: float, offset: float,
                  rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Points along both sides of every street, `offset` from the street's centre line, kept with
    probability 0.7: (xy [M, 2], along_x [M] bool, True for streets running along x)."""
    along = np.arange(spacing / 2, cfg.extent, spacing)
    centres = np.arange(cfg.blocks + 1) * cfg.grid_step + cfg.street_width / 2
    lines = (centres[:, None] + np.array([-offset, offset])).ravel()
    a, c = np.meshgrid(along, lines, indexing="ij")
    a, c = a.ravel(), c.ravel()
    xy = np.concatenate([np.stack([a, c], 1), np.stack([c, a], 1)])
    along_x = np.repeat([True, False], len(a))
    # Spots in a crossing belong to no kerb or lane.
    crossing = (np.mod(xy, cfg.grid_step) <= cfg.street_width).all(axis=1)
    keep = ~crossing & (rng.uniform(size=len(xy)) < 0.7)
    return xy[keep], along_x[keep]


def _trees(cfg: CityConfig, rng: np.random.Generator) -> np.ndarray:  # -> [T, 4] crown centre, radius
    xy, _ = _street_spots(cfg, cfg.tree_spacing, cfg.street_width / 2 - 1.5, rng)
    z = rng.uniform(4.0, 6.0, len(xy))
    return np.column_stack([xy, z, rng.uniform(1.5, 2.5, len(xy))])


def _cars(cfg: CityConfig, rng: np.random.Generator) -> np.ndarray:  # -> [V, 6] boxes
    xy, along_x = _street_spots(cfg, cfg.car_spacing, cfg.street_width / 4, rng)
    length, width, body = _CAR_SIZE
    half = np.where(along_x[:, None], [length / 2, width / 2], [width / 2, length / 2])
    z0 = np.full((len(xy), 1), _CAR_CLEARANCE)
    return np.hstack([xy - half, z0, xy + half, z0 + body])


def _block_index(cfg: CityConfig, xy: np.ndarray) -> np.ndarray:  # [M, 2] -> [M] int64
    """Cell (i, j) = [i P + W, (i + 1) P + W) x [j P + W, (j + 1) P + W) as one number: a city block
    and the streets after it, so every building lies in the cell of its block."""
    ij = np.floor((xy - cfg.street_width) / cfg.grid_step).astype(np.int64) + 1  # >= 0 inside the city
    return ij[:, 0] * (cfg.blocks + 2) + ij[:, 1]


def _ground(cfg: CityConfig, buildings: np.ndarray, rng: np.random.Generator) -> _Gaussians:
    """The ground plane outside the building footprints."""
    n = rng.poisson(cfg.extent**2 * cfg.density)
    xy = rng.uniform(0.0, cfg.extent, (n, 2))
    # A point can only lie under a building of its own city block: test those few footprints.
    cell = _block_index(cfg, xy)
    order = np.argsort(cell, kind="stable")
    foot = _block_index(cfg, buildings[:, :2])
    first, last = np.searchsorted(cell[order], foot), np.searchsorted(cell[order], foot, side="right")
    covered = np.zeros(n, dtype=bool)
    for box, a, b in zip(buildings, first, last):
        rows = order[a:b]
        p = xy[rows]
        covered[rows[((p >= box[:2]) & (p <= box[3:5])).all(axis=1)]] = True
    xy = xy[~covered]
    m = len(xy)
    on_street = cfg.on_street(xy)
    color = np.where(on_street[:, None], [0.25, 0.25, 0.27], [0.45, 0.42, 0.38])  # asphalt, paving
    return _Gaussians(np.column_stack([xy, np.zeros(m)]), np.tile([0.0, 0.0, 1.0], (m, 1)),
                      np.full(m, GROUND, np.int8), np.full(m, -1, np.int32), color)


def _cameras(cfg: CityConfig, rng: np.random.Generator) -> list[Camera]:
    n = cfg.cameras
    along_x = rng.uniform(size=n) < 0.5
    street = rng.integers(0, cfg.blocks + 1, n)
    across = street * cfg.grid_step + cfg.street_width * (0.5 + rng.uniform(-0.3, 0.3, n))
    along = rng.uniform(0.0, cfg.extent, n)
    heading = np.where(along_x, 0.0, np.pi / 2) + np.where(rng.uniform(size=n) < 0.5, 0.0, np.pi)
    yaw = heading + np.radians(rng.uniform(-cfg.yaw_jitter, cfg.yaw_jitter, n))
    pitch = np.radians(rng.uniform(*cfg.pitch, n))
    eye = np.column_stack([np.where(along_x, along, across), np.where(along_x, across, along),
                           np.full(n, cfg.eye_height)])
    forward = np.column_stack([np.cos(pitch) * np.cos(yaw), np.cos(pitch) * np.sin(yaw), np.sin(pitch)])
    K = pinhole_K(cfg.width, cfg.height, cfg.fov_x)
    return [Camera(look_at(eye[i], eye[i] + forward[i]), K, cfg.width, cfg.height, image_id=i, name=f"street_{i:04d}")
            for i in range(n)]


def generate_city(cfg: CityConfig | None = None) -> City:
    """The city of `cfg` (the benchmark's by default); the same config gives the same city."""
    cfg = cfg or CityConfig()
    rng = np.random.default_rng(cfg.seed)
    buildings = _buildings(cfg, rng)
    trees = _trees(cfg, rng) if cfg.trees else np.zeros((0, 4))
    cars = _cars(cfg, rng) if cfg.cars else np.zeros((0, 6))
    facade_colors = rng.uniform(0.3, 0.9, (len(buildings), 3))
    car_colors = rng.uniform(0.0, 1.0, (len(cars), 3))
    surfaces = _concat([
        _box_surfaces(buildings, FACADE, ROOF, facade_colors),
        _box_surfaces(cars, CAR, CAR, car_colors),
    ])
    g = _concat([
        _ground(cfg, buildings, rng),
        _sample_surfaces(surfaces, cfg.density, rng),
        _sample_spheres(trees, cfg.density, TREE, np.array([0.2, 0.45, 0.15]), rng),
    ])
    n = len(g.means)
    sigma = _OVERLAP / np.sqrt(cfg.density) * np.exp(rng.normal(0.0, 0.2, (n, 1)))
    log_scales = np.log(sigma * np.array([1.0, 1.0, _THIN]))
    colors = np.clip(g.color + rng.normal(0.0, 0.04, (n, 3)), 0.0, 1.0)
    return City(
        config=cfg,
        means=g.means.astype(np.float32),
        scales=log_scales.astype(np.float32),
        quats=_quats_from_normals(g.normals).astype(np.float32),
        opacities=rng.normal(2.5, 0.7, n).astype(np.float32),
        colors=colors.astype(np.float32),
        kind=g.kind.astype(np.int8),
        part=g.part.astype(np.int32),
        buildings=buildings,
        trees=trees,
        cars=cars,
        cameras=_cameras(cfg, rng),
    )
