"""The city kind: a full dataset at any size, generated, written and rendered block by block.

1. The layout (buildings, trees, cars: a few arrays per city block) and candidate cameras, street
   level and aerial (or the survey's flight, `capture="survey"`), are made whole; they are small.
2. The Gaussians are made one tile at a time (`tools.scenes.city.city_tile`, a column of octree
   cells) and written as blocks of the ground-truth store (`storage.Store`, one commit at the end),
   while the tile's means mark which cells of each candidate camera's coarse image grid the city
   fills and a noisy subsample of it goes to the point cloud's scratch file.
3. The cameras that the city fills best are kept (a survey keeps its whole flight, in flight order)
   and named for hold-out; their images are rendered
   from the store by `tools.view.render.FrustumRenderer`, which pages the blocks in each camera's
   frustum through a params-only `BlockCache` of `cache_mb`: the viewer's renderer, not a second one.
4. transforms.json, points3d.ply and scene.json complete the dataset, which appears at OUT at once.

Generating the ground truth takes one tile's memory plus the layout, whatever the number of
Gaussians. Rendering takes the cache budget plus the 2D splats of the view being rendered: a street
camera looking along a straight street has most of the city in its frustum, and nothing culls what
the buildings hide, so that part grows with the city (docs/benchmarks.md, "make_scene city"); a
survey image sees a bounded patch, so with a survey the whole run stays flat.
The ground-truth store lives under `work` (default OUT.work beside OUT); `clean` removes it, and the
work folder when the run made it, once the images are rendered.
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from octree.cull import frustum_cull
from octree.keys import parse_key
from storage import Store, StoreError
from storage.cache import param_bytes_per_gaussian
from storage.schema import empty_state
from tools.scenes.cameras import COVERAGE_CELLS, best_covered, coverage_cells, holdout_slots, tour
from tools.scenes.city import (CityConfig, CityError, CityLayout, city_cameras, city_layout, city_tiles, sized,
                               survey_cameras)
from tools.scenes.config import SceneConfig, SceneError
from tools.scenes.files import (POINTS, SCENE_JSON, PointSpool, check_output, partial_dir, replace_dir,
                                save_png, write_transforms)
from train.camera import Camera

ENOUGH_COVERAGE = 0.5  # share of a camera's coarse image grid the city must fill
_MIN_BLOCKS = 2  # a city smaller than 2 x 2 blocks is made at a lower density instead
# What a ground-truth Gaussian costs on disk beyond its parameters: the Adam state and statistics
# the store's schema holds are zeros (lz4 makes them a few bytes), plus chunk and document overhead.
_STORE_SLACK_BYTES = 16
_COUNT_MARGIN = 1.1  # the count is Poisson around the target: room for its spread


@dataclass(frozen=True, eq=False)
class CityDataset:
    """What `make_city` wrote."""

    city: CityConfig  # the city made (its blocks and density as sized for the requested count)
    cameras: list[Camera]  # in name order
    gaussians: int
    points: int
    blocks: int
    visible: np.ndarray  # [C] share of the Gaussians that project into each camera's image
    ground_truth: Path | None  # the ground-truth store (None when clean removed it)
    seconds: dict[str, float]  # ground_truth (generating and writing the store), images (rendering them)
    peak_rss: dict[str, int]  # bytes, the process's peak resident set at the end of each phase
    largest_view: int  # 2D splats of the camera that sees the most


def city_config(cfg: SceneConfig) -> CityConfig:
    """The city a resolved scene config asks for, sized to its Gaussians (before the cameras are split)."""
    base = CityConfig(blocks=_MIN_BLOCKS, width=cfg.width, height=cfg.height, seed=cfg.seed, sh_degree=cfg.sh_degree,
                      view_dependence=cfg.view_dependence, tile_gaussians=cfg.block_gaussians, cameras=1)
    city = base if cfg.gaussians is None else sized(base, cfg.gaussians, _MIN_BLOCKS)
    if cfg.capture == "survey":
        return replace(city, capture="survey", survey_altitude=cfg.altitude, survey_pitch=cfg.pitch,
                       survey_overlap=cfg.overlap)
    aerial = int(round(cfg.aerial * cfg.cameras))
    return replace(city, cameras=cfg.cameras - aerial, aerial_cameras=aerial)


def needed_bytes(cfg: SceneConfig) -> tuple[int, int]:
    """Disk the dataset needs at most: (under the work folder, under OUT), from the config alone."""
    n = _COUNT_MARGIN * (cfg.gaussians or 130_000)
    store = n * (param_bytes_per_gaussian(cfg.sh_degree) + _STORE_SLACK_BYTES)
    points = n * cfg.point_fraction * 15  # x y z float32, r g b uint8
    cameras = cfg.cameras or len(survey_cameras(city_config(cfg)))
    images = cameras * cfg.width * cfg.height * 3  # PNG never grows beyond raw RGB by much
    return int(store + points), int(images + points + 2**20)


def check_disk(cfg: SceneConfig, work: Path, out: Path) -> None:
    """Refuse, before any work, a dataset the disks cannot hold (work and OUT may share one)."""
    try:
        in_work, in_out = needed_bytes(cfg)
    except CityError as e:
        raise SceneError(str(e)) from None
    need: dict[int, list] = {}
    for path, nbytes in ((work, in_work), (out.parent, in_out)):
        place = _existing(path)
        entry = need.setdefault(os.stat(place).st_dev, [place, 0])
        entry[1] += nbytes
    for place, nbytes in need.values():
        free = shutil.disk_usage(place).free
        if nbytes > free:
            raise SceneError(f"not enough disk for {cfg.gaussians or 'the default'} Gaussians: needs "
                             f"{nbytes:,} bytes under {place}, {free:,} free")


def _existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def make_city(out: Path, cfg: SceneConfig) -> CityDataset:
    """Write the city dataset of the resolved `cfg` at `out` (see the module docstring)."""
    check_output(out, cfg.overwrite)
    work = Path(cfg.work) if cfg.work is not None else out.with_name(out.name + ".work")
    if work.exists() and not work.is_dir():
        raise SceneError(f"--work {work}: exists and is not a folder")
    if work.absolute().is_relative_to(out.absolute()):
        raise SceneError(f"--work {work}: inside OUT {out}, which is replaced when the dataset is complete")
    store_path = work / f"{out.name}.ground_truth.zarr"
    if store_path.exists() and not cfg.overwrite:
        raise SceneError(f"{store_path}: a ground-truth store is already there (pass --overwrite to replace it)")
    check_disk(cfg, work, out)
    block_bytes = cfg.block_gaussians * param_bytes_per_gaussian(cfg.sh_degree)
    if block_bytes > cfg.cache_mb * 2**20:
        raise SceneError(f"--cache-mb {cfg.cache_mb:g} is too small for ground-truth blocks of about "
                         f"{cfg.block_gaussians:,} Gaussians ({block_bytes / 2**20:.2f} MiB each); pass more, "
                         f"or a smaller --block-gaussians")
    try:
        city = city_config(cfg)
        layout = city_layout(city)
    except CityError as e:
        raise SceneError(str(e)) from None
    made_work = not work.exists()
    partial = partial_dir(out)
    tmp_store = work / f".{out.name}.ground_truth.tmp-{os.getpid()}.zarr"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        work.mkdir(parents=True, exist_ok=True)
        (partial / "images").mkdir(parents=True)
        survey = city.capture == "survey"
        candidates = survey_cameras(city) if survey else city_cameras(city, 2 * city.cameras, 2 * city.aerial_cameras)
        spool = PointSpool(work / f".{out.name}.points-{os.getpid()}")
        start = time.perf_counter()
        try:
            written = _write_ground_truth(layout, cfg, tmp_store, candidates, spool)
            spool.finish(partial / POINTS)
        finally:
            spool.close()
            spool.scratch.unlink(missing_ok=True)
        cameras = _named(candidates, cfg.test_every) if survey else _chosen(candidates, written.coverage, city,
                                                                           cfg.test_every)
        generated, rss = time.perf_counter(), {"ground_truth": _peak_rss()}
        visible = _render(tmp_store, cameras, cfg, written.gaussians, partial)
        seconds = {"ground_truth": generated - start, "images": time.perf_counter() - generated}
        rss["images"] = _peak_rss()
        write_transforms(partial / "transforms.json", cameras)
        kept = None if cfg.clean else store_path
        _write_scene_json(partial / SCENE_JSON, city, cfg, written, cameras, kept)
        if kept is not None:
            if store_path.exists():
                _remove_store(store_path)
            os.replace(tmp_store, store_path)
        replace_dir(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        shutil.rmtree(tmp_store, ignore_errors=True)
        if made_work:
            shutil.rmtree(work, ignore_errors=True)
        raise
    if cfg.clean:
        shutil.rmtree(tmp_store, ignore_errors=True)
        if made_work:
            shutil.rmtree(work, ignore_errors=True)
    return CityDataset(city, cameras, written.gaussians, written.points, written.blocks, visible, kept, seconds, rss,
                       int(round(visible.max() * written.gaussians)))


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _remove_store(path: Path) -> None:
    """Remove an old ground-truth store, but only an OctoSplat store."""
    try:
        Store.open(path, mode="r", verify="table").close()
    except StoreError:
        raise SceneError(f"{path}: exists and is not an OctoSplat store; not replacing it") from None
    shutil.rmtree(path)


@dataclass
class _Written:
    gaussians: int
    points: int
    blocks: int
    coverage: np.ndarray  # [C] share of each candidate camera's coarse grid that some mean fell in


def _write_ground_truth(layout: CityLayout, cfg: SceneConfig, path: Path, cameras: list[Camera],
                        spool: PointSpool) -> _Written:
    """Every tile's Gaussians as blocks of a new store at `path`, committed once; the tiles' means
    mark the candidate cameras' coverage grids and their subsample goes to `spool`."""
    city = layout.config
    tiles = layout.tiles()
    # A mean in a camera's image lies in a box the camera's frustum meets (culling is conservative).
    boxes = np.stack([layout.tile_box3(ix, iy) for ix, iy in tiles])
    sees = {t: [] for t in tiles}  # tile -> cameras that may see a mean of it
    for c, cam in enumerate(cameras):
        for t in np.flatnonzero(frustum_cull(boxes, cam.viewmat, cam.K, cam.width, cam.height)):
            sees[tiles[t]].append(c)
    hits = np.zeros((len(cameras), COVERAGE_CELLS**2), dtype=bool)
    store = Store.create(path, {"sh_degree": city.sh_degree, "scene": "city", **layout.root.to_attrs()},
                         durable=False)  # a failed run is removed and made again: nothing to recover
    infos = {}
    total = points = 0
    for tile in city_tiles(layout):
        means = tile.splats["means"]
        for c in sees[(tile.ix, tile.iy)]:
            hits[c] |= coverage_cells(cameras[c], means)
        for key, rows in tile.blocks(layout).items():
            arrays = {name: a[rows] for name, a in tile.splats.items()}
            arrays.update(empty_state(len(rows), city.sh_degree))
            cell = layout.root.cell(parse_key(key))
            infos[key] = store.write_block(key, arrays, cell)
        # Each tile takes its share of the points so that the whole cloud has round(fraction * N).
        before = total
        total += len(tile)
        count = min(len(tile), round(cfg.point_fraction * total) - round(cfg.point_fraction * before))
        if count > 0:
            rng = np.random.default_rng([cfg.seed, 1, tile.ix, tile.iy])
            keep = np.sort(rng.choice(len(tile), count, replace=False))
            xyz = means[keep] + rng.normal(0.0, cfg.point_noise, (count, 3))
            rgb = tile.colors[keep] * 255.0 + rng.normal(0.0, cfg.color_noise, (count, 3))
            spool.add(xyz.astype(np.float32), np.clip(np.round(rgb), 0, 255).astype(np.uint8))
            points += count
    if not infos:
        raise SceneError("the city came out empty (raise --gaussians)")
    store.commit(infos, state={"gaussians": total})
    store.close()
    return _Written(total, points, len(infos), hits.mean(axis=1))


