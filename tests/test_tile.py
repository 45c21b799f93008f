"""`tools.tile` on the real data and on synthetic inputs: counts, parameters, streaming, bad input."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image
from plyfile import PlyData, PlyElement
from scipy.spatial import cKDTree

from octree import RootCube, build_octree
from octree.keys import MAX_DEPTH, parse_key
from octree.semantics import SH_C0
from storage import Store
from storage.schema import PARAM_NAMES
from tests.conftest import REPO
from tools.ply import open_ply, write_ply
from tools.scenes import clustered_points, random_colors, random_splats
from tools.tile import TileConfig, TileError, tile
from tools.tile.__main__ import main as tile_main


def blocks_in_morton_order(path) -> tuple[Store, list[str]]:
    store = Store.open(path, mode="r")
    return store, sorted(store.table, key=lambda k: parse_key(k).morton_rank())


def read_store(path) -> tuple[Store, dict[str, np.ndarray]]:
    """The store and all its rows, block after block in Morton order."""
    store, keys = blocks_in_morton_order(path)
    blocks = [store.read_block(k) for k in keys]
    return store, {name: np.concatenate([b[name] for b in blocks]) for name in blocks[0]}


def sorted_rows(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Rows in a canonical order (by their bits), to compare row sets regardless of order."""
    n = len(arrays["means"])
    bits = np.concatenate([np.ascontiguousarray(arrays[k]).reshape(n, -1).view(np.uint32) for k in PARAM_NAMES], axis=1)
    order = np.lexsort(bits.T[::-1])
    return {k: arrays[k][order] for k in PARAM_NAMES}


def assert_same_rows(a: dict, b: dict) -> None:
    a, b = sorted_rows(a), sorted_rows(b)
    for k in PARAM_NAMES:
        assert a[k].shape == b[k].shape, k
        assert np.array_equal(a[k].view(np.uint32), b[k].view(np.uint32)), k


def check_blocks(store: Store, cap: int) -> None:
    """Every row inside its block's cell; cells from the stored root cube; the cap holds."""
    octree = store.attrs["octree"]
    root = RootCube.from_attrs(octree)
    for key, info in store.table.items():
        cell = root.cell(parse_key(key))
        assert info.cell == cell
        means = store.read_params(key)["means"].astype(np.float64)
        assert ((means >= cell[:3]) & (means < cell[3:])).all(), key
        assert info.count <= cap or parse_key(key).depth == octree["max_depth"]


def expected_init(means: np.ndarray, colors: np.ndarray, min_scale: float, sh_degree: int = 3,
                  init_opa: float = 0.1, init_scale: float = 1.0) -> dict:
    """gsplat's initialisation computed with one global k-d tree (over the float32 means, as stored)."""
    p = means.astype(np.float32).astype(np.float64)
    d, _ = cKDTree(p).query(p, k=4)
    scale = np.log(np.maximum(np.sqrt((d[:, 1:] ** 2).mean(axis=1)) * init_scale, min_scale)).astype(np.float32)
    n = len(means)
    return {
        "means": means.astype(np.float32),
        "scales": np.repeat(scale[:, None], 3, axis=1),
        "quats": np.tile(np.float32([1, 0, 0, 0]), (n, 1)),
        "opacities": np.full(n, np.log(init_opa / (1 - init_opa)), np.float32),
        "sh0": ((colors.astype(np.float32) / np.float32(255) - np.float32(0.5)) / np.float32(SH_C0)).reshape(n, 1, 3),
        "shN": np.zeros((n, (sh_degree + 1) ** 2 - 1, 3), np.float32),
    }


def test_garden_npz(shared_data, tmp_path):
    src = shared_data / "test_garden.npz"
    summary = tile(src, tmp_path / "garden", TileConfig(max_per_block=40_000))
    with np.load(src) as data:
        means, colors = data["means3d"], data["colors"]
    assert summary.gaussians == len(means) == 138_766 and summary.dropped == 0
    store, rows = read_store(tmp_path / "garden")
    assert sum(i.count for i in store.table.values()) == 138_766 == summary.gaussians
    assert store.sh_degree == 3 and np.array_equal(store.attrs["world_transform"], np.eye(4))
    check_blocks(store, 40_000)
    # The blocks are the leaves of the in-memory octree over the same points.
    tree = build_octree(means, 40_000, root=RootCube.from_attrs(store.attrs["octree"]))
    assert sorted(store.table, key=lambda k: parse_key(k).morton_rank()) == [k.name for k in tree.keys]
    assert [store.table[k.name].count for k in tree.keys] == tree.counts.tolist()
    # Parameters: gsplat's initialisation with an exact global 3-NN.
    min_scale = store.attrs["octree"]["root_size"] / 2**MAX_DEPTH
    assert_same_rows(rows, expected_init(means, colors, min_scale))
    assert all(not rows[k].any() for k in rows if k not in PARAM_NAMES)  # Adam state and stats start at zero
    assert summary.bytes_on_disk < summary.raw_bytes


