"""Exact occlusion culling (`--occlusion on`): the geometry against the renderer, the culling pass
against rendering the whole frustum, and training with culling against training without it.

The walled scene (`tools/scenes/walled.py`): an opaque wall with a gap, eight cameras in front,
Gaussians behind it: two clusters no camera can see, one seen through the gap.

Tolerance: none. Culled splats sort strictly after the splat that terminates every pixel they
could reach, so the kernels run the same operations in the same order on every other splat:
images, gradients, Adam state and parameters are compared bit for bit. The one thing that
differs, by design, is the densification statistics of Gaussians a camera did not project.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from octree.order import box_depths, box_footprints, front_to_back
from storage import Store
from storage.cache import BlockCache
from tests.helpers.layout import assert_same_blocks, rank_free_state
from tools.scenes.walled import (
    HIDDEN,
    SEEN,
    blocks_meeting,
    blocks_within,
    make_walled,
    walled_cameras,
)
from train.camera import Camera
from train.config import ConfigError, TrainConfig
from train.densify.config import DensifyConfig
from train.exchange import Held, LocalExchange
from train import occlusion as occlusion_module
from train.occlusion import DepthPyramid, OcclusionCuller
from train.region import Region
from train.step import _delivered_first
from train.render import Splats2D, project, render
from train.render.cpu.binning import bin_tiles
from train.render.cpu.ellipse import HALF_X, HALF_Y
from train.render.splats2d import GRAD_FLOATS, WIRE_FLOATS
from train.trainer import Trainer, run
from train.waves import raster_bytes

REPO = Path(__file__).resolve().parents[1]
MPIRUN = shutil.which("mpirun", path=str(Path(sys.executable).parent)) or shutil.which("mpirun")
STATISTICS = ("grad2d", "count", "max_radii")


@pytest.fixture(scope="module")
def walled(tmp_path_factory):
    return make_walled(tmp_path_factory.mktemp("walled"))


def _copy(store: Path, tmp_path: Path, name: str) -> Path:
    shutil.copytree(store, tmp_path / name)
    return tmp_path / name


def _arrays(store: Path) -> dict[str, dict[str, np.ndarray]]:
    s = Store.open(store, mode="r")
    return {k: s.read_block(k) for k in s.table}


def _tensors(store: Store, keys: list[str]) -> dict[str, torch.Tensor]:
    """The parameters of these blocks, concatenated in this order."""
    blocks = [store.read_block(k) for k in keys]
    names = ("means", "scales", "quats", "opacities", "sh0", "shN")
    return {n: torch.from_numpy(np.concatenate([b[n] for b in blocks])) for n in names}


# ---- geometry ----

def test_front_to_back_is_the_order_of_nearest_depths():
    rng = np.random.default_rng(0)
    lo = rng.uniform(-10, 10, (50, 3))
    boxes = np.concatenate([lo, lo + rng.uniform(0.1, 3, (50, 3))], axis=1)
    cam = walled_cameras()[3]
    corners = np.stack([np.where(np.array([(c >> a) & 1 for a in range(3)], bool), boxes[:, 3:], boxes[:, :3])
                        for c in range(8)], axis=1)  # [50, 8, 3]
    nearest = (corners @ cam.viewmat[2, :3] + cam.viewmat[2, 3]).min(axis=1)
    order = front_to_back(boxes, cam.viewmat)
    assert sorted(order.tolist()) == list(range(50))
    np.testing.assert_allclose(box_depths(boxes, cam.viewmat), nearest, rtol=1e-12, atol=1e-12)
    assert (np.diff(nearest[order]) >= -1e-12).all()


def test_footprints_hold_every_splat_of_their_box():
    """Gaussians of random sizes and shapes anywhere inside an extent box, projected by the
    renderer: every pixel a splat's support can reach (its radius box) lies in the box's rect
    and every splat's depth lies beyond the box's `near`."""
    rng = np.random.default_rng(1)
    K = np.array([[60.0, 0, 40], [0, 60.0, 30], [0, 0, 1]])
    cam = Camera(np.eye(4), K, 80, 60)
    checked = 0
    for trial in range(40):
        centre = rng.uniform([-3, -2, 0.5], [3, 2, 12])
        half = rng.uniform(0.05, 1.5, 3)
        box = np.concatenate([centre - half, centre + half])
        n = 400
        log_s = rng.uniform(-6, np.log(half.min() / 3.33), (n, 3))
        reach = 3.33 * np.exp(log_s.max(axis=1, keepdims=True))
        means = rng.uniform(box[:3] + reach, box[3:] - reach)
        splats = {"means": torch.tensor(means, dtype=torch.float32),
                  "scales": torch.tensor(log_s, dtype=torch.float32),
                  "quats": torch.tensor(rng.standard_normal((n, 4)), dtype=torch.float32),
                  "opacities": torch.tensor(rng.uniform(-2, 8, n), dtype=torch.float32),
                  "sh0": torch.zeros(n, 1, 3), "shN": torch.zeros(n, 0, 3)}
        s2d = project(splats, cam, 0)
        fp = box_footprints(box[None], cam.viewmat, K, 80, 60)
        if not fp.bounded[0] or len(s2d) == 0:
            continue
        x0, y0, x1, y1 = fp.rects[0]
        m = s2d.means2d.detach().numpy()
        # The kernels evaluate a splat within its support ellipse's box (the record's half
        # extents); binning uses its radius box: the footprint must hold both.
        bins = bin_tiles(*(t.detach().contiguous().numpy() for t in
                           (s2d.means2d, s2d.conics, s2d.opacities, s2d.colors, s2d.depths, s2d.radii)), 80, 60)
        rec = np.empty_like(bins.records)
        rec[bins.order] = bins.records  # records are in depth order: back to the splats' rows
        r = np.maximum(s2d.radii.numpy(), rec[:, [HALF_X, HALF_Y]])
        # Pixels i with centre i + 0.5 within mean +- radius, clipped to the image.
        px0 = np.clip(np.ceil(m[:, 0] - r[:, 0] - 0.5), 0, 80)
        px1 = np.clip(np.floor(m[:, 0] + r[:, 0] - 0.5) + 1, 0, 80)
        py0 = np.clip(np.ceil(m[:, 1] - r[:, 1] - 0.5), 0, 60)
        py1 = np.clip(np.floor(m[:, 1] + r[:, 1] - 0.5) + 1, 0, 60)
        some = (px1 > px0) & (py1 > py0)
        assert (px0[some] >= x0).all() and (px1[some] <= x1).all(), trial
        assert (py0[some] >= y0).all() and (py1[some] <= y1).all(), trial
        assert (s2d.depths.numpy() > fp.near[0]).all(), trial
        checked += int(some.sum())
    assert checked > 1000


def test_pyramid_bounds_every_rectangle():
    rng = np.random.default_rng(2)
    sat = rng.uniform(1, 9, (37, 53)).astype(np.float32)
    sat[rng.random(sat.shape) < 0.05] = np.inf
    pyramid = DepthPyramid(sat)
    x0, y0 = rng.integers(0, 53, 500), rng.integers(0, 37, 500)
    x1, y1 = x0 + rng.integers(1, 30, 500), y0 + rng.integers(1, 30, 500)
    rects = np.stack([x0, y0, np.minimum(x1, 53), np.minimum(y1, 37)], axis=1)
    exact = np.array([sat[b:d, a:c].max() for a, b, c, d in rects])
    bound = pyramid.max_over(rects)
    assert (bound >= exact).all()
    single = rects[:, 2:] - rects[:, :2] == 1
    one = single.all(axis=1)
    assert (bound[one] == exact[one]).all()  # a single pixel is read at full resolution


# ---- the culling pass ----

def test_culling_keeps_the_image_gradients_and_contributions(walled):
    """Per camera: the kept blocks render the image of the whole frustum bit for bit, with the
    same gradient for every kept Gaussian; every culled Gaussian has a zero gradient and reached
    no pixel. The blocks of the hidden clusters are culled, the block behind the gap is kept."""
    store = Store.open(walled.store, mode="r")
    region = Region.from_table(store.table)
    culler = OcclusionCuller(1)
    hidden = [k for box in HIDDEN for k in blocks_within(store.table, box)]
    seen = blocks_meeting(store.table, SEEN)
    assert hidden and seen
    w = torch.rand(walled.cameras[0].height, walled.cameras[0].width, 3, generator=torch.Generator().manual_seed(0))
    culled_any: set[str] = set()
    left = blocks_within(store.table, HIDDEN[0])
    with BlockCache(store, 1 << 30) as cache:
        for cam in walled.cameras:
            (c,), _, _ = culler.cull([cam], [0], region, region, cache, LocalExchange(), 0, torch.zeros(3))
            culled = [k for k in c.frustum if k not in c.kept]
            culled_any.update(culled)
            assert not set(seen) & set(culled), cam.name
            assert set(left) <= set(culled), cam.name
            outputs = []
            for keys in (c.frustum, c.kept):
                params = {n: t.requires_grad_(True) for n, t in _tensors(store, keys).items()}
                rgb, alpha, meta = render(params, cam, 0, None)
                ((rgb * w).sum() + alpha.sum()).backward()
                outputs.append((keys, rgb.detach(), alpha.detach(), params, meta))
            (fk, f_rgb, f_alpha, f_params, f_meta), (kk, k_rgb, k_alpha, k_params, _) = outputs
            assert torch.equal(f_rgb, k_rgb) and torch.equal(f_alpha, k_alpha), cam.name
            counts = [store.table[k].count for k in fk]
            starts = dict(zip(fk, np.cumsum([0] + counts)[:-1]))
            rows = np.concatenate([np.arange(starts[k], starts[k] + store.table[k].count) for k in kk])
            dropped = np.setdiff1d(np.arange(sum(counts)), rows)
            for name, p in f_params.items():
                assert torch.equal(p.grad[rows], k_params[name].grad), (cam.name, name)
                assert not p.grad[dropped].any(), (cam.name, name)
            contributed = np.zeros(sum(counts), bool)
            contributed[f_meta["ids"].numpy()[f_meta["contributed"].numpy()]] = True
            assert not contributed[dropped].any(), cam.name
    # The clusters no camera sees are culled by some camera (the one far from the gap by every
    # camera); the zero-contribution assertion above is the brute-force check that they are hidden.
    assert set(hidden) <= culled_any


def test_a_camera_whose_pass_drops_nothing_rests_longer_each_time(walled, monkeypatch):
    """A pass that drops nothing sends its camera to rest for 1, 2, 4, ... of its steps (its whole
    frustum kept meanwhile, which is exact); a pass that drops something ends the rest."""
    store = Store.open(walled.store, mode="r")
    region = Region.from_table(store.table)
    culler = OcclusionCuller(1)
    cam = walled.cameras[0]
    verdict = OcclusionCuller.verdict

    def visit() -> tuple[bool, bool]:  # -> whether the pass ran, whether it kept the whole frustum
        (c,), report, _ = culler.cull([cam], [0], region, region, cache, LocalExchange(), 0, torch.zeros(3))
        assert report.rested == int(report.waves == 0)
        return report.rested == 0, c.kept == c.frustum

    with BlockCache(store, 1 << 30) as cache:
        assert visit() == (True, False)  # the wall hides blocks from this camera
        monkeypatch.setattr(OcclusionCuller, "verdict", staticmethod(lambda p, sat: (np.zeros(0, np.int64), False)))
        visits = [visit() for _ in range(11)]
        assert [ran for ran, _ in visits] == [True, False, True, False, False, True, False, False, False, False, True]
        assert all(whole for _, whole in visits)
        monkeypatch.setattr(OcclusionCuller, "verdict", verdict)
        visits = [visit() for _ in range(9)]  # the rest of 8 steps, then a pass that drops: none after it
        assert visits == [(False, True)] * 8 + [(True, False)]
        assert visit() == (True, False)


def test_the_pass_counts_its_memory_in_the_cache_while_it_runs(walled, monkeypatch):
    """Every projection and rasterization of the pass runs with its memory counted in the cache
    (at least the rasterizer's own figure, `raster_bytes`), and nothing stays counted after it."""
    store = Store.open(walled.store, mode="r")
    region = Region.from_table(store.table)
    checked = {"projected": 0, "rasterized": 0}
    project, raster = occlusion_module.project_owned, occlusion_module.rasterize

    def counted_project(gathered, visible, cameras, *args):
        assert cache.working_bytes >= sum(t.numel() * t.element_size() for t in gathered.params.values()) > 0
        checked["projected"] += 1
        return project(gathered, visible, cameras, *args)

    def counted_raster(splats, camera, *args, **kwargs):
        assert cache.working_bytes >= raster_bytes(len(splats), 0, camera.width, camera.height)
        checked["rasterized"] += 1
        return raster(splats, camera, *args, **kwargs)

    monkeypatch.setattr(occlusion_module, "project_owned", counted_project)
    monkeypatch.setattr(occlusion_module, "rasterize", counted_raster)
    with BlockCache(store, 1 << 30) as cache:
        OcclusionCuller(1).cull(walled.cameras, [0] * len(walled.cameras), region, region, cache, LocalExchange(), 0,
                                torch.zeros(3))
        assert cache.working_bytes == 0
    assert checked["projected"] >= len(walled.cameras) and checked["rasterized"] >= len(walled.cameras)


# ---- training ----

def _walled_config(data: Path, store: Path, out: Path, **kw) -> TrainConfig:
    base = {"data": str(data), "store": str(store), "out": str(out), "steps": 6, "batch_size": 2, "commit_every": 100,
            "log_every": 1, "progress": False, "deterministic": True, "test_every": 100,
            "densify": DensifyConfig(strategy="none"), "adam": "contributed"}
    base.update(kw)
    return TrainConfig(**base)


def _train_steps(cfg: TrainConfig, monkeypatch) -> tuple[list[str], list[dict], set[str]]:
    """Runs the trainer's steps (plan, train, commit; no evaluation, which renders whole
    frustums); returns the block keys the steps read from the store, each step's metrics and,
    with culling, the blocks some camera culled."""
    reads: list[str] = []
    original = Store.read_block

    def counting(self, key, info=None):
        reads.append(key)
        return original(self, key, info)

    monkeypatch.setattr(Store, "read_block", counting)
    trainer = Trainer(cfg)
    culled: set[str] = set()
    if trainer.occlusion is not None:
        cull = trainer.occlusion.cull

        def recording(cams, cam_rank, world, owned, *args):
            culls, report, delivered = cull(cams, cam_rank, world, owned, *args)
            culled.update(k for cam, c in zip(cams, culls) for k in set(owned.visible(cam)) - set(c.kept))
            return culls, report, delivered

        trainer.occlusion.cull = recording
    metrics = []
    try:
        trainer.plan(0)
        for step in range(cfg.steps):
            stats, _ = trainer.train(step)
            assert not stats.skipped
            metrics.append(stats.occlusion | {"blocks": stats.blocks, "projected": stats.projected})
        in_steps = list(reads)
        trainer.commit(cfg.steps)
    finally:
        trainer.close()
    monkeypatch.setattr(Store, "read_block", original)
    return in_steps, metrics, culled


def _assert_same_but_statistics(off: dict, on: dict, never_culled: set[str]) -> None:
    assert off.keys() == on.keys()
    for k, arrays in off.items():
        for name in arrays:
            if name in STATISTICS and k not in never_culled:
                continue
            np.testing.assert_array_equal(on[k][name], arrays[name], err_msg=f"{k}/{name}")
        # What culling changes: a camera that culls a block does not count its Gaussians.
        np.testing.assert_array_equal(on[k]["grad2d"], arrays["grad2d"], err_msg=k)  # their gradients are 0
        assert (on[k]["count"] <= arrays["count"]).all() and (on[k]["max_radii"] <= arrays["max_radii"]).all(), k


def test_training_with_culling_equals_training_without(walled, tmp_path, monkeypatch):
    off_store, on_store = _copy(walled.store, tmp_path, "off.zarr"), _copy(walled.store, tmp_path, "on.zarr")
    off_reads, _, _ = _train_steps(_walled_config(walled.data, off_store, tmp_path / "off"), monkeypatch)
    on_reads, metrics, culled = _train_steps(
        _walled_config(walled.data, on_store, tmp_path / "on", occlusion="on"), monkeypatch)
    table = Store.open(walled.store, mode="r").table
    assert culled, "nothing was culled: the scene does not test culling"
    off, on = _arrays(off_store), _arrays(on_store)
    _assert_same_but_statistics(off, on, set(table) - culled)
    left = blocks_within(table, HIDDEN[0])
    for k in left:  # hidden from every camera: never projected, so never counted, and never read
        assert not on[k]["count"].any() and off[k]["count"].any(), k
        assert k not in on_reads and k in off_reads, k
    assert not set(blocks_meeting(table, SEEN)) & culled
    for m in metrics:
        assert m["occ_kept_blocks"] < m["occ_frustum_blocks"] and m["occ_bytes_not_read"] > 0
        assert m["occ_kept_gaussians"] < m["occ_frustum_gaussians"]


def test_held_out_views_with_culling_are_the_views_without(walled, tmp_path, monkeypatch):
    """Evaluation culls as the steps do: the same PSNR, SSIM and rendered images, bit for bit, and
    the blocks behind the wall are read neither by the steps nor by the evaluation."""
    reads: dict[str, list[str]] = {"off": [], "on": []}
    original = Store.read_block
    mode = ["off"]

    def counting(self, key, info=None):
        reads[mode[0]].append(key)
        return original(self, key, info)

    monkeypatch.setattr(Store, "read_block", counting)
    results = {}
    for mode[0] in ("off", "on"):
        store = _copy(walled.store, tmp_path, f"{mode[0]}.zarr")
        results[mode[0]] = run(_walled_config(walled.data, store, tmp_path / mode[0], occlusion=mode[0], steps=2,
                                              test_every=2))
    off, on = results["off"], results["on"]
    assert on["test_psnr"] == off["test_psnr"] and on["test_ssim"] == off["test_ssim"]
    renders = {m: sorted((tmp_path / m / "renders" / "step_000002").glob("*.png")) for m in results}
    assert len(renders["on"]) == 4 and [p.name for p in renders["on"]] == [p.name for p in renders["off"]]
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(renders["on"], renders["off"]))
    evals = [json.loads(l) for l in (tmp_path / "on" / "metrics.jsonl").read_text().splitlines() if '"eval"' in l]
    assert evals[-1]["occ_kept_gaussians"] < evals[-1]["occ_frustum_gaussians"]
    hidden = blocks_within(Store.open(walled.store, mode="r").table, HIDDEN[0])
    assert hidden and not set(hidden) & set(reads["on"]) and set(hidden) <= set(reads["off"])


