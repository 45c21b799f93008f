"""The one surface sampler: Gaussians placed uniformly on parallelograms and spheres, lying flat in them.

Every scene kind describes its geometry as `Surfaces` (parallelograms origin + a u + b v, a and b
in [0, 1]) and optionally spheres, draws positions with `sample_surfaces` / `sample_spheres`, and
turns the samples into gsplat's parameters with `flat_splats`. A city is sampled tile by tile:
`Surfaces.clipped` cuts its axis-aligned parallelograms to a tile, so the samples of a tile are a
Poisson process on the tile's part of each surface, and the tiles together are one on the whole.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TypeVar

import numpy as np

from octree.semantics import SH_C0, num_sh_bases

THIN = 0.1  # a surface Gaussian's normal sigma relative to its in-plane sigma: it lies flat


@dataclass(frozen=True)
class Surfaces:
    """Parallelograms origin + a u + b v (a, b in [0, 1]) and what each belongs to."""

    origin: np.ndarray  # [S, 3] float64
    u: np.ndarray  # [S, 3]
    v: np.ndarray  # [S, 3]
    kind: np.ndarray  # [S] int8: what the surface is (the scene's own codes)
    part: np.ndarray  # [S] int32: which object of its kind (building, car, face) it belongs to

    def __len__(self) -> int:
        return len(self.origin)

    @property
    def normals(self) -> np.ndarray:  # [S, 3] unit, u x v
        n = np.cross(self.u, self.v)
        return n / np.linalg.norm(n, axis=1, keepdims=True)

    @property
    def areas(self) -> np.ndarray:  # [S]
        return np.linalg.norm(np.cross(self.u, self.v), axis=1)

    def select(self, rows: np.ndarray) -> "Surfaces":
        return Surfaces(*(getattr(self, f.name)[rows] for f in fields(self)))

    def clipped(self, lo: np.ndarray, hi: np.ndarray) -> "Surfaces":  # lo, hi [2]: an x-y tile [lo, hi)
        """The parts of axis-aligned parallelograms (u and v each along one axis) over the tile.
        A surface lying in a tile face (a wall at x = lo) belongs to the tile the face starts."""
        if len(self) == 0:
            return self
        origin, u, v = self.origin.copy(), self.u.copy(), self.v.copy()
        keep = np.ones(len(self), dtype=bool)
        spanned = np.zeros((len(self), 2), dtype=bool)  # which of x and y u or v runs along
        for w in (u, v):
            axis = np.argmax(np.abs(w), axis=1)
            for a in (0, 1):
                rows = np.flatnonzero(axis == a)
                spanned[rows, a] = True
                o, d = origin[rows, a], w[rows, a]
                t0, t1 = (lo[a] - o) / d, (hi[a] - o) / d
                start, end = np.clip(np.minimum(t0, t1), 0, 1), np.clip(np.maximum(t0, t1), 0, 1)
                keep[rows] &= end > start
                origin[rows] += start[:, None] * w[rows]
                w[rows] *= (end - start)[:, None]
        for a in (0, 1):  # a surface not spanning x (or y) must stand inside the tile along it
            rows = ~spanned[:, a]
            keep[rows] &= (origin[rows, a] >= lo[a]) & (origin[rows, a] < hi[a])
        return Surfaces(origin[keep], u[keep], v[keep], self.kind[keep], self.part[keep])


_T = TypeVar("_T")


def concat(items: list[_T]) -> _T:
    """Row-wise concatenation of dataclasses of arrays (all of one type)."""
    return type(items[0])(*(np.concatenate([getattr(x, f.name) for x in items]) for f in fields(items[0])))


@dataclass(frozen=True)
class Samples:
    """Points drawn on surfaces: where, which way the surface faces, and what it is."""

    means: np.ndarray  # [N, 3] float64
    normals: np.ndarray  # [N, 3] unit
    kind: np.ndarray  # [N] int8
    part: np.ndarray  # [N] int32

    def __len__(self) -> int:
        return len(self.means)

    def select(self, rows: np.ndarray) -> "Samples":
        return Samples(*(getattr(self, f.name)[rows] for f in fields(self)))


def sample_surfaces(s: Surfaces, rng: np.random.Generator, density: float | None = None,
                    count: int | None = None) -> Samples:
    """Uniform points on the surfaces: Poisson(area x density) on each (a city, sampled in tiles),
    or exactly `count` shared out by area (a scene with a fixed number of Gaussians)."""
    if (density is None) == (count is None):
        raise ValueError("sample_surfaces: give exactly one of density and count")
    area = s.areas
    if density is not None:
        per = rng.poisson(area * density)
    else:
        per = rng.multinomial(count, area / area.sum()) if len(area) else np.zeros(0, np.int64)
    which = np.repeat(np.arange(len(s)), per)
    a, b = rng.uniform(0.0, 1.0, (2, len(which), 1))
    means = s.origin[which] + a * s.u[which] + b * s.v[which]
    return Samples(means, s.normals[which], s.kind[which], s.part[which])


def sample_spheres(centres: np.ndarray, radii: np.ndarray, kind: int, rng: np.random.Generator,
                   density: float | None = None, count: int | None = None) -> Samples:  # [T, 3], [T]
    """Uniform points on spheres, Poisson(area x density) on each or exactly `count` by area."""
    if (density is None) == (count is None):
        raise ValueError("sample_spheres: give exactly one of density and count")
    area = 4 * np.pi * radii**2
    per = rng.poisson(area * density) if density is not None else rng.multinomial(count, area / area.sum())
    which = np.repeat(np.arange(len(centres)), per)
    normals = rng.standard_normal((len(which), 3))
    normals /= np.linalg.norm(normals, axis=1, keepdims=True)
    means = centres[which] + radii[which, None] * normals
    return Samples(means, normals, np.full(len(which), kind, np.int8), which.astype(np.int32))


def quats_from_normals(normals: np.ndarray) -> np.ndarray:  # [N, 3] unit -> [N, 4] wxyz
    """The shortest rotation taking +z (a flat Gaussian's thin axis) onto each normal:
    q = (1 + z.n, z x n), normalised; for n = -z, half a turn about x."""
    q = np.stack([1.0 + normals[:, 2], -normals[:, 1], normals[:, 0], np.zeros(len(normals))], 1)
    flipped = q[:, 0] < 1e-9
    q[flipped] = (0.0, 1.0, 0.0, 0.0)
    return q / np.linalg.norm(q, axis=1, keepdims=True)


def flat_splats(samples: Samples, colors: np.ndarray, sigma: float, rng: np.random.Generator,
                sh_degree: int = 0, view_dependence: float = 0.0) -> dict[str, np.ndarray]:  # colors [N, 3]
    """gsplat's parameters (float32, storage conventions) of Gaussians flat in their surfaces:
    in-plane sigma `sigma` x lognormal(0.2), normal sigma THIN of that, opacity logits N(2.5, 0.7),
    degree-0 colour `colors`, SH above degree 0 N(0, view_dependence)."""
    n = len(samples)
    s = sigma * np.exp(rng.normal(0.0, 0.2, (n, 1)))
    opacities = rng.normal(2.5, 0.7, n)
    sh_rest = view_dependence * rng.standard_normal((n, num_sh_bases(sh_degree) - 1, 3))
    return {
        "means": samples.means.astype(np.float32),
        "scales": np.log(s * np.array([1.0, 1.0, THIN])).astype(np.float32),
        "quats": quats_from_normals(samples.normals).astype(np.float32),
        "opacities": opacities.astype(np.float32),
        "sh0": ((np.asarray(colors, np.float32) - np.float32(0.5)) / np.float32(SH_C0)).reshape(n, 1, 3),
        "shN": sh_rest.astype(np.float32),
    }


def colors_of(splats: dict[str, np.ndarray]) -> np.ndarray:  # -> [N, 3] view-independent colour in [0, 1]
    return np.clip(splats["sh0"][:, 0] * SH_C0 + 0.5, 0.0, 1.0)