@pytest.mark.parametrize("dataset, expected", [("lund_door", 11_384), ("vesta_colmap_bin", 1_465)])
def test_colmap_datasets(shared_data, tmp_path, dataset, expected):
    from train.data import DataConfig, load_scene

    summary = tile(shared_data / dataset, tmp_path / "s", TileConfig(max_per_block=4000))
    scene = load_scene(shared_data / dataset, DataConfig(check_images=False))
    store, rows = read_store(tmp_path / "s")
    assert summary.gaussians == expected == len(rows["means"])
    # The store's frame is the loader's normalised frame, and it says how to get back.
    assert np.array_equal(np.array(store.attrs["world_transform"]), scene.world_transform)
    min_scale = store.attrs["octree"]["root_size"] / 2**MAX_DEPTH
    assert_same_rows(rows, expected_init(scene.points, scene.colors, min_scale))
    check_blocks(store, 4000)


def test_gsplats_mcmc_preset_initialisation(shared_data, tmp_path, capsys):
    """simple_trainer's mcmc preset starts from init_opa 0.5 and init_scale 0.1: the tiler's
    --init-opacity and --init-scale give exactly its parameters."""
    from train.data import DataConfig, load_scene

    code, _, err = run_cli(capsys, shared_data / "vesta_colmap_bin", "--out", tmp_path / "s", "--init-opacity", "0.5",
                           "--init-scale", "0.1")
    assert code == 0, err
    scene = load_scene(shared_data / "vesta_colmap_bin", DataConfig(check_images=False))
    store, rows = read_store(tmp_path / "s")
    min_scale = store.attrs["octree"]["root_size"] / 2**MAX_DEPTH
    expected = expected_init(scene.points, scene.colors, min_scale, init_opa=0.5, init_scale=0.1)
    assert_same_rows(rows, expected)
    assert not np.array_equal(sorted_rows(rows)["scales"], sorted_rows(expected_init(scene.points, scene.colors, min_scale,
                                                                                     init_opa=0.5))["scales"])
    for bad in ("0", "-1", "nan"):
        code, _, err = run_cli(capsys, shared_data / "vesta_colmap_bin", "--out", tmp_path / f"bad{bad}",
                               "--init-scale", bad)
        assert code == 1 and f"--init-scale must be a positive number, got {float(bad)}" in err
        assert not (tmp_path / f"bad{bad}").exists()


def write_point_cloud(path, points: np.ndarray, colors: np.ndarray) -> None:
    rows = np.zeros(len(points), dtype=[(a, "f4") for a in "xyz"] + [(c, "u1") for c in ("red", "green", "blue")])
    for i, a in enumerate("xyz"):
        rows[a] = points[:, i]
    for i, c in enumerate(("red", "green", "blue")):
        rows[c] = colors[:, i]
    PlyData([PlyElement.describe(rows, "vertex")]).write(str(path))


def test_streaming_sort_gives_the_same_store(tmp_path):
    points = clustered_points(12_000, seed=3)
    points[[5, 17, 11_999]] = [np.nan, 0, 0], [0, np.inf, 0], [0, 0, -np.inf]
    write_point_cloud(tmp_path / "cloud.ply", points, random_colors(12_000, seed=3))
    whole = tile(tmp_path / "cloud.ply", tmp_path / "whole", TileConfig(max_per_block=2500))
    # 0.1 MB: chunks of 1024 rows, so 12 sorted runs on disk and a k-NN cache of a few leaves.
    streamed = tile(tmp_path / "cloud.ply", tmp_path / "streamed", TileConfig(max_per_block=2500, memory_mb=0.1))
    assert whole.runs == 1 and streamed.runs == 12
    assert whole.dropped == streamed.dropped == 3 and whole.gaussians == 11_997
    a, keys = blocks_in_morton_order(tmp_path / "whole")
    b, keys_b = blocks_in_morton_order(tmp_path / "streamed")
    assert keys == keys_b and len(keys) > 4
    for key in keys:
        assert a.table[key] == b.table[key]
        block_a, block_b = a.read_block(key), b.read_block(key)
        for name in block_a:
            assert np.array_equal(block_a[name], block_b[name]), (key, name)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cloud.ply", "streamed", "whole"]  # no scratch left


