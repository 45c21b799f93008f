"""`make_scene`: a generated scene rendered and written as a nerfstudio dataset.

`wall` and `object` are built whole in memory (tens of thousands of Gaussians) and keep their ground
truth in ground_truth.npz; `city` is generated, written and rendered block by block
(`tools.scenes.city_dataset`), at any size.
"""
from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from tools.scenes import city_dataset
from tools.scenes.cameras import holdout_slots
from tools.scenes.config import SceneConfig, SceneError
from tools.scenes.files import (GROUND_TRUTH, POINTS, check_output, partial_dir, replace_dir, save_png,
                                write_npz, write_points, write_transforms)
from tools.scenes.object import object_cameras, object_gaussians
from tools.scenes.surfaces import colors_of
from tools.scenes.wall import wall_cameras, wall_gaussians
from train.camera import Camera
from train.render import render


@dataclass(frozen=True, eq=False)
class GroundTruth:
    """Ground-truth Gaussians (gsplat's names and storage conventions, float32) and the cameras
    in the order they stand (along the row, or round the object)."""

    splats: dict[str, np.ndarray]
    cameras: list[Camera]
    sh_degree: int

    @property
    def colors(self) -> np.ndarray:  # [N, 3] view-independent colour in [0, 1]
        return colors_of(self.splats)


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
    ground_truth: Path | None = None  # the city's ground-truth store (None: removed by clean, or npz kinds)
    phases: dict[str, float] | None = None  # the city's seconds per phase (ground_truth, images)
    peak_rss: dict[str, int] | None = None  # the city's peak RSS (bytes) at the end of each phase
    blocks: int = 0  # the city's ground-truth blocks
    largest_view: int = 0  # the city's most 2D splats in one view


def build_scene(kind: str, cfg: SceneConfig = SceneConfig()) -> GroundTruth:
    """The ground truth of the wall or the object: Gaussians and cameras (nothing rendered or written)."""
    cfg = cfg.resolved(kind)
    if kind == "city":
        raise SceneError("build_scene: the city is generated block by block; use tools.scenes.generate_city "
                         "for one in memory")
    rng = np.random.default_rng(cfg.seed)
    if kind == "wall":
        splats, cameras = wall_gaussians(cfg, rng), wall_cameras(cfg, rng)
    else:
        splats, cameras = object_gaussians(cfg, rng), object_cameras(cfg, rng)
    return GroundTruth(splats, cameras, cfg.sh_degree)


def named(cameras: list[Camera], kind: str, test_every: int) -> list[Camera]:
    """The cameras (in the order they stand) named so that held-out names stand between training ones."""
    slots = holdout_slots(len(cameras), test_every)
    return [replace(cameras[s], image_id=i, name=f"images/{kind}_{i:04d}.png") for i, s in enumerate(slots)]


def test_names(cameras: list[Camera], test_every: int) -> list[str]:
    return [c.name for i, c in enumerate(cameras) if test_every and i % test_every == 0]


def make_scene(kind: str, out_dir: str | os.PathLike, cfg: SceneConfig = SceneConfig()) -> SceneInfo:
    """Render scene `kind` and write it to `out_dir` as a nerfstudio dataset (transforms.json, images/,
    points3d.ply) plus its ground truth. The folder appears complete or not at all."""
    start = time.perf_counter()
    cfg = cfg.resolved(kind)
    out = Path(out_dir)
    if kind == "city":
        made = city_dataset.make_city(out, cfg)
        return SceneInfo(kind, out, made.cameras, test_names(made.cameras, cfg.test_every), made.gaussians,
                         made.points, made.visible, time.perf_counter() - start, made.ground_truth, made.seconds,
                         made.peak_rss, made.blocks, made.largest_view)
    check_output(out, cfg.overwrite)
    gt = build_scene(kind, cfg)
    cameras = named(gt.cameras, kind, cfg.test_every)
    rng = np.random.default_rng([cfg.seed, 1])  # a stream of its own: the point cloud does not shift the scene
    points, colors = initial_points(gt.splats["means"], gt.colors, cfg, rng)
    partial = partial_dir(out)
    shutil.rmtree(partial, ignore_errors=True)
    try:
        (partial / "images").mkdir(parents=True)
        visible = _render_images(gt, cameras, cfg.background, partial)
        write_transforms(partial / "transforms.json", cameras)
        write_points(partial / POINTS, points, colors)
        _write_ground_truth(partial / GROUND_TRUTH, gt, cameras, kind, cfg)
        replace_dir(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return SceneInfo(kind, out, cameras, test_names(cameras, cfg.test_every), len(gt.splats["means"]),
                     len(points), visible, time.perf_counter() - start)


def initial_points(means: np.ndarray, colors: np.ndarray, cfg: SceneConfig, rng: np.random.Generator,
                   count: int | None = None) -> tuple[np.ndarray, np.ndarray]:  # means [N, 3], colors [N, 3]
    """A noisy subsample of the ground truth, as SfM would give: xyz [P, 3] float32, rgb [P, 3] uint8;
    P = `count`, or the config's share of N."""
    count = max(1, round(cfg.point_fraction * len(means))) if count is None else count
    keep = np.sort(rng.choice(len(means), count, replace=False))
    xyz = means[keep] + rng.normal(0.0, cfg.point_noise, (len(keep), 3))
    rgb = colors[keep] * 255.0 + rng.normal(0.0, cfg.color_noise, (len(keep), 3))
    return xyz.astype(np.float32), np.clip(np.round(rgb), 0, 255).astype(np.uint8)


def _render_images(gt: GroundTruth, cameras: list[Camera], background: tuple[float, float, float],
                   folder: Path) -> np.ndarray:  # -> [C] visible share per camera
    splats = {k: torch.from_numpy(v) for k, v in gt.splats.items()}
    visible = np.zeros(len(cameras))
    with torch.no_grad():
        for i, cam in enumerate(cameras):
            rgb, _, meta = render(splats, cam, gt.sh_degree, background, backend="cpu")
            save_png(rgb.numpy(), folder / cam.name)
            visible[i] = len(meta["ids"]) / len(gt.splats["means"])
    return visible


def _write_ground_truth(path: Path, gt: GroundTruth, cameras: list[Camera], kind: str, cfg: SceneConfig) -> None:
    arrays = dict(gt.splats)
    arrays.update(
        viewmats=np.stack([c.viewmat for c in cameras]), Ks=np.stack([c.K for c in cameras]),
        names=np.array([c.name for c in cameras]), width=np.array(cfg.width), height=np.array(cfg.height),
        sh_degree=np.array(gt.sh_degree), background=np.array(cfg.background), seed=np.array(cfg.seed),
        kind=np.array(kind),
    )
    write_npz(path, arrays)
