"""The block viewer headless: renders equal the renderer's own image, paged or not; the map is
the trainer's ownership partition; the viewer reads only parameters and never writes."""
from __future__ import annotations

import contextlib
import hashlib
import shutil
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from octree.keys import parse_key
from storage import Store, StoreError
from storage.cache import BlockCache, param_bytes_per_gaussian
from storage.schema import PARAM_NAMES
from train.config import TrainConfig
from train.region import Ownership
from train.render import render
from train.trainer import load_cameras
from tools.view.__main__ import main
from tools.view.colour import PALETTE
from tools.view.config import ViewConfig, ViewError
from tools.view.draw import draw_map
from tools.view.render import FrustumRenderer
from tools.view.scene import load_blocks, open_store


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_viewer(cfg: ViewConfig) -> Iterator:
    """A `tools.view.gui.Viewer` serving `cfg` (its follow loop running) until the block ends."""
    from tools.view.gui import Viewer

    store = open_store(cfg.store)
    viewer = Viewer(cfg, store, None)
    stop = threading.Event()
    loop = threading.Thread(target=viewer.run, args=(stop,), daemon=True)
    loop.start()
    try:
        yield viewer
    finally:
        stop.set()
        loop.join(10)
        viewer.close()
        store.close()


def tree_digest(root: Path) -> dict[str, str]:
    """Every file under root -> sha256 of its bytes."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def reference_splats(store: Store, table: dict) -> dict[str, torch.Tensor]:
    """Every block of `table` (a commit's), in Morton order, as one splats dict."""
    keys = sorted(table, key=lambda k: parse_key(k).morton_rank())
    blocks = [store.read_params(k, table[k]) for k in keys]
    return {n: torch.from_numpy(np.concatenate([b[n] for b in blocks])) for n in PARAM_NAMES}


def reference_image(store_path: Path, camera) -> np.ndarray:  # [H, W, 3] uint8
    """The whole store in memory, in Morton order, through the renderer itself."""
    with Store.open(store_path, mode="r") as store:
        rgb, _, _ = render(reference_splats(store, store.table), camera, store.sh_degree, None, "cpu")
    return (rgb.clamp(0, 1).numpy() * 255.0 + 0.5).astype(np.uint8)


def lund_cameras(shared_data: Path, store_path: Path):
    with Store.open(store_path, mode="r") as store:
        scene = load_cameras(TrainConfig(data=str(shared_data / "lund_door"), store=str(store_path)), store)
    return scene.train + scene.test


@pytest.mark.parametrize("cache_mb", ["64", "0.5"])  # everything resident; a fifth of the parameters at a time
def test_headless_render_equals_renderer(lund_store: Path, shared_data: Path, tmp_path: Path, cache_mb: str,
                                         capsys) -> None:
    cams = lund_cameras(shared_data, lund_store)
    picks = [0, len(cams) - 1]  # a training camera and a held-out one
    small = cams[0].scaled(4)
    assert main([str(lund_store), "--data", str(shared_data / "lund_door"), "--render", str(tmp_path),
                 "--cameras", ",".join(map(str, picks)), "--width", str(small.width), "--height", str(small.height),
                 "--cache-mb", cache_mb]) == 0
    out = capsys.readouterr().out
    assert "peak RSS:" in out
    pngs = sorted(tmp_path.glob("*.png"))
    assert [p.name[:4] for p in pngs] == [f"{i:04d}" for i in picks]
    for i, png in zip(picks, pngs):
        expected = reference_image(lund_store, cams[i].scaled(4))
        got = np.asarray(Image.open(png))
        assert got.shape == expected.shape == (small.height, small.width, 3)
        assert expected.mean() > 10  # the door is in view, not a black frame
        np.testing.assert_array_equal(got, expected)
    if cache_mb == "0.5":
        assert "paged in" in out


def test_renderer_pages_in_groups_within_budget(lund_store: Path, shared_data: Path) -> None:
    cam = lund_cameras(shared_data, lund_store)[3].scaled(8)
    with Store.open(lund_store, mode="r") as store:
        r = FrustumRenderer(store, 512 << 10)
        try:
            rgb, stats = r.render(cam)
            assert stats.blocks == len(r.visible(cam)) > 1 and len(r._groups(r.visible(cam))) > 1
            assert r.cache.nbytes() <= 512 << 10
            assert stats.paged_in == stats.blocks and stats.gaussians == sum(store.table[k].count for k in r.visible(cam))
        finally:
            r.close()
    np.testing.assert_array_equal((rgb.numpy() * 255.0 + 0.5).astype(np.uint8), reference_image(lund_store, cam))


def test_a_cancelled_frame_stops_between_groups_and_unpins(lund_store: Path, shared_data: Path) -> None:
    from tools.view.render import FrameCancelled

    cam = lund_cameras(shared_data, lund_store)[3].scaled(8)
    asked = []
    with Store.open(lund_store, mode="r") as store:
        r = FrustumRenderer(store, 512 << 10)
        try:
            with pytest.raises(FrameCancelled):
                r.render(cam, cancelled=lambda: asked.append(1) or len(asked) > 2)  # after two groups
            assert len(asked) == 3 and len(r._groups(r.visible(cam))) > 3
            assert all(b.pins == 0 for b in r.cache.resident())
            _, stats = r.render(cam)  # the next frame is whole
            assert stats.blocks == len(r.visible(cam))
        finally:
            r.close()


def test_params_only_cache_reads_no_optimizer_state(lund_store: Path) -> None:
    with Store.open(lund_store, mode="r") as store:
        key = next(iter(store.table))

        def refuse(*_a, **_k):
            raise AssertionError("a params-only cache read the whole block")

        store.read_block = refuse  # type: ignore[method-assign]
        with BlockCache(store, 1 << 20, params_only=True) as cache:
            block = cache.get(key)
            assert set(block.tensors) == set(PARAM_NAMES)
            expected = store.read_params(key)
            for n in PARAM_NAMES:
                np.testing.assert_array_equal(block.tensors[n].numpy(), expected[n])
            # 59 float32 a Gaussian at SH degree 3: means 3, scales 3, quats 4, opacity 1, sh0 3, shN 45.
            assert cache.nbytes() == block.nbytes == store.table[key].count * 59 * 4 == \
                store.table[key].count * param_bytes_per_gaussian(3)
            with pytest.raises(StoreError, match="params-only"):
                cache.mark_dirty(key)
            with pytest.raises(StoreError, match="params-only"):
                cache.put(key, block.tensors, store.table[key].cell)


@pytest.mark.parametrize("ranks", [1, 3])
def test_map_colours_match_ownership(lund_store: Path, shared_data: Path, ranks: int) -> None:
    with Store.open(lund_store, mode="r") as store:
        train = load_cameras(TrainConfig(data=str(shared_data / "lund_door"), store=str(lund_store)), store).train
        ownership = Ownership.balanced(store.table, ranks, train)  # what Trainer.__init__ computes
        table = dict(store.table)
        scene = load_blocks(store, str(lund_store), ranks, train)
    image, layout = draw_map(scene, size=800)
    # lund_door's cameras stand upright along +x: the map looks down it, at y (right) and z (up the image).
    assert scene.up == (0, 1) and layout.axes == (1, 2)
    a, b = layout.axes
    cells = {k: info.cell for k, info in table.items()}
    # The map draws larger cells first, then the highest last (cells are cubes: one side is the size).
    order = sorted(cells, key=lambda k: (-(cells[k][3] - cells[k][0]), cells[k][3]))
    checked = 0
    for key, c in cells.items():
        # A point a quarter into the cell's footprint, clear of its outline and its count label.
        x, y = c[a] + 0.25 * (c[a + 3] - c[a]), c[b] + 0.25 * (c[b + 3] - c[b])
        u, v = layout.pixel(x, y)
        if (c[a + 3] - c[a]) * layout.scale < 12:
            continue
        top = [k for k in order if cells[k][a] <= x <= cells[k][a + 3] and cells[k][b] <= y <= cells[k][b + 3]][-1]
        if top != key:
            continue
        assert tuple(image[int(v), int(u)]) == tuple(PALETTE[ownership.owner(key)]), key
        checked += 1
    assert checked >= 5
    assert {scene.row(k).owner for k in table} == set(range(ranks))


def test_corrupt_block_is_named_and_skipped(lund_store: Path, tmp_path: Path, capsys) -> None:
    store_path = tmp_path / "store"
    shutil.copytree(lund_store, store_path)
    keys = sorted(Store.open(store_path, mode="r").table)
    bad, state_only = keys[0], keys[1]
    (store_path / "blocks" / bad / "0" / "params" / "c.0.0").write_bytes(b"not a chunk")
    # Damaged optimizer state must not matter: the viewer never reads it.
    (store_path / "blocks" / state_only / "0" / "state" / "c.0.0").write_bytes(b"not a chunk")
    assert main([str(store_path), "--render", str(tmp_path / "out"), "--cameras", "orbit:2", "--width", "64",
                 "--height", "48"]) == 0
    captured = capsys.readouterr()
    assert f"warning: skipping block {bad}:" in captured.err and state_only not in captured.err
    assert captured.err.count("warning: skipping") == 1  # named once, then skipped
    assert len(list((tmp_path / "out").glob("*.png"))) == 2


def test_headless_leaves_store_unchanged(lund_store: Path, shared_data: Path, tmp_path: Path) -> None:
    before = tree_digest(lund_store)
    assert main([str(lund_store), "--data", str(shared_data / "lund_door"), "--ranks", "2", "--render",
                 str(tmp_path / "r"), "--cameras", "test", "--width", "81", "--height", "121", "--outline",
                 "--map", str(tmp_path / "map.png")]) == 0
    assert tree_digest(lund_store) == before
    assert (tmp_path / "map.png").is_file()
    cams = lund_cameras(shared_data, lund_store)
    # The held-out cameras come after the 10 training ones (every 8th of 12 images is held out).
    assert [p.name[:4] for p in sorted((tmp_path / "r").glob("*.png"))] == [f"{i:04d}" for i in (10, 11)]
    assert len(cams) == 12


def test_open_store_refuses_what_is_not_a_store(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ViewError, match="no OctoSplat store"):
        open_store(str(tmp_path))


def test_ray_pick_names_the_first_cell_entered() -> None:
    from tools.view.gui import pick

    cells = np.array([[0, 0, 0, 1, 1, 1], [2, 0, 0, 3, 1, 1], [0, 2, 0, 1, 3, 1]], dtype=np.float64)
    along_x = np.array([1.0, 0.0, 0.0])
    assert pick(cells, np.array([-5.0, 0.5, 0.5]), along_x) == 0
    assert pick(cells, np.array([1.5, 0.5, 0.5]), along_x) == 1  # starts between: the one ahead
    assert pick(cells, np.array([0.5, 0.5, 0.5]), along_x) == 0  # inside a cell: that cell
    assert pick(cells, np.array([-5.0, 2.5, 0.5]), along_x) == 2
    assert pick(cells, np.array([-5.0, 5.0, 0.5]), along_x) is None
    assert pick(cells, np.array([5.0, 0.5, 0.5]), along_x) is None  # all behind the ray


def test_client_splats_are_the_nearest_visible_blocks_within_the_budget(lund_store: Path) -> None:
    from tools.view.splats import nearest_within, splat_node_arrays

    with Store.open(lund_store, mode="r") as store:
        table = dict(store.table)
        key = max(table, key=lambda k: table[k].count)
        lo, hi = np.array(table[key].extent[:3]), np.array(table[key].extent[3:])
        eye = (lo + hi) / 2 + 3 * (hi - lo)  # outside every extent box but near this one
        keys = sorted(table)
        everything = nearest_within(keys, table, eye, budget=10**9)
        assert sorted(everything) == keys
        gaps = [np.linalg.norm(np.maximum(np.maximum(np.array(table[k].extent[:3]) - eye,
                                                     eye - np.array(table[k].extent[3:])), 0)) for k in everything]
        assert gaps == sorted(gaps) and gaps[0] > 0
        budget = sum(table[k].count for k in everything[:5]) + table[everything[5]].count - 1
        assert nearest_within(keys, table, eye, budget=budget) == everything[:5]  # the 6th does not fit
        assert nearest_within(keys, table, eye, budget=table[everything[0]].count - 1) == []
        with BlockCache(store, 1 << 20, params_only=True) as cache:
            arrays = splat_node_arrays(cache.get(key).tensors)
    n = table[key].count
    assert arrays["centers"].shape == (n, 3) and arrays["covariances"].shape == (n, 3, 3)
    assert arrays["rgbs"].shape == (n, 3) and arrays["opacities"].shape == (n, 1)
    assert np.all(np.linalg.eigvalsh(arrays["covariances"]) > 0)  # symmetric positive definite
    assert np.all((arrays["rgbs"] >= 0) & (arrays["rgbs"] <= 1)) and np.all((arrays["opacities"] > 0) & (arrays["opacities"] < 1))
