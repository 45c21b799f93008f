"""Procedural colours: functions of where a Gaussian lies (no random state), so a surface's texture
is the same whichever tile or order it is generated in. Detail at several scales (courses, windows,
tiles, value noise down to 10 cm), so a blurry fit scores a low PSNR and training has something to learn."""
from __future__ import annotations

import numpy as np

_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)


def lattice_hash(ijk: np.ndarray, salt: int = 0) -> np.ndarray:  # [N, D] int -> [N] in [0, 1)
    """A hash of integer lattice points (splitmix64 of their mixed coordinates)."""
    h = np.full(len(ijk), np.uint64(salt * 0x9E3779B97F4A7C15 & 0xFFFFFFFFFFFFFFFF), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for d in range(ijk.shape[1]):
            h = (h ^ ijk[:, d].astype(np.int64).astype(np.uint64)) * np.uint64(0xBF58476D1CE4E5B9)
            h ^= h >> np.uint64(31)
        h = (h ^ (h >> np.uint64(30))) * np.uint64(0x94D049BB133111EB)
        h ^= h >> np.uint64(27)
    return (h >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def value_noise(xy: np.ndarray, scale: float, salt: int = 0) -> np.ndarray:  # [N, 2] metres -> [N] in [0, 1]
    """Smoothly interpolated lattice noise with features of `scale` metres."""
    p = xy / scale
    i = np.floor(p).astype(np.int64)
    f = p - i
    f = f * f * (3 - 2 * f)
    corner = [lattice_hash(i + d, salt) for d in ([0, 0], [1, 0], [0, 1], [1, 1])]
    bottom = corner[0] + (corner[1] - corner[0]) * f[:, 0]
    top = corner[2] + (corner[3] - corner[2]) * f[:, 0]
    return bottom + (top - bottom) * f[:, 1]


def grain(xy: np.ndarray, salt: int = 0) -> np.ndarray:  # [N, 2] -> [N] in about [-1, 1]
    """Fine variation of a material: noise at 2 m, 0.5 m and 0.12 m."""
    octaves = ((0.5, 2.0), (0.3, 0.5), (0.2, 0.12))  # (weight, feature size in metres)
    return sum(w * (2 * value_noise(xy, s, salt + k) - 1) for k, (w, s) in enumerate(octaves))


def palette(t: np.ndarray) -> np.ndarray:  # [N] -> [N, 3] in [0.15, 0.85]
    """A rainbow along t (period 1)."""
    return 0.5 + 0.35 * np.cos(2 * np.pi * (t[:, None] + np.array([0.0, 1 / 3, 2 / 3])))


def brick_facade(x: np.ndarray, z: np.ndarray, length: float) -> np.ndarray:  # [N], [N] -> [N, 3]
    """The wall kind: brick courses (0.5 x 0.25 m, alternate rows offset) over a rainbow, two storeys
    of dark windows, and light pilasters every 5 m."""
    row = np.floor(z / 0.25)
    brick = np.floor(x / 0.5 + 0.5 * (row % 2))
    shade = np.where((brick + row) % 2 == 0, 1.0, 0.75)
    colors = palette(x / length) * shade[:, None]
    window = (np.abs((x % 2.5) - 1.25) < 0.5) & ((np.abs(z - 1.3) < 0.6) | (np.abs(z - 3.1) < 0.6))
    colors[window] = (0.12, 0.16, 0.25)
    colors[np.abs((x % 5.0) - 2.5) > 2.35] = (0.9, 0.88, 0.8)
    return colors


def paving_with_line(x: np.ndarray, y: np.ndarray) -> np.ndarray:  # [N], [N] -> [N, 3]
    """The wall kind's ground: grey paving with a dashed yellow line along the wall."""
    colors = np.tile([0.35, 0.35, 0.37], (len(x), 1))
    colors[(np.abs(y + 0.6) < 0.08) & (x % 2.0 < 1.0)] = (0.9, 0.75, 0.1)
    return colors


# ---- the city ----

FLOOR = 3.2  # storey height (m)
_WINDOW_PITCH = 2.6  # window centres along a facade (m)
_GLASS = np.array([0.10, 0.13, 0.20])
_LIT = np.array([0.85, 0.72, 0.40])


def city_facade(along: np.ndarray, z: np.ndarray, height: np.ndarray, base: np.ndarray,
                building: np.ndarray) -> np.ndarray:  # [N] each, base [N, 3] -> [N, 3]
    """Plaster of the building's colour with grain, a dark shopfront band, a window per bay and
    storey (some lit), sills, and a light cornice under the roof."""
    g = grain(np.column_stack([along, z]), salt=1)
    colors = base * (1.0 + 0.12 * g)[:, None]
    storey = np.floor(z / FLOOR)
    bay = np.floor(along / _WINDOW_PITCH)
    in_bay, in_storey = along - bay * _WINDOW_PITCH, z - storey * FLOOR
    window = (storey >= 1) & (np.abs(in_bay - _WINDOW_PITCH / 2) < 0.7) & (in_storey > 0.9) & (in_storey < 2.5) \
        & (z < height - 1.0)
    pick = lattice_hash(np.column_stack([building, bay, storey]), salt=2)
    glass = np.where((pick < 0.15)[:, None], _LIT, _GLASS * (0.7 + 0.6 * pick)[:, None])
    colors = np.where(window[:, None], glass, colors)
    sill = (storey >= 1) & (np.abs(in_bay - _WINDOW_PITCH / 2) < 0.8) & (np.abs(in_storey - 0.82) < 0.08)
    colors[sill] = 0.85
    shop = z < FLOOR * 0.9
    shop_glass = np.abs(in_bay - _WINDOW_PITCH / 2) < 1.0
    colors[shop & shop_glass] = (_GLASS * 1.6)
    colors[shop & ~shop_glass] *= 0.55
    colors[z > height - 0.6] = (0.88, 0.86, 0.80)
    return np.clip(colors, 0.0, 1.0)


def city_roof(xy: np.ndarray) -> np.ndarray:  # [N, 2] -> [N, 3]
    g = grain(xy, salt=5)
    return np.clip(np.array([0.42, 0.40, 0.38]) * (1 + 0.2 * g)[:, None], 0, 1)


def city_ground(xy: np.ndarray, street: np.ndarray, kerb: np.ndarray, lane: np.ndarray,
                crossing: np.ndarray) -> np.ndarray:  # [N, 2], masks [N] -> [N, 3]
    """Asphalt with dashed centre lines and zebra crossings on the streets, tiled pavements along
    the kerbs, and grass inside the city blocks."""
    g = grain(xy, salt=7)
    asphalt = np.array([0.24, 0.24, 0.26]) * (1 + 0.25 * g)[:, None]
    tiles = (np.mod(xy, 0.6) < 0.03).any(axis=1)
    paving = np.array([0.55, 0.52, 0.48]) * (1 + 0.1 * g)[:, None] * np.where(tiles, 0.8, 1.0)[:, None]
    grass = np.array([0.25, 0.42, 0.16]) * (1 + 0.35 * g)[:, None]
    colors = np.where(street[:, None], np.where(kerb[:, None], paving, asphalt), grass)
    colors[lane] = (0.85, 0.82, 0.7)
    colors[crossing] = (0.9, 0.9, 0.88)
    return np.clip(colors, 0.0, 1.0)


def city_tree(xyz: np.ndarray) -> np.ndarray:  # [N, 3] -> [N, 3]
    g = grain(xyz[:, :2] + xyz[:, 2:] * 0.7, salt=9)
    return np.clip(np.array([0.2, 0.45, 0.15]) * (1 + 0.4 * g)[:, None], 0, 1)


def city_car(z: np.ndarray, bottom: np.ndarray, base: np.ndarray) -> np.ndarray:  # [N], [N], [N, 3] -> [N, 3]
    """Body colour, dark windows in the upper part."""
    window = z - bottom > 0.7
    return np.where(window[:, None], np.array([0.08, 0.1, 0.12]), base)