@pytest.mark.parametrize("memory_mb", [2048, 0.5])
def test_trained_ply_round_trips_bit_for_bit(tmp_path, memory_mb):
    splats = random_splats(3000, 3, seed=11)
    write_ply(tmp_path / "in.ply", splats)
    summary = tile(tmp_path / "in.ply", tmp_path / "store", TileConfig(max_per_block=600, memory_mb=memory_mb))
    assert summary.runs == (1 if memory_mb > 1 else 3)
    store, rows = read_store(tmp_path / "store")
    assert store.sh_degree == 3 and len(store.table) > 4
    check_blocks(store, 600)
    # Export, as tools.export will: blocks in Morton order through the same writer.
    write_ply(tmp_path / "out.ply", {k: rows[k] for k in PARAM_NAMES})
    reader = open_ply(tmp_path / "out.ply")
    assert_same_rows(reader.read(0, reader.count), splats)
    assert (tmp_path / "out.ply").stat().st_size == (tmp_path / "in.ply").stat().st_size


def test_compressed_ply_input(tmp_path):
    splats = random_splats(2000, 1, seed=12)
    write_ply(tmp_path / "c.ply", splats, compressed=True)
    summary = tile(tmp_path / "c.ply", tmp_path / "store", TileConfig(max_per_block=700))
    assert summary.sh_degree == 1 and "compressed" in summary.source
    reader = open_ply(tmp_path / "c.ply")
    _, rows = read_store(tmp_path / "store")
    assert_same_rows(rows, reader.read(0, reader.count))


def test_transforms_dataset_without_points_starts_random(tmp_path):
    data = tmp_path / "scene"
    data.mkdir()
    frames = []
    for i, angle in enumerate(np.linspace(0, 2 * np.pi, 4, endpoint=False)):
        Image.new("RGB", (32, 24), (i * 40, 90, 200)).save(data / f"f{i}.png")
        eye = 4 * np.array([np.cos(angle), np.sin(angle), 0.5])
        forward = -eye / np.linalg.norm(eye)
        right = np.cross(forward, [0, 0, 1.0])
        right /= np.linalg.norm(right)
        up = np.cross(right, forward)
        c2w = np.eye(4)
        c2w[:3, :3] = np.stack([right, up, -forward], axis=1)  # OpenGL axes: camera looks down -z
        c2w[:3, 3] = eye
        frames.append({"file_path": f"f{i}.png", "transform_matrix": c2w.tolist()})
    (data / "transforms.json").write_text(json.dumps({"camera_angle_x": 0.7, "w": 32, "h": 24, "frames": frames}))
    summary = tile(data, tmp_path / "store", TileConfig(init_random=700, max_per_block=100))
    store, rows = read_store(tmp_path / "store")
    assert summary.gaussians == 700 == len(rows["means"]) and "random points" in summary.source
    assert not np.allclose(store.attrs["world_transform"], np.eye(4))
    check_blocks(store, 100)


def no_leftovers(folder, *keep: str) -> bool:
    return sorted(p.name for p in folder.iterdir()) == sorted(keep)


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = tile_main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_bad_inputs_fail_cleanly(tmp_path, capsys):
    write_point_cloud(tmp_path / "empty.ply", np.zeros((0, 3)), np.zeros((0, 3), np.uint8))
    np.savez(tmp_path / "nan.npz", means3d=np.full((5, 3), np.nan), colors=np.zeros((5, 3), np.uint8))
    np.savez(tmp_path / "nokey.npz", points=np.zeros((5, 3)))
    splats = random_splats(50, 1, seed=1)
    write_ply(tmp_path / "g.ply", splats)
    raw = (tmp_path / "g.ply").read_bytes()
    (tmp_path / "noopacity.ply").write_bytes(raw.replace(b"property float opacity\n", b""))
    (tmp_path / "cut.ply").write_bytes(raw[:-100])
    (tmp_path / "x.txt").write_text("hi")
    (tmp_path / "nodata").mkdir()
    inputs = ["empty.ply", "nan.npz", "nokey.npz", "g.ply", "noopacity.ply", "cut.ply", "x.txt", "nodata"]
    cases = [
        ("empty.ply", [], "empty.ply: empty input"),
        ("nan.npz", [], "nan.npz: all 5 rows have NaN or infinite values"),
        ("nokey.npz", [], "nokey.npz: npz lacks the 'means3d' array"),
        ("noopacity.ply", [], "noopacity.ply: 3DGS PLY lacks properties opacity"),
        ("cut.ply", [], "cut.ply: truncated: element 'vertex'"),
        ("g.ply", ["--sh-degree", "3"], "have SH degree 1; --sh-degree 3"),
        ("x.txt", [], "x.txt: not a recognised input"),
        ("missing.ply", [], "missing.ply: no such file"),
        ("nodata", [], "nodata: neither a COLMAP dataset"),
        ("g.ply", ["--max-per-block", "0"], "--max-per-block must be at least 1"),
    ]
    for src, extra, message in cases:
        code, out, err = run_cli(capsys, tmp_path / src, "--out", tmp_path / "out", *extra)
        assert code == 1 and out == "", src
        assert err.startswith("error: ") and message in err, err
        assert no_leftovers(tmp_path, *inputs), src


