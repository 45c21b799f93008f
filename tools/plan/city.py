"""The planner's city: `tools.scenes`' street-level city at the asked size, represented by a
thinned sample of its Gaussians, each sample standing for `weight` of them.

A city of 10^9 Gaussians cannot be generated here (~724 GB of state), but the octree, the
ownership and the culling only need to know how many Gaussians lie where and how large they are.
The city's layout (streets, buildings, trees, cars: `city_layout`) and its cameras
(`city_cameras`) are the scene generator's own; the samples are a Poisson process on the same
surfaces (`sample_surfaces`, `sample_spheres`) at density / weight, drawn over the whole city at
once rather than tile by tile (the generator's per-tile and per-tree streams, which make a tile
reproducible on its own, took minutes at this size). Scales and opacities are drawn from those of
a small pilot city generated at the full density, so every sample has a real Gaussian's extent
box and splat radius without the planner restating the generator's constants.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from tools.scenes import (
    CityConfig,
    CityLayout,
    city_cameras,
    city_layout,
    generate_city,
    sized,
)
from tools.scenes.city import GROUND, TREE
from tools.scenes.surfaces import (
    Samples,
    Surfaces,
    concat,
    quats_from_normals,
    sample_spheres,
    sample_surfaces,
)
from train.camera import Camera

_PILOT_BLOCKS = 1  # the pilot city that lends its Gaussians' scales and opacities


class PlanError(ValueError):
    """Planner input that cannot be planned; the message names the option."""


@dataclass(frozen=True)
class SampledCity:
    config: CityConfig  # the full city's
    layout: CityLayout
    splats: dict[str, np.ndarray]  # the samples, gsplat's parameters at SH degree 0
    cameras: list[Camera]
    weight: int  # Gaussians each sample stands for

    @property
    def samples(self) -> int:
        return len(self.splats["means"])

    @property
    def gaussians(self) -> int:
        return self.samples * self.weight


def _outside_footprints(layout: CityLayout, xy: np.ndarray) -> np.ndarray:  # [N, 2] -> [N] bool
    """Ground points under no building. A building stands inside its city block, so a point is
    tested against the few buildings of the block its cell of the street grid starts with."""
    cfg, bld = layout.config, layout.buildings
    n = cfg.blocks

    def cell(p: np.ndarray) -> np.ndarray:  # [M, 2] -> [M] block index, -1 off the blocks
        ij = np.floor((p - cfg.street_width) / cfg.grid_step).astype(np.int64)
        ok = ((ij >= 0) & (ij < n)).all(axis=1)
        return np.where(ok, ij[:, 0] * n + ij[:, 1], -1)

    owner = cell(bld[:, :2])
    order = np.argsort(owner, kind="stable")
    first = np.searchsorted(owner[order], np.arange(n * n))
    per = np.bincount(owner[owner >= 0], minlength=n * n)
    covered = np.zeros(len(xy), dtype=bool)
    where = cell(xy)
    on_block = where >= 0
    for j in range(int(per.max(initial=0))):  # j-th building of each point's block
        has = on_block & (per[np.maximum(where, 0)] > j)
        rows = np.flatnonzero(has)
        box = bld[order[first[where[rows]] + j]]
        covered[rows] |= ((xy[rows] >= box[:, :2]) & (xy[rows] <= box[:, 3:5])).all(axis=1)
    return ~covered


def _samples(layout: CityLayout, density: float, rng: np.random.Generator) -> Samples:
    """Poisson points at `density` on the ground outside the footprints, the building and car
    surfaces and the tree crowns: the surfaces the generator draws its Gaussians on."""
    extent = layout.config.extent
    ground = Surfaces(np.zeros((1, 3)), np.array([[extent, 0.0, 0.0]]), np.array([[0.0, extent, 0.0]]),
                      np.array([GROUND], np.int8), np.array([-1], np.int32))
    g = sample_surfaces(ground, rng, density=density)
    g = g.select(np.flatnonzero(_outside_footprints(layout, g.means[:, :2])))
    t = layout.trees
    return concat([g, sample_surfaces(layout.surfaces, rng, density=density),
                   sample_spheres(t[:, :3], t[:, 3], TREE, rng, density=density)])


def sampled_city(gaussians: float, base: CityConfig, weight: int, blocks: int | None = None) -> SampledCity:
    """`base` grown to about `gaussians` Gaussians (`tools.scenes.sized`), or of `blocks` city blocks
    a side at the density that gives that many, sampled 1 in `weight`."""
    if blocks is None:
        full = sized(base, int(gaussians), min_blocks=1)
    else:
        full = replace(base, blocks=blocks)
        full = replace(full, density=gaussians / city_layout(full).surface_area)
    return sample_city(full, weight)


def sample_city(full: CityConfig, weight: int) -> SampledCity:
    """The city of `full` (its layout and cameras), its Gaussians sampled 1 in `weight`."""
    if weight < 1:
        raise PlanError(f"sample weight must be at least 1, got {weight}")
    layout = city_layout(full)
    rng = np.random.default_rng([full.seed, 0x91A7])  # a stream of its own, apart from the generator's
    s = _samples(layout, full.density / weight, rng)
    pilot = generate_city(replace(full, blocks=_PILOT_BLOCKS, cameras=1, aerial_cameras=0))
    pick = rng.integers(0, len(pilot), len(s))
    n = len(s)
    splats = {"means": s.means.astype(np.float32), "scales": pilot.scales[pick],
              "quats": quats_from_normals(s.normals).astype(np.float32), "opacities": pilot.opacities[pick],
              "sh0": np.zeros((n, 1, 3), np.float32), "shN": np.zeros((n, 0, 3), np.float32)}
    return SampledCity(full, layout, splats, city_cameras(full), weight)