def test_lund_door_with_culling_equals_without(shared_data, lund_store, tmp_path):
    """A real capture, tiled from its SfM points (opacity 0.1): no pixel saturates, so nothing is
    culled (`docs/benchmarks.md`); this runs the whole on path (pass, prefetch, paging, metrics)
    on real photos and checks that every parameter and Adam moment comes out the same."""
    lund = shared_data / "lund_door"
    stores = {m: _copy(lund_store, tmp_path, f"{m}.zarr") for m in ("off", "on")}
    for mode, store in stores.items():
        cfg = TrainConfig(data=str(lund), store=str(store), out=str(tmp_path / mode), steps=4, data_factor=8,
                          commit_every=100, log_every=1, progress=False, deterministic=True, occlusion=mode,
                          adam="contributed", max_eval_images=1, densify=DensifyConfig(strategy="none"))
        run(cfg)
    off, on = _arrays(stores["off"]), _arrays(stores["on"])
    _assert_same_but_statistics(off, on, set())


def test_occlusion_refuses_what_it_would_change(tmp_path):
    for adam in ("visible", "dense"):
        with pytest.raises(ConfigError, match=f"--occlusion on with --adam {adam}"):
            TrainConfig(data="d", store="s", occlusion="on", adam=adam)
    with pytest.raises(ConfigError, match="--occlusion 'yes'"):
        TrainConfig(data="d", store="s", occlusion="yes")
    proc = subprocess.run([sys.executable, "-m", "train", "--data", str(tmp_path), "--store", str(tmp_path / "s"),
                           "--occlusion", "on", "--adam", "contributed", "--strategy", "mcmc"], capture_output=True, text=True, cwd=REPO,
                          timeout=120, check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --occlusion on with --strategy mcmc")


def _mpi_train(n: int, walled, store: Path, out: Path, *options: str) -> None:
    """`python -m train` on n ranks (one process without mpirun), a global batch of 4 cameras."""
    cmd = [sys.executable, "-m", "train", "--data", str(walled.data), "--store", str(store), "--out", str(out),
           "--steps", "8", "--batch-size", str(4 // n), "--adam", "contributed", "--log-every", "1", "--no-progress",
           "--deterministic", *options]
    proc = subprocess.run(([MPIRUN, "-n", str(n)] if n > 1 else []) + cmd, capture_output=True, text=True, cwd=REPO,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_the_delivered_blocks_lead_the_part_and_keep_their_rows_order():
    """An owner's part for a camera, its rows from blocks a, b, c (ids: batch rows): the blocks
    the pass delivered (c, then a) lead it, each block's rows in their own order, the rest follow."""
    offsets = [0, 4, 6, 10]  # a: rows 0-3, b: 4-5, c: 6-9
    ids = torch.tensor([0, 2, 3, 4, 5, 6, 8, 9])  # the rows the camera sees, in batch order
    part = Splats2D(*(torch.zeros(len(ids), w) for w in (2, 3)), torch.zeros(len(ids)), torch.zeros(len(ids)),
                    torch.zeros(len(ids), 3), torch.zeros(len(ids), 2, dtype=torch.int32), ids)
    order = _delivered_first(part, ["a", "b", "c"], offsets, ["c", "a"])
    assert ids[order].tolist() == [6, 8, 9, 0, 2, 3, 4, 5]


def test_held_splats_must_be_what_the_sender_left_off_the_wire():
    three = Splats2D(torch.zeros(3, 2), torch.zeros(3, 3), torch.zeros(3), torch.zeros(3), torch.zeros(3, 3),
                     torch.zeros(3, 2, dtype=torch.int32), torch.arange(3))
    held = Held({}, {(1, 0): three})
    assert held.check(1, 0, 3) is three
    assert held.check(0, 1, 0) is None
    with pytest.raises(RuntimeError, match="rank 1 left 2 rows of camera 0's splats off the wire, but this rank "
                                           "holds 3"):
        held.check(1, 0, 2)
    with pytest.raises(RuntimeError, match="holds 0"):
        held.check(0, 1, 2)
    with pytest.raises(RuntimeError, match="no other rank"):
        LocalExchange().send_splats({}, 1, held)


# the figures that count what crosses ranks (all 0 on one rank)
_RANKS_FIGURES = ("occ_bytes_sent", "occ_gaussians_not_sent", "occ_splats_reused")


def _occlusion_per_step(out: Path, also: tuple[str, ...] = ()) -> dict[int, dict[str, int]]:
    """The culling figures of each step (and the fields `also`), summed over the ranks' metrics files."""
    steps: dict[int, dict[str, int]] = {}
    for f in sorted(out.glob("metrics*.jsonl")):
        for record in map(json.loads, f.read_text().splitlines()):
            if record["kind"] == "train":
                into = steps.setdefault(record["step"], {})
                for k, v in record.items():
                    if k.startswith("occ_") or k in also:
                        into[k] = into.get(k, 0) + v
    return steps


@pytest.mark.skipif(MPIRUN is None, reason="mpirun not found (pip install mpich)")
def test_culling_under_mpi_is_the_single_process_culling(walled, tmp_path):
    """The pass's rounds under `mpirun -n 2` and `-n 4` (each rank projects its owned blocks of
    each wave for the camera's rank; the verdicts go to every rank) keep what one process keeps,
    camera for camera: the culling figures summed over the ranks, and every block after 8 steps
    with two refinements (splits, Gaussians migrating, a rebalance after each), densification
    statistics included, are bit for bit the single process's. Without densification, 4 ranks
    with culling, and 2 ranks with culling and a cache that takes each step in waves, train what
    one process trains without it (all but the statistics); the step sends again none of the
    splats the pass already carried to the camera's rank."""
    densify = ["--strategy", "default", "--refine-start-iter", "2", "--refine-every", "3", "--grow-grad2d", "5e-5",
               "--rebalance-above", "1.0"]
    stores = {}
    for n in (1, 2, 4):
        stores[n] = _copy(walled.store, tmp_path, f"r{n}.zarr")
        _mpi_train(n, walled, stores[n], tmp_path / f"out{n}", "--occlusion", "on", *densify)
    figures = {n: _occlusion_per_step(tmp_path / f"out{n}") for n in stores}
    ref = Store.open(stores[1], mode="r")
    refines = [json.loads(l) for l in (tmp_path / "out1" / "metrics.jsonl").read_text().splitlines() if '"refine"' in l]
    assert len(refines) == 2 and all(r["split"] > 0 and r["migrated_out"] > 0 for r in refines)
    start = sum(i.count for i in Store.open(walled.store, mode="r").table.values())
    assert sum(i.count for i in ref.table.values()) == refines[-1]["gaussians"] > start
    sent = {}
    culled = sum(f["occ_frustum_gaussians"] - f["occ_kept_gaussians"] for f in figures[1].values())
    assert all(f[k] == 0 for f in figures[1].values() for k in _RANKS_FIGURES)  # one rank sends nothing
    for n in (2, 4):
        other = Store.open(stores[n], mode="r")
        assert rank_free_state(other.state) == rank_free_state(ref.state)
        assert_same_blocks(ref, other, f"{n} ranks")
        assert figures[n].keys() == figures[1].keys() == set(range(1, 9))
        sent[n] = sum(f.pop("occ_bytes_sent") for f in figures[n].values())
        # the culled Gaussians that another rank than the camera's owns: never projected for it, never sent
        assert 0 < sum(f.pop("occ_gaussians_not_sent") for f in figures[n].values()) < culled
        # the splats the pass carried to another rank and kept, which the step did not send again
        assert sum(f.pop("occ_splats_reused") for f in figures[n].values()) > 0
        assert figures[n] == {s: {k: v for k, v in f.items() if k not in _RANKS_FIGURES}
                              for s, f in figures[1].items()}
    assert all(f["occ_kept_gaussians"] < f["occ_frustum_gaussians"] for f in figures[1].values())
    assert 0 < sent[2] < sent[4]  # the waves' splats crossed ranks, more of them on more ranks
    off, on = _copy(walled.store, tmp_path, "off.zarr"), _copy(walled.store, tmp_path, "on4.zarr")
    _mpi_train(1, walled, off, tmp_path / "off", "--occlusion", "off", "--strategy", "none")
    _mpi_train(4, walled, on, tmp_path / "on4", "--occlusion", "on", "--strategy", "none")
    _assert_same_but_statistics(_arrays(off), _arrays(on), set())
    # What crossed ranks in each step: the pass's rounds, a received splat's forward floats only
    # where the pass had not carried it already, and back two bits a splat and the gradient rows
    # not all zero, fewer than the splats (some are hidden behind the wall; the exact wire format
    # is `tests/helpers/mpi_exchange_check.py`'s).
    wire, back = 4 * WIRE_FLOATS, 4 * GRAD_FLOATS
    steps = _occlusion_per_step(tmp_path / "on4", also=("bytes_sent", "received", "grad_rows_sent"))
    assert sum(f["occ_splats_reused"] for f in steps.values()) > 0
    for step, f in steps.items():
        returned = f["bytes_sent"] - f["occ_bytes_sent"] - wire * (f["received"] - f["occ_splats_reused"])
        assert f["received"] / 4 <= returned < back * f["received"], step
        # the rows counted are the rows sent: what is left is the masks, a quarter byte a splat
        # rounded up per part (4 ranks, one camera each: at most 12 parts)
        assert 0 < f["grad_rows_sent"] < f["received"], step
        assert 0 <= returned - back * f["grad_rows_sent"] - f["received"] / 4 < 12, step
    # A cache too small for a step's blocks: each rank projects them in waves, whose rows the
    # splats the pass carried are picked out of, and trains what one process trains in memory.
    tight = _copy(walled.store, tmp_path, "tight.zarr")
    _mpi_train(2, walled, tight, tmp_path / "tight", "--occlusion", "on", "--strategy", "none", "--cache-mb", "1.0")
    lines = [json.loads(line) for rank in (0, 1)
             for line in (tmp_path / "tight" / f"metrics.rank{rank}.jsonl").read_text().splitlines()]
    assert min(r["waves"] for r in lines if r["kind"] == "train") >= 2
    assert sum(r["occ_splats_reused"] for r in lines if r["kind"] == "train") > 0
    _assert_same_but_statistics(_arrays(off), _arrays(tight), set())
    # the held-out view, culled by the ranks' rounds, is the one process's unculled view
    held_out = {d: json.loads((tmp_path / d / "summary.json").read_text())["test_psnr"] for d in ("off", "on4")}
    assert held_out["on4"] == held_out["off"], held_out
    lines = (tmp_path / "on4" / "metrics.rank0.jsonl").read_text().splitlines()
    evals = [json.loads(line) for line in lines if '"eval"' in line]
    assert evals[-1]["occ_kept_gaussians"] < evals[-1]["occ_frustum_gaussians"]


@pytest.mark.skipif(MPIRUN is None, reason="mpirun not found (pip install mpich)")
def test_a_setup_error_under_mpi_is_written_out_whole_and_the_store_is_untouched(walled, tmp_path):
    """Every rank refuses the run before it starts (`--sh-degree` beyond the store's), agrees on
    it and exits: the message reaches the terminal (an MPI_Abort can kill it in the pipe)."""
    store = _copy(walled.store, tmp_path, "mpi.zarr")
    before = {k: v.version for k, v in Store.open(store, mode="r").table.items()}
    proc = subprocess.run([MPIRUN, "-n", "2", sys.executable, "-m", "train", "--data", str(walled.data), "--store",
                           str(store), "--out", str(tmp_path / "out"), "--steps", "2", "--sh-degree", "2",
                           "--no-progress"], capture_output=True, text=True, cwd=REPO,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == ["error: --sh-degree 2: the store holds SH up to degree 0"]
    assert {k: v.version for k, v in Store.open(store, mode="r").table.items()} == before


# ---- the viewer ----

def _frames(store_path: Path, cameras: list[Camera], monkeypatch, **kw) -> tuple[list, list, list[str]]:
    """Every camera's frame from a fresh viewer renderer (small cache: frames page); the blocks it read."""
    from tools.view.render import FrustumRenderer

    reads: list[str] = []
    original = Store.read_params  # the viewer's cache reads parameters only

    def counting(self, key, info=None):
        reads.append(key)
        return original(self, key, info)

    monkeypatch.setattr(Store, "read_params", counting)
    renderer = FrustumRenderer(Store.open(store_path, mode="r"), 1 << 20, **kw)
    try:
        frames = [renderer.render(cam) for cam in cameras]
    finally:
        renderer.close()
        monkeypatch.setattr(Store, "read_params", original)
    return [rgb for rgb, _ in frames], [stats for _, stats in frames], reads


def test_the_viewer_culls_what_is_hidden_and_draws_the_same_frames(walled, monkeypatch):
    """Headless viewer frames with culling equal those without, byte for byte; the hidden clusters'
    cluster far from the gap is never read (the other may be drawn in a first wave); the block
    behind the gap is drawn; no block is projected twice."""
    store = Store.open(walled.store, mode="r")
    hidden = set(blocks_within(store.table, HIDDEN[0]))
    seen = set(blocks_meeting(store.table, SEEN))
    off, off_stats, off_reads = _frames(walled.store, walled.cameras, monkeypatch)
    on, on_stats, on_reads = _frames(walled.store, walled.cameras, monkeypatch, occlusion=True)
    for cam, a, b, sa, sb in zip(walled.cameras, off, on, off_stats, on_stats):
        assert torch.equal(a, b), cam.name
        assert sb.waves >= 1 and sb.culled, (cam.name, sb)
        assert sb.blocks + len(sb.culled) == sa.blocks, (cam.name, sa, sb)  # each frustum block drawn once or culled
        assert sb.projected + sb.culled_gaussians == sa.projected, cam.name
    assert hidden & set(off_reads), "the scene must put hidden blocks in some frustum"
    assert not hidden & set(on_reads)
    assert seen <= set(on_reads)
    assert len(on_reads) < len(off_reads)


def test_the_viewer_never_culls_a_merged_block(walled, monkeypatch):
    """With the browser's level of detail (1 px: the far clusters are drawn merged), culling still
    gives the frames of the same level without it; a block drawn merged is never culled, though
    unmerged ones behind the wall are."""
    from tools.view.render import FrustumRenderer

    off, off_stats, _ = _frames(walled.store, walled.cameras, monkeypatch, lod_pixels=1.0)
    merged: list[set[str]] = []  # per frame, the blocks the culling renderer chose to draw merged
    choose = FrustumRenderer._merged

    def recording(self, keys, camera):
        out = choose(self, keys, camera)
        merged.append(set(out))
        return out

    monkeypatch.setattr(FrustumRenderer, "_merged", recording)
    on, on_stats, _ = _frames(walled.store, walled.cameras, monkeypatch, lod_pixels=1.0, occlusion=True)
    assert any(s.lod.blocks for s in off_stats), "the level must merge some blocks"
    assert set(blocks_within(Store.open(walled.store, mode="r").table, HIDDEN[0])) & merged[0], \
        "a block culling would drop must be merged"
    for cam, a, b, sa, sb, m in zip(walled.cameras, off, on, off_stats, on_stats, merged):
        assert torch.equal(a, b), cam.name
        assert sb.lod.blocks == sa.lod.blocks, cam.name
        assert sb.culled and not set(sb.culled) & m, cam.name


def test_the_viewer_flag(walled, tmp_path, capsys):
    """`tools.view --render --occlusion on` writes the PNGs of the default (off) byte for byte and
    reports what it culled; an unknown mode is refused before anything is written."""
    from tools.view.__main__ import main as view_main

    pngs = {}
    for mode in ("on", None):
        out = tmp_path / f"render-{mode}"
        flags = ["--occlusion", mode] if mode else []
        assert view_main([str(walled.store), "--data", str(walled.data), "--render", str(out),
                          "--cameras", "train", *flags]) == 0
        printed = capsys.readouterr().out
        assert ("culled" in printed) == (mode == "on"), printed
        pngs[mode] = {p.name: p.read_bytes() for p in sorted(out.glob("*.png"))}
    assert pngs["on"] and pngs["on"] == pngs[None]

    assert view_main([str(walled.store), "--render", str(tmp_path / "out"), "--cameras", "orbit:1",
                      "--occlusion", "maybe"]) == 1
    assert "--occlusion maybe: choose from on, off" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
