"""The `object` kind: a 2 m brick cube with a 0.7 m ball on top, seen from all round by cameras on a
sphere 8 m away; the one scene whose cameras enclose it, so a tiler's random initial points (drawn
in the box around the cameras, `tools.tile --init-random`) surround it as they would a
NeRF-synthetic object. Metres, z up, the cube centred at the origin."""
from __future__ import annotations

import numpy as np

from tools.scenes.cameras import look_at, pinhole_K
from tools.scenes.config import SceneConfig
from tools.scenes.surfaces import Surfaces, concat, flat_splats, sample_spheres, sample_surfaces
from tools.scenes.textures import brick_facade, palette
from tools.scenes.wall import OVERLAP
from train.camera import Camera

CUBE = 2.0
BALL = 0.7
_ORBIT = 8.0
_ELEVATION = (-35.0, 50.0)  # degrees: the box round the cameras holds the object with room to spare
_FOV_X = 40.0  # the object fills about half of the image's width
_SIDE, _TOP, _BALL = 0, 1, 2
# The six faces: outward normal, then the in-face axis "across" (u); v = normal x across.
_NORMALS = np.array([[1, 0, 0], [0, 1, 0], [-1, 0, 0], [0, -1, 0], [0, 0, 1], [0, 0, -1]], float)
_ACROSS = np.array([[0, 1, 0], [-1, 0, 0], [0, -1, 0], [1, 0, 0], [1, 0, 0], [1, 0, 0]], float)


def cube_surfaces() -> Surfaces:
    h = CUBE / 2
    up = np.cross(_NORMALS, _ACROSS)
    return Surfaces(origin=h * (_NORMALS - _ACROSS - up), u=CUBE * _ACROSS, v=CUBE * up,
                    kind=np.array([_SIDE] * 4 + [_TOP] * 2, np.int8), part=np.arange(6, dtype=np.int32))


def object_gaussians(cfg: SceneConfig, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Flat Gaussians on the cube's faces (the wall's bricks and windows running round the sides, a
    rainbow on top and bottom) and on the ball (colour bands by latitude and longitude), by area."""
    h = CUBE / 2
    faces = cube_surfaces()
    centre, radius = np.array([[0.0, 0.0, h + BALL]]), np.array([BALL])
    cube_area, ball_area = faces.areas.sum(), 4 * np.pi * BALL**2
    n_cube = int(round(cfg.gaussians * cube_area / (cube_area + ball_area)))
    s = concat([sample_surfaces(faces, rng, count=n_cube),
                sample_spheres(centre, radius, _BALL, rng, count=cfg.gaussians - n_cube)])
    face = s.part
    u = ((s.means - h * _NORMALS[face % 6]) * _ACROSS[face % 6]).sum(axis=1)  # in [-h, h] across the face
    v = s.means[:, 2]
    # Along the sides u runs once round the cube (8 m), so the bricks continue from face to face.
    side = brick_facade(face * CUBE + u + h, v + h, 4 * CUBE)
    top = palette((u + (s.means * np.cross(_NORMALS[face % 6], _ACROSS[face % 6])).sum(axis=1)) / CUBE) * 0.8
    lat, lon = np.arcsin(np.clip(s.normals[:, 2], -1, 1)), np.arctan2(s.normals[:, 1], s.normals[:, 0])
    ball = palette(lon / (2 * np.pi)) * np.where(np.floor(lat / 0.3) % 2 == 0, 1.0, 0.55)[:, None]
    colors = np.select([s.kind[:, None] == _SIDE, s.kind[:, None] == _TOP], [side, top], ball)
    colors = np.clip(colors + rng.normal(0.0, 0.03, colors.shape), 0.0, 1.0)
    spacing = 1.0 / np.sqrt(cfg.gaussians / (cube_area + ball_area))
    return flat_splats(s, colors, OVERLAP * spacing, rng, cfg.sh_degree, cfg.view_dependence)


def object_cameras(cfg: SceneConfig, rng: np.random.Generator) -> list[Camera]:
    """Round the object in azimuth (in sequence, so held-out cameras stand between training
    ones), each at a random elevation, looking at a jittered point near its middle."""
    n = cfg.cameras
    azimuth = np.linspace(0.0, 2 * np.pi, n, endpoint=False) + rng.uniform(-0.05, 0.05, n)
    elevation = np.radians(rng.uniform(*_ELEVATION, n))
    eye = _ORBIT * np.column_stack([np.cos(elevation) * np.cos(azimuth), np.cos(elevation) * np.sin(azimuth),
                                    np.sin(elevation)])
    target = rng.normal(0.0, 0.15, (n, 3)) + [0.0, 0.0, BALL / 2]
    K = pinhole_K(cfg.width, cfg.height, _FOV_X)
    return [Camera(look_at(eye[i], target[i]), K, cfg.width, cfg.height) for i in range(n)]