def test_existing_output_and_overwrite(tmp_path, capsys):
    np.savez(tmp_path / "a.npz", means3d=clustered_points(500, seed=1), colors=random_colors(500))
    np.savez(tmp_path / "b.npz", means3d=clustered_points(300, seed=2), colors=random_colors(300))
    assert run_cli(capsys, tmp_path / "a.npz", "--out", tmp_path / "s")[0] == 0
    code, _, err = run_cli(capsys, tmp_path / "b.npz", "--out", tmp_path / "s")
    assert code == 1 and "s: already exists (pass --overwrite" in err
    assert sum(i.count for i in Store.open(tmp_path / "s", mode="r").table.values()) == 500
    code, out, _ = run_cli(capsys, tmp_path / "b.npz", "--out", tmp_path / "s", "--overwrite")
    assert code == 0 and "Gaussians     300" in out and "compression" in out
    assert sum(i.count for i in Store.open(tmp_path / "s", mode="r").table.values()) == 300
    (tmp_path / "notastore").mkdir()
    (tmp_path / "notastore" / "precious.txt").write_text("keep me")
    code, _, err = run_cli(capsys, tmp_path / "b.npz", "--out", tmp_path / "notastore", "--overwrite")
    assert code == 1 and "is not an OctoSplat store; refusing to overwrite" in err
    assert (tmp_path / "notastore" / "precious.txt").read_text() == "keep me"
    assert no_leftovers(tmp_path, "a.npz", "b.npz", "s", "notastore")


def test_failure_while_writing_leaves_no_store(tmp_path, monkeypatch):
    np.savez(tmp_path / "a.npz", means3d=clustered_points(4000, seed=4), colors=random_colors(4000))
    written = []

    def failing_write_block(self, key, arrays, cell):
        if len(written) == 3:
            raise OSError(28, "No space left on device")
        written.append(key)
        return original(self, key, arrays, cell)

    original = Store.write_block
    monkeypatch.setattr(Store, "write_block", failing_write_block)
    with pytest.raises(OSError, match="No space left"):
        tile(tmp_path / "a.npz", tmp_path / "s", TileConfig(max_per_block=300, memory_mb=0.1))
    assert no_leftovers(tmp_path, "a.npz")


def test_command_line_process(tmp_path):
    (tmp_path / "bad.ply").write_bytes(b"ply\nformat binary_little_endian 1.0\nelement vertex 9\nproperty float x\n"
                                       b"property float y\nproperty float z\nend_header\n" + bytes(20))  # fmt: skip
    command = [sys.executable, "-m", "tools.tile", str(tmp_path / "bad.ply"), "--out", str(tmp_path / "t")]
    bad = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert bad.stderr.startswith("error: ") and "truncated" in bad.stderr
    assert not (tmp_path / "t").exists()


def test_config_errors():
    with pytest.raises(TileError, match="--memory-mb must be positive"):
        TileConfig(memory_mb=0)


def test_voxel_downsampling_merges_each_cluster(tmp_path):
    rng = np.random.default_rng(13)
    grid = np.stack(np.meshgrid(*[np.arange(7)] * 3, indexing="ij"), axis=-1).reshape(-1, 3)[:300]
    centres = 2.0 * grid + rng.uniform(-0.3, 0.3, (300, 3)) + 0.123  # 2 apart: never one voxel of 0.5
    colours = random_colors(300, seed=13)
    points = np.repeat(centres, 5, axis=0) + rng.normal(0, 1e-5, (1500, 3))  # 5 near-coincident copies
    write_point_cloud(tmp_path / "dense.ply", points, np.repeat(colours, 5, axis=0))
    summary = tile(tmp_path / "dense.ply", tmp_path / "s", TileConfig(voxel_size=0.5, max_per_block=100))
    _, rows = read_store(tmp_path / "s")
    assert summary.gaussians == 300 and "voxel-downsampled" in summary.source
    # Each merged point sits at its cluster's centre with the cluster's colour.
    dist, idx = cKDTree(centres).query(rows["means"].astype(np.float64))
    assert dist.max() < 1e-3 and len(set(idx.tolist())) == 300
    rgb = np.round((rows["sh0"][:, 0] * SH_C0 + 0.5) * 255).astype(int)
    assert np.abs(rgb - colours[idx]).max() <= 1
