"""The `wall` kind: a 60 m x 4 m textured facade with a ground strip, seen by a row of cameras 5-6 m away.

Metres, z up: the facade is the plane y = 0, x in [0, wall_length], z in [0, HEIGHT], facing -y;
the ground strip is z = 0, y in [-GROUND_DEPTH, 0]; the cameras stand in a row at y < 0.
"""
from __future__ import annotations

import numpy as np

from tools.scenes.cameras import heading_cameras
from tools.scenes.config import SceneConfig
from tools.scenes.surfaces import Surfaces, flat_splats, sample_surfaces
from tools.scenes.textures import brick_facade, paving_with_line
from train.camera import Camera

HEIGHT = 4.0
GROUND_DEPTH = 2.0
# Every camera sees the wall from its foot to its top and a strip of ground, 11-13% of the wall's length.
_FOV_X = 65.0  # degrees (vertical: 51 degrees at 4:3)
_CAMERA_DISTANCE = (5.0, 6.0)  # metres from the wall, uniform per camera
_CAMERA_HEIGHT = (1.9, 2.1)
_CAMERA_PITCH = (-2.5, -1.0)  # degrees, slightly down: the wall's top stays in view, the ground comes in
_CAMERA_YAW = 5.0  # degrees of jitter either side of facing the wall
_ROW_MARGIN = 3.5  # the row's end cameras stand this far inside the wall's ends and see to them
OVERLAP = 0.8  # in-plane sigma relative to the mean spacing of the Gaussians, so neighbours overlap
_FACADE, _GROUND = 0, 1


def wall_surfaces(length: float) -> Surfaces:
    """The facade (normal -y: u along x, v up) and the ground strip (normal +z)."""
    return Surfaces(origin=np.array([[0.0, 0.0, 0.0], [0.0, -GROUND_DEPTH, 0.0]]),
                    u=np.array([[length, 0.0, 0.0], [length, 0.0, 0.0]]),
                    v=np.array([[0.0, 0.0, HEIGHT], [0.0, GROUND_DEPTH, 0.0]]),
                    kind=np.array([_FACADE, _GROUND], np.int8), part=np.zeros(2, np.int32))


def wall_gaussians(cfg: SceneConfig, rng: np.random.Generator) -> dict[str, np.ndarray]:
    surfaces = wall_surfaces(cfg.wall_length)
    s = sample_surfaces(surfaces, rng, count=cfg.gaussians)
    x, y, z = s.means.T
    on_wall = s.kind == _FACADE
    colors = np.where(on_wall[:, None], brick_facade(x, z, cfg.wall_length), paving_with_line(x, y))
    colors = np.clip(colors + rng.normal(0.0, 0.03, colors.shape), 0.0, 1.0)
    spacing = 1.0 / np.sqrt(cfg.gaussians / surfaces.areas.sum())
    return flat_splats(s, colors, OVERLAP * spacing, rng, cfg.sh_degree, cfg.view_dependence)


def wall_cameras(cfg: SceneConfig, rng: np.random.Generator) -> list[Camera]:
    n = cfg.cameras
    x = np.linspace(_ROW_MARGIN, cfg.wall_length - _ROW_MARGIN, n)
    eye = np.column_stack([x, -rng.uniform(*_CAMERA_DISTANCE, n), rng.uniform(*_CAMERA_HEIGHT, n)])
    yaw = np.radians(90.0 + rng.uniform(-_CAMERA_YAW, _CAMERA_YAW, n))
    pitch = np.radians(rng.uniform(*_CAMERA_PITCH, n))
    return heading_cameras(eye, yaw, pitch, cfg.width, cfg.height, _FOV_X)