def _chosen(candidates: list[Camera], coverage: np.ndarray, city: CityConfig, test_every: int) -> list[Camera]:
    """The best-covered street and aerial cameras, walked in a tour and named for hold-out."""
    street = np.array([c.name.startswith("street") for c in candidates])
    picked = []
    for group, n in ((np.flatnonzero(street), city.cameras), (np.flatnonzero(~street), city.aerial_cameras)):
        picked += [candidates[group[i]] for i in best_covered(coverage[group], n, ENOUGH_COVERAGE)]
    order = tour([c.center for c in picked])
    return _named([picked[i] for i in order], test_every)


def _named(walked: list[Camera], test_every: int) -> list[Camera]:
    """Cameras standing in a walk, named so that the held-out ones stand between training ones."""
    slots = holdout_slots(len(walked), test_every)
    return [replace(walked[s], image_id=i, name=f"images/city_{i:04d}.png", extra={"source": walked[s].name})
            for i, s in enumerate(slots)]


def _render(store_path: Path, cameras: list[Camera], cfg: SceneConfig, gaussians: int,
            folder: Path) -> np.ndarray:  # -> [C] visible share
    from tools.view.config import ViewError  # the viewer imports torch; only rendering needs it
    from tools.view.render import FrustumRenderer

    store = Store.open(store_path, mode="r", verify="table")
    budget = int(cfg.cache_mb * 2**20)
    largest = max(info.count for info in store.table.values()) * param_bytes_per_gaussian(store.sh_degree)
    if largest > budget:
        raise SceneError(f"--cache-mb {cfg.cache_mb:g} is too small for the largest ground-truth block "
                         f"({largest / 2**20:.1f} MiB); pass more, or a smaller --block-gaussians")
    renderer = FrustumRenderer(store, budget, "cpu", cfg.background)
    visible = np.zeros(len(cameras))
    try:
        for i, cam in enumerate(cameras):
            rgb, stats = renderer.render(cam)
            save_png(rgb.numpy(), folder / cam.name)
            visible[i] = stats.splats / gaussians
    except ViewError as e:
        raise SceneError(str(e)) from None
    finally:
        renderer.close()
        store.close()
    return visible


def _write_scene_json(path: Path, city: CityConfig, cfg: SceneConfig, written: _Written, cameras: list[Camera],
                      store: Path | None) -> None:
    doc = {
        "kind": "city", "made_by": "python -m tools.make_scene", "seed": cfg.seed,
        "gaussians": written.gaussians, "points": written.points, "ground_truth_blocks": written.blocks,
        "sh_degree": cfg.sh_degree, "background": list(cfg.background),
        "ground_truth": None if store is None else str(store.absolute()),
        "cameras": [{"name": c.name, "source": c.extra["source"]} for c in cameras],
        "city": {k: v for k, v in asdict(city).items()},
    }
    path.write_text(json.dumps(doc, indent=1))
