"""Scene generation: every generated scene, dataset and synthetic input of the project.

- `surfaces`: the one surface sampler (parallelograms, spheres, flat Gaussians) every kind uses;
- `textures`: procedural colours; `cameras`: poses, intrinsics, hold-out naming, coverage;
- `wall`, `object`, `city`: the kinds' geometry and cameras (`city` also tiles itself);
- `make` (`make_scene`), `city_dataset` (the city written block by block), `files` (the writers);
- `grid`: wall-grid datasets for the trainer benchmarks; `synthetic`: point clouds, random
  splats and store blocks without a scene.
- `walled`: an opaque wall with a gap and clusters hidden behind it (occlusion culling's tests
  and benchmark).

`python -m tools.make_scene` is the command line. For a street-level city in Python:
`generate_city(CityConfig(blocks=2, cameras=16, width=320, height=180))` (in memory), or
`make_scene("city", out, SceneConfig(gaussians=200_000))` (a dataset with a ground-truth store);
`capture="survey"` in either gives a drone's oblique survey instead (`survey_cameras`).
"""
from tools.scenes.cameras import holdout_slots, look_at, pinhole_K
from tools.scenes.city import (CAR, FACADE, GROUND, ROOF, TREE, City, CityConfig, CityError, CityLayout, CityTile,
                               city_cameras, city_layout, city_tile, city_tiles, generate_city, sized, survey_cameras,
                               survey_footprint)
from tools.scenes.city_dataset import CityDataset, city_config, make_city
from tools.scenes.config import KINDS, SceneConfig, SceneError
from tools.scenes.files import GROUND_TRUTH, POINTS, SCENE_JSON
from tools.scenes.grid import WALL_GAP, make_wall, wall_grid, wall_points
from tools.scenes.make import GroundTruth, SceneInfo, build_scene, make_scene
from tools.scenes.synthetic import clustered_points, random_colors, random_splats, scene_block

__all__ = [
    "CAR", "FACADE", "GROUND", "GROUND_TRUTH", "KINDS", "POINTS", "ROOF", "SCENE_JSON", "TREE", "WALL_GAP",
    "City", "CityConfig", "CityDataset", "CityError", "CityLayout", "CityTile", "GroundTruth", "SceneConfig",
    "SceneError", "SceneInfo", "build_scene", "city_cameras", "city_config", "city_layout", "city_tile",
    "city_tiles", "clustered_points", "generate_city", "holdout_slots", "look_at", "make_city", "make_scene",
    "make_wall", "pinhole_K", "random_colors", "random_splats", "scene_block", "sized", "survey_cameras",
    "survey_footprint", "wall_grid", "wall_points",
]
