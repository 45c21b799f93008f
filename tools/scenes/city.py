"""A street-level city: a grid of streets between city blocks of box buildings, with Gaussians on
textured facades, roofs and street ground (and optional trees and cars), cameras 1.7 m above the
streets looking along them, and optionally aerial cameras. Units are metres, z is up, the ground is z = 0.

The layout: streets of width W run along x and along y every P = block + W metres, starting at 0, so
the city spans [0, n P + W] on each axis and city block (i, j) is [i P + W, (i + 1) P] x [j P + W, (j + 1) P].

The Gaussians are generated tile by tile (`CityLayout.tiles`, `city_tile`): a tile is an x-y column
of octree cells at `CityLayout.depth` of the cube `CityLayout.root` and has a random stream of its
own, so a tile is the same whether it is made alone or with all the others, and a city of any size
is made with one tile's memory. `generate_city` concatenates every tile (for small cities and tests).
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import numpy as np

from octree import morton
from octree.keys import MAX_DEPTH, BlockKey
from octree.root import RootCube
from tools.scenes.cameras import heading_cameras
from tools.scenes.surfaces import Samples, Surfaces, concat, flat_splats, sample_spheres, sample_surfaces
from tools.scenes.textures import city_car, city_facade, city_ground, city_roof, city_tree
from train.camera import Camera

# What each Gaussian lies on (`City.kind`).
GROUND, FACADE, ROOF, TREE, CAR = 0, 1, 2, 3, 4

_CAR_SIZE = (4.5, 1.8, 1.2)  # length, width, body height above its clearance (m)
_CAR_CLEARANCE = 0.3
_OVERLAP = 0.6  # in-plane sigma relative to the mean spacing 1/sqrt(density): neighbours overlap
_KERB = 2.5  # pavement width along the city blocks (m)
_PAD = 1.0  # the root cube reaches this far beyond the city (m), so nothing lies on its faces
# Aerial cameras: height above the ground (m) and pitch (degrees). The image's top edge then looks
# 17-42 degrees down and meets the ground within 270 m: a view of a city district, not of the whole
# city, so what one view holds (the renderer keeps all its 2D splats) stops growing with the city.
_AERIAL_HEIGHT = (40.0, 80.0)
_AERIAL_PITCH = (-65.0, -40.0)
CAPTURES = ("street", "survey")
_SURVEY_HORIZON_MARGIN = 5.0  # degrees between a survey image's top ray and the horizon, at least
_STREAM_LAYOUT, _STREAM_CAMERAS, _STREAM_TILE, _STREAM_TREE = 0, 1, 2, 3  # random streams of a seed


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
    cameras: how many street cameras; each stands on a street at eye_height above the ground,
        looks along the street (yaw jittered uniformly by +- yaw_jitter degrees) with a pitch drawn
        from pitch (degrees, positive is up).
    aerial_cameras: how many cameras look down on the city from 40-80 m (pitch -65..-40 degrees).
    capture: "street" (the street and aerial cameras above) or "survey": a drone's oblique survey
        (`survey_cameras`), flight lines over the whole city at survey_altitude metres, the camera
        pitched survey_pitch degrees (negative is down) along its line, neighbouring images
        overlapping by survey_overlap along and across the lines. Its top ray stays below the
        horizon, so each image sees a bounded patch of ground however large the city grows; the
        camera count follows from the city's size (`cameras` and `aerial_cameras` are ignored).
    width / height / fov_x: pinhole image size (pixels) and horizontal field of view (degrees),
        principal point at the image centre.
    sh_degree / view_dependence: SH degree of the Gaussians and the standard deviation of their
        coefficients above degree 0.
    tile_gaussians: expected Gaussians of a generation tile (what one tile holds in memory).
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
    aerial_cameras: int = 0
    eye_height: float = 1.7
    yaw_jitter: float = 20.0
    pitch: tuple[float, float] = (-5.0, 12.0)
    width: int = 1280
    height: int = 720
    fov_x: float = 75.0
    sh_degree: int = 0
    view_dependence: float = 0.0
    tile_gaussians: int = 32768
    seed: int = 0
    capture: str = "street"
    survey_altitude: float = 120.0
    survey_pitch: float = -60.0
    survey_overlap: float = 0.6

    def __post_init__(self) -> None:
        positive = ("blocks", "block_size", "street_width", "max_parcels", "density", "tree_spacing",
                    "car_spacing", "cameras", "eye_height", "width", "height", "tile_gaussians")
        for name in positive:
            if not getattr(self, name) > 0:
                raise CityError(f"city config: {name} must be positive, got {getattr(self, name)}")
        if self.aerial_cameras < 0:
            raise CityError(f"city config: aerial_cameras must be non-negative, got {self.aerial_cameras}")
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
        if self.capture not in CAPTURES:
            raise CityError(f"city config: capture must be one of {', '.join(CAPTURES)}, got {self.capture!r}")
        if self.capture == "survey":
            self._check_survey()
        if not 0 <= self.sh_degree <= 3 or self.view_dependence < 0:
            raise CityError(f"city config: sh_degree must be in 0..3 and view_dependence non-negative, "
                            f"got {self.sh_degree}, {self.view_dependence}")

    def _check_survey(self) -> None:
        if not self.survey_altitude > self.building_height[1]:
            raise CityError(f"city config: survey_altitude {self.survey_altitude:g} m must clear the tallest "
                            f"buildings ({self.building_height[1]:g} m)")
        if not 0 <= self.survey_overlap < 1:
            raise CityError(f"city config: survey_overlap must be in [0, 1), got {self.survey_overlap}")
        # The image's top row must look below the horizon, or a view holds the city up to its edge.
        top = -self.survey_pitch - np.degrees(self.vfov) / 2
        if not (-90 < self.survey_pitch < 0 and top >= _SURVEY_HORIZON_MARGIN):
            raise CityError(f"city config: survey_pitch {self.survey_pitch:g} degrees puts the top of a "
                            f"{np.degrees(self.vfov):.1f}-degree-high image {top:.1f} degrees below the horizon; "
                            f"it must be at least {_SURVEY_HORIZON_MARGIN:g} (pitch further down, at most "
                            f"{-np.degrees(self.vfov) / 2 - _SURVEY_HORIZON_MARGIN:.1f})")

    @property
    def vfov(self) -> float:  # vertical field of view (radians) of the pinhole with fov_x
        return 2 * np.arctan(np.tan(np.radians(self.fov_x) / 2) * self.height / self.width)

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
class CityLayout:
    """Everything of a city but its Gaussians: the objects, the cube its blocks divide, the tiles."""

    config: CityConfig
    buildings: np.ndarray  # [K, 6] float64 boxes (x0, y0, 0, x1, y1, h)
    trees: np.ndarray  # [T, 4] float64 crown centre (x, y, z) and radius
    cars: np.ndarray  # [V, 6] float64 boxes
    facade_colors: np.ndarray  # [K, 3]
    car_colors: np.ndarray  # [V, 3]
    surfaces: Surfaces  # facades, roofs and car bodies
    root: RootCube
    depth: int  # tiles are x-y columns of the cells at this depth

    @property
    def surface_area(self) -> float:
        """Of every surface Gaussians are drawn on: the expected count is this times the density."""
        footprint = np.prod(self.buildings[:, 3:5] - self.buildings[:, :2], axis=1).sum()
        return float(self.config.extent**2 - footprint + self.surfaces.areas.sum()
                     + (4 * np.pi * self.trees[:, 3] ** 2).sum())

    @property
    def tile_size(self) -> float:
        return self.root.size / 2**self.depth

    def tiles(self) -> list[tuple[int, int]]:
        """(ix, iy) of the columns over the city, row by row."""
        n = int(np.ceil((self.config.extent + _PAD) / self.tile_size))
        return [(ix, iy) for iy in range(min(n, 2**self.depth)) for ix in range(min(n, 2**self.depth))]

    def tile_box(self, ix: int, iy: int) -> tuple[np.ndarray, np.ndarray]:  # -> lo [2], hi [2]
        k = np.array([[ix, iy, 0], [ix + 1, iy + 1, 0]])
        edges = self.root.edges(k, self.depth)
        return edges[0, :2], edges[1, :2]

    def tile_box3(self, ix: int, iy: int) -> np.ndarray:  # -> [6] a box holding every mean of the tile
        lo, hi = self.tile_box(ix, iy)
        top = max(self.buildings[:, 5].max(initial=0.0), (self.trees[:, 2] + self.trees[:, 3]).max(initial=0.0),
                  self.cars[:, 5].max(initial=0.0))
        return np.array([lo[0], lo[1], -_PAD, hi[0], hi[1], top + _PAD])


@dataclass(frozen=True, eq=False)
class CityTile:
    """The Gaussians of one tile (gsplat's parameters, float32) and what each lies on."""

    ix: int
    iy: int
    # means [n, 3], scales [n, 3], quats [n, 4], opacities [n], sh0 [n, 1, 3], shN [n, K, 3]
    splats: dict[str, np.ndarray]
    colors: np.ndarray  # [n, 3] float32 RGB in [0, 1]
    kind: np.ndarray  # [n] int8
    part: np.ndarray  # [n] int32

    def __len__(self) -> int:
        return len(self.colors)

    def blocks(self, layout: CityLayout) -> dict[str, np.ndarray]:
        """Rows of this tile by the octree cell (block key) that holds their means, in Morton order."""
        k = layout.root.quantize(self.splats["means"]) >> (MAX_DEPTH - layout.depth)
        codes = morton.encode(k)
        order = np.argsort(codes, kind="stable")
        uniq, first = np.unique(codes[order], return_index=True)
        return {BlockKey(layout.depth, int(c)).name: rows for c, rows in zip(uniq, np.split(order, first[1:]))}


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
    sh0: np.ndarray = field(repr=False, default=None)  # [N, 1, 3] float32
    shN: np.ndarray = field(repr=False, default=None)  # [N, K, 3] float32

    def __len__(self) -> int:
        return len(self.means)

    def splats(self) -> dict[str, np.ndarray]:
        """gsplat's parameter dict at the config's SH degree."""
        return {"means": self.means, "scales": self.scales, "quats": self.quats, "opacities": self.opacities,
                "sh0": self.sh0, "shN": self.shN}


# ---- layout ----

def _box_surfaces(boxes: np.ndarray, side_kind: int, top_kind: int) -> Surfaces:
    """The four sides and the top of axis-aligned boxes [K, 6] (no bottom: they stand on something),
    u x v pointing out of the box."""
    lo, hi = boxes[:, :3], boxes[:, 3:]
    d = hi - lo
    zero = np.zeros_like(d[:, 0])
    ex = np.stack([d[:, 0], zero, zero], 1)
    ey = np.stack([zero, d[:, 1], zero], 1)
    ez = np.stack([zero, zero, d[:, 2]], 1)
    # -x face, +x face, -y face, +y face, top; each (origin, u, v) ordered so u x v is outward.
    origin = np.concatenate([lo, lo + ex, lo, lo + ey, lo + ez])
    u = np.concatenate([ez, ey, ex, ez, ex])
    v = np.concatenate([ey, ez, ez, ex, ey])
    k = len(boxes)
    kind = np.repeat(np.array([side_kind] * 4 + [top_kind], dtype=np.int8), k)
    part = np.tile(np.arange(k, dtype=np.int32), 5)
    return Surfaces(origin, u, v, kind, part)


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
    # Crowns clear a street camera's 1.7 m eye height: none stands inside a tree.
    z = rng.uniform(5.0, 6.5, len(xy))
    return np.column_stack([xy, z, rng.uniform(1.5, 2.5, len(xy))])


def _cars(cfg: CityConfig, rng: np.random.Generator) -> np.ndarray:  # -> [V, 6] boxes
    xy, along_x = _street_spots(cfg, cfg.car_spacing, cfg.street_width / 4, rng)
    length, width, body = _CAR_SIZE
    half = np.where(along_x[:, None], [length / 2, width / 2], [width / 2, length / 2])
    z0 = np.full((len(xy), 1), _CAR_CLEARANCE)
    return np.hstack([xy - half, z0, xy + half, z0 + body])


def city_layout(cfg: CityConfig) -> CityLayout:
    """The city's objects (seeded by cfg.seed) and its tiling: tiles of about cfg.tile_gaussians."""
    rng = np.random.default_rng([cfg.seed, _STREAM_LAYOUT])
    buildings = _buildings(cfg, rng)
    trees = _trees(cfg, rng) if cfg.trees else np.zeros((0, 4))
    cars = _cars(cfg, rng) if cfg.cars else np.zeros((0, 6))
    facade_colors = rng.uniform(0.3, 0.9, (len(buildings), 3))
    car_colors = rng.uniform(0.0, 1.0, (len(cars), 3))
    surfaces = concat([_box_surfaces(buildings, FACADE, ROOF), _box_surfaces(cars, CAR, CAR)])
    top = max(float(buildings[:, 5].max(initial=0.0)), float((trees[:, 2] + trees[:, 3]).max(initial=0.0)))
    root = RootCube((-_PAD, -_PAD, -_PAD), max(cfg.extent, top) + 2 * _PAD)
    layout = CityLayout(cfg, buildings, trees, cars, facade_colors, car_colors, surfaces, root, 0)
    # Tiles of the same share of the city's surface hold about the same count: split the cube
    # until a tile's share of the expected count is at most tile_gaussians.
    expected = layout.surface_area * cfg.density
    depth = 0
    while depth < 16 and expected * (layout.root.size / 2**depth / cfg.extent) ** 2 > cfg.tile_gaussians:
        depth += 1
    return replace(layout, depth=depth)


def sized(cfg: CityConfig, gaussians: int, min_blocks: int = 2) -> CityConfig:
    """`cfg` grown (in city blocks, at least min_blocks a side) until its density gives about
    `gaussians`, then with the density scaled so that the expected count is exactly that."""
    blocks = min_blocks
    per_block = city_layout(replace(cfg, blocks=blocks)).surface_area / blocks**2
    blocks = max(min_blocks, int(np.ceil(np.sqrt(gaussians / (cfg.density * per_block)))))
    area = city_layout(replace(cfg, blocks=blocks)).surface_area
    return replace(cfg, blocks=blocks, density=gaussians / area)


# ---- the Gaussians of a tile ----

def _ground(layout: CityLayout, lo: np.ndarray, hi: np.ndarray, rng: np.random.Generator) -> Samples:
    """The ground of the tile inside the city, outside the building footprints."""
    extent = layout.config.extent
    a, b = np.maximum(lo, 0.0), np.minimum(hi, extent)
    if (b <= a).any():
        return Samples(np.zeros((0, 3)), np.zeros((0, 3)), np.zeros(0, np.int8), np.zeros(0, np.int32))
    d = b - a
    rect = Surfaces(np.array([[a[0], a[1], 0.0]]), np.array([[d[0], 0.0, 0.0]]), np.array([[0.0, d[1], 0.0]]),
                    np.array([GROUND], np.int8), np.array([-1], np.int32))
    s = sample_surfaces(rect, rng, density=layout.config.density)
    xy = s.means[:, :2]
    covered = np.zeros(len(s), dtype=bool)
    bld = layout.buildings
    near = (bld[:, 0] < b[0]) & (bld[:, 3] > a[0]) & (bld[:, 1] < b[1]) & (bld[:, 4] > a[1])
    for box in bld[near]:
        covered |= ((xy >= box[:2]) & (xy <= box[3:5])).all(axis=1)
    return s.select(np.flatnonzero(~covered))


def _trees_over(layout: CityLayout, lo: np.ndarray, hi: np.ndarray) -> Samples:
    """The tree crowns' points over the tile: each crown is drawn whole from its own stream and cut
    to the tile, so the tiles share a crown exactly."""
    t = layout.trees
    near = np.flatnonzero((t[:, 0] + t[:, 3] >= lo[0]) & (t[:, 0] - t[:, 3] < hi[0])
                          & (t[:, 1] + t[:, 3] >= lo[1]) & (t[:, 1] - t[:, 3] < hi[1]))
    parts = []
    for i in near:
        rng = np.random.default_rng([layout.config.seed, _STREAM_TREE, int(i)])
        s = sample_spheres(t[i:i + 1, :3], t[i:i + 1, 3], TREE, rng, density=layout.config.density)
        inside = ((s.means[:, :2] >= lo) & (s.means[:, :2] < hi)).all(axis=1)
        parts.append(Samples(s.means[inside], s.normals[inside], s.kind[inside], np.full(inside.sum(), i, np.int32)))
    empty = Samples(np.zeros((0, 3)), np.zeros((0, 3)), np.zeros(0, np.int8), np.zeros(0, np.int32))
    return concat([empty, *parts])


def _colors(layout: CityLayout, s: Samples) -> np.ndarray:  # -> [n, 3]
    cfg = layout.config
    colors = np.zeros((len(s), 3))
    xy = s.means[:, :2]
    g = s.kind == GROUND
    if g.any():
        p = xy[g]
        m = np.mod(p, cfg.grid_step)
        band = m <= cfg.street_width  # [n, 2]: in the street running across axis a's bands
        street = cfg.on_street(p)
        edge = np.minimum(m, cfg.street_width - m)
        kerb = (band & (edge < _KERB) & ~band[:, ::-1]).any(axis=1)
        # Along a street in band a the other coordinate runs: a dashed centre line, zebra stripes by the crossings.
        lane = np.zeros(len(p), bool)
        zebra = np.zeros(len(p), bool)
        for a in (0, 1):
            o = 1 - a
            along = band[:, a] & ~band[:, o]
            lane |= along & (np.abs(m[:, a] - cfg.street_width / 2) < 0.1) & (np.mod(p[:, o], 6.0) < 3.0)
            near_crossing = (m[:, o] - cfg.street_width < 3.0) | (cfg.grid_step - m[:, o] < 3.0)
            zebra |= along & near_crossing & (edge[:, a] >= _KERB) & (np.mod(p[:, a], 1.0) < 0.5)
        colors[g] = city_ground(p, street, kerb, lane, zebra)
    f = s.kind == FACADE
    if f.any():
        along = np.where(np.abs(s.normals[f, 0]) > 0.5, s.means[f, 1], s.means[f, 0])
        b = s.part[f]
        colors[f] = city_facade(along, s.means[f, 2], layout.buildings[b, 5], layout.facade_colors[b], b)
    r = s.kind == ROOF
    if r.any():
        colors[r] = city_roof(xy[r])
    t = s.kind == TREE
    if t.any():
        colors[t] = city_tree(s.means[t])
    c = s.kind == CAR
    if c.any():
        colors[c] = city_car(s.means[c, 2], layout.cars[s.part[c], 2], layout.car_colors[s.part[c]])
    return colors


def _inside_tile(means: np.ndarray, layout: CityLayout, ix: int, iy: int) -> np.ndarray:  # [n, 3] float32
    """The float32 means moved (by a float32 step or two) into the tile's cells where rounding put them
    in a neighbour's: a block is written by the one tile that owns its column."""
    want = np.array([ix, iy])
    shift = MAX_DEPTH - layout.depth
    for _ in range(8):
        k = layout.root.quantize(means)[:, :2] >> shift
        wrong = k != want
        if not wrong.any():
            return means
        rows, axes = np.nonzero(wrong)
        toward = np.where(k[rows, axes] < want[axes], np.inf, -np.inf).astype(np.float32)
        means[rows, axes] = np.nextafter(means[rows, axes], toward)
    raise AssertionError(f"tile ({ix}, {iy}): means outside the tile after rounding")


def city_tile(layout: CityLayout, ix: int, iy: int) -> CityTile:
    """The Gaussians of tile (ix, iy): ground, building and car surfaces, tree crowns over it."""
    cfg = layout.config
    lo, hi = layout.tile_box(ix, iy)
    rng = np.random.default_rng([cfg.seed, _STREAM_TILE, ix, iy])
    s = concat([_ground(layout, lo, hi, rng),
                sample_surfaces(layout.surfaces.clipped(lo, hi), rng, density=cfg.density),
                _trees_over(layout, lo, hi)])
    colors = np.clip(_colors(layout, s) + rng.normal(0.0, 0.04, (len(s), 3)), 0.0, 1.0).astype(np.float32)
    splats = flat_splats(s, colors, _OVERLAP / np.sqrt(cfg.density), rng, cfg.sh_degree, cfg.view_dependence)
    splats["means"] = _inside_tile(splats["means"], layout, ix, iy)
    return CityTile(ix, iy, splats, colors, s.kind.astype(np.int8), s.part.astype(np.int32))


def city_tiles(layout: CityLayout) -> Iterator[CityTile]:
    """Every non-empty tile, one at a time."""
    for ix, iy in layout.tiles():
        tile = city_tile(layout, ix, iy)
        if len(tile):
            yield tile


# ---- cameras ----

def street_cameras(cfg: CityConfig, rng: np.random.Generator, n: int) -> list[Camera]:
    along_x = rng.uniform(size=n) < 0.5
    street = rng.integers(0, cfg.blocks + 1, n)
    across = street * cfg.grid_step + cfg.street_width * (0.5 + rng.uniform(-0.3, 0.3, n))
    along = rng.uniform(0.0, cfg.extent, n)
    heading = np.where(along_x, 0.0, np.pi / 2) + np.where(rng.uniform(size=n) < 0.5, 0.0, np.pi)
    yaw = heading + np.radians(rng.uniform(-cfg.yaw_jitter, cfg.yaw_jitter, n))
    pitch = np.radians(rng.uniform(*cfg.pitch, n))
    eye = np.column_stack([np.where(along_x, along, across), np.where(along_x, across, along),
                           np.full(n, cfg.eye_height)])
    return heading_cameras(eye, yaw, pitch, cfg.width, cfg.height, cfg.fov_x)


def aerial_cameras(cfg: CityConfig, rng: np.random.Generator, n: int) -> list[Camera]:
    """Above the middle 80% of the city, any heading, looking down across it."""
    xy = rng.uniform(0.1 * cfg.extent, 0.9 * cfg.extent, (n, 2))
    eye = np.column_stack([xy, rng.uniform(*_AERIAL_HEIGHT, n)])
    yaw = rng.uniform(0.0, 2 * np.pi, n)
    pitch = np.radians(rng.uniform(*_AERIAL_PITCH, n))
    return heading_cameras(eye, yaw, pitch, cfg.width, cfg.height, cfg.fov_x)


@dataclass(frozen=True)
class SurveyFootprint:
    """Where a survey image's centre column meets the ground, in metres ahead of the camera, and its
    width there; the spacing of the flight lines and of the shots along them."""

    near: float
    far: float
    width: float
    along_step: float  # between shots along a line
    across_step: float  # between lines

    @property
    def centre(self) -> float:  # the footprint's middle, ahead of the camera
        return (self.near + self.far) / 2


def survey_footprint(cfg: CityConfig) -> SurveyFootprint:
    """The ground a survey image covers and the spacing that gives cfg.survey_overlap between neighbours."""
    h, down, half_v = cfg.survey_altitude, np.radians(-cfg.survey_pitch), cfg.vfov / 2
    near, far = h / np.tan(down + half_v), h / np.tan(down - half_v)  # negative near: behind the camera
    width = 2 * h / np.sin(down) * np.tan(np.radians(cfg.fov_x) / 2)
    keep = 1.0 - cfg.survey_overlap
    return SurveyFootprint(float(near), float(far), float(width), float(keep * (far - near)), float(keep * width))


def _stations(extent: float, step: float) -> np.ndarray:  # -> [n] at most step apart, centred on [0, extent]
    # The first and last lie half a step inside the edges: their footprints, wider than a step, reach
    # past the edges without looking mostly beyond them.
    n = max(1, int(np.ceil(extent / step)))
    return (np.arange(n) + 0.5) * (extent / n)


def survey_cameras(cfg: CityConfig) -> list[Camera]:
    """A double-grid oblique survey in flight order: lines along x, flown back and forth (each camera
    looks along its line, so neighbouring lines look opposite ways), then lines along y. The
    footprints' middles cover the whole city; the order is the walk `holdout_slots` names by."""
    fp = survey_footprint(cfg)
    along, across = _stations(cfg.extent, fp.along_step), _stations(cfg.extent, fp.across_step)
    eyes, yaws = [], []
    for axis in (0, 1):
        for line, c in enumerate(across):
            sign = 1.0 if line % 2 == 0 else -1.0
            a = along if sign > 0 else along[::-1]
            target = np.zeros((len(a), 2))
            target[:, axis], target[:, 1 - axis] = a, c
            heading = np.zeros(2)
            heading[axis] = sign
            eyes.append(target - fp.centre * heading)
            yaws.append(np.full(len(a), np.arctan2(heading[1], heading[0])))
    xy, yaw = np.concatenate(eyes), np.concatenate(yaws)
    eye = np.column_stack([xy, np.full(len(xy), cfg.survey_altitude)])
    pitch = np.full(len(xy), np.radians(cfg.survey_pitch))
    cams = heading_cameras(eye, yaw, pitch, cfg.width, cfg.height, cfg.fov_x)
    return [replace(c, image_id=i, name=f"survey_{i:04d}") for i, c in enumerate(cams)]


def city_cameras(cfg: CityConfig, street: int | None = None, aerial: int | None = None) -> list[Camera]:
    """Street cameras then aerial ones (cfg's counts by default), named street_NNNN and aerial_NNNN."""
    rng = np.random.default_rng([cfg.seed, _STREAM_CAMERAS])
    street = cfg.cameras if street is None else street
    aerial = cfg.aerial_cameras if aerial is None else aerial
    cams = street_cameras(cfg, rng, street) + aerial_cameras(cfg, rng, aerial)
    names = [f"street_{i:04d}" for i in range(street)] + [f"aerial_{i:04d}" for i in range(aerial)]
    return [replace(c, image_id=i, name=name) for i, (c, name) in enumerate(zip(cams, names))]


def generate_city(cfg: CityConfig | None = None) -> City:
    """The city of `cfg` (the benchmark's by default), every tile in memory; the same config gives
    the same city, and the same Gaussians as its tiles made one at a time."""
    cfg = cfg or CityConfig()
    layout = city_layout(cfg)
    tiles = list(city_tiles(layout))
    cat = {name: np.concatenate([t.splats[name] for t in tiles]) for name in tiles[0].splats}
    return City(
        config=cfg, means=cat["means"], scales=cat["scales"], quats=cat["quats"], opacities=cat["opacities"],
        colors=np.concatenate([t.colors for t in tiles]), kind=np.concatenate([t.kind for t in tiles]),
        part=np.concatenate([t.part for t in tiles]), buildings=layout.buildings, trees=layout.trees,
        cars=layout.cars, cameras=survey_cameras(cfg) if cfg.capture == "survey" else city_cameras(cfg),
        sh0=cat["sh0"], shN=cat["shN"],
    )
