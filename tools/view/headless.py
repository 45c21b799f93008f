"""`--render` and `--map`: PNGs for reports and machines without a screen."""
from __future__ import annotations

import resource
from pathlib import Path

import numpy as np
from PIL import Image
from torch import Tensor

from storage import Store
from tools.view.cameras import DatasetCameras, select
from tools.view.colour import block_colours
from tools.view.config import ViewConfig, ViewError
from tools.view.draw import draw_map, draw_outlines
from tools.view.render import FrustumRenderer
from tools.view.scene import BlockScene


def to_uint8(rgb: Tensor) -> np.ndarray:  # [H, W, 3] float in [0, 1] -> [H, W, 3] uint8
    return (rgb.detach().cpu().numpy() * 255.0 + 0.5).astype(np.uint8)


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def render_cameras(cfg: ViewConfig, store: Store, scene: BlockScene, data: DatasetCameras | None) -> list[Path]:
    """One PNG per camera of `--cameras` under `--render`; returns their paths."""
    assert cfg.render is not None
    cameras = select(cfg.cameras, scene.bounds(), scene.up, data, cfg.width, cfg.height)
    out = Path(cfg.render)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ViewError(f"--render {out}: {e.strerror}") from e
    renderer = FrustumRenderer(store, cfg.cache_bytes, cfg.device, lod_pixels=cfg.lod_pixels,
                               occlusion=cfg.occlusion == "on")
    colours = block_colours(scene, "owner")
    paths = []
    try:
        for stem, camera in cameras:
            rgb, stats = renderer.render(camera)
            image = to_uint8(rgb)
            if cfg.outline:
                image = draw_outlines(image, camera, scene.cells, colours)
            path = out / f"{stem}.png"
            Image.fromarray(image).save(path)
            paths.append(path)
            print(f"{path}: {stats.summary()}", flush=True)
    finally:
        renderer.close()
    return paths


def write_map(cfg: ViewConfig, scene: BlockScene) -> Path:
    assert cfg.map is not None
    image, _ = draw_map(scene, size=cfg.width or 1024)
    path = Path(cfg.map)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).save(path)
    except (OSError, ValueError) as e:
        raise ViewError(f"--map {path}: {e}") from e
    print(f"{path}: {len(scene.rows)} blocks of commit {scene.head} coloured by owner among {scene.ranks} ranks",
          flush=True)
    return path
