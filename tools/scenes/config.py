"""What `make_scene` is asked for: the kinds and one validated config for all of them."""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from octree.semantics import MAX_SH_DEGREE
from tools.scenes.city import CAPTURES, CityConfig

KINDS = ("wall", "city", "object")


class SceneError(ValueError):
    """A scene that cannot be made: a bad configuration, an output folder in the way, too little disk."""


@dataclass(frozen=True)
class SceneConfig:
    """How `make_scene` builds a scene; fields left None take the kind's default (in brackets: wall, city).

    seed: the only source of randomness; the same config gives the same files, byte for byte.
    width, height: image size in pixels (160 x 120, 320 x 180).
    cameras: how many cameras (24, 64).
    gaussians: ground-truth Gaussians (30,000; for the city about this many: the city grows in
        blocks at `density` and the density is then scaled to hit N; None keeps 2 x 2 blocks at
        `CityConfig`'s 2 per m^2, about 126k Gaussians).
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
    City only (the dataset is generated block by block, see `tools.scenes.city_dataset`):
    work: folder for the ground-truth store and scratch files (default: OUT.work beside OUT).
    clean: remove what the run made under `work` (the ground-truth store too) once the dataset is written.
    cache_mb: block cache budget for rendering the ground-truth images by paging its store.
    aerial: share of the cameras that look down on the city from above instead of standing on a street.
    block_gaussians: expected Gaussians per generation tile (a column of ground-truth blocks); what
        one tile holds in memory.
    capture: "street" (street cameras plus the `aerial` share) or "survey": a drone's double-grid
        oblique survey (`tools.scenes.city.survey_cameras`) whose images each see a bounded patch of
        the city however large it grows; its camera count follows from the city's size, `altitude`
        (metres), `pitch` (degrees, negative is down) and `overlap` (between neighbouring images),
        so `cameras` must be left unset.
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
    work: Path | None = None
    clean: bool = False
    cache_mb: float = 256.0
    aerial: float = 0.125
    block_gaussians: int = 32768
    capture: str = CityConfig.capture
    altitude: float = CityConfig.survey_altitude
    pitch: float = CityConfig.survey_pitch
    overlap: float = CityConfig.survey_overlap

    def __post_init__(self) -> None:
        for name in ("width", "height", "cameras", "gaussians", "block_gaussians"):
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
        if not self.cache_mb > 0:
            raise SceneError(f"scene config: cache_mb must be positive, got {self.cache_mb}")
        if not 0.0 <= self.aerial < 1.0:
            raise SceneError(f"scene config: aerial must be in [0, 1), got {self.aerial}")
        if self.capture not in CAPTURES:
            raise SceneError(f"scene config: capture must be one of {', '.join(CAPTURES)}, got {self.capture!r}")
        if self.capture == "survey" and self.cameras is not None:
            raise SceneError(f"scene config: a survey's camera count follows from the city's size, altitude and "
                             f"overlap; leave cameras unset (got {self.cameras})")

    def resolved(self, kind: str) -> "SceneConfig":
        """This config with the kind's defaults filled in."""
        if kind not in KINDS:
            raise SceneError(f"unknown scene kind {kind!r} (choose from {', '.join(KINDS)})")
        width, height, cameras, gaussians = {"wall": (160, 120, 24, 30_000), "city": (320, 180, 64, None),
                                             "object": (160, 120, 32, 30_000)}[kind]
        if kind != "city" and self.capture != "street":
            raise SceneError(f"scene config: capture {self.capture!r} is the city's; the {kind} has its own cameras")
        survey = self.capture == "survey"
        return replace(self, width=self.width or width, height=self.height or height,
                       cameras=None if survey else self.cameras or cameras, gaussians=self.gaussians or gaussians)
