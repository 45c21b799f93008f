"""Shared fixtures: where the real test data lives."""
from __future__ import annotations

from pathlib import Path

from train.pools import configure_pools

configure_pools()  # the trainer's thread pools here too, before numba and torch load

import pytest  # noqa: E402

from tools.bench import data_dir  # noqa: E402
from tools.make_scene import main as make_scene_main  # noqa: E402
from tools.tile.__main__ import main as tile_main  # noqa: E402
from train.render.cpu.compiled import ensure_compiled  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def shared_data() -> Path:
    d = data_dir()
    if not d.is_dir():
        pytest.skip(f"real test data not found at {d} (set OCTOSPLAT_DATA)")
    return d


@pytest.fixture(scope="session", autouse=True)
def cached_kernels() -> None:
    """Tests compare this process's results with trainer processes': all must run the kernels
    numba cached on disk, not a fresh compile (see `train/render/cpu/compiled.py`)."""
    ensure_compiled()


@pytest.fixture(scope="session")
def lund_store(shared_data: Path, tmp_path_factory) -> Path:
    """lund_door tiled once into small blocks (60 of at most 600); copy it before training it."""
    out = tmp_path_factory.mktemp("tiled") / "lund.zarr"
    assert tile_main([str(shared_data / "lund_door"), "--out", str(out), "--max-per-block", "600"]) == 0
    return out


@pytest.fixture(scope="session")
def wall(tmp_path_factory) -> tuple[Path, Path]:
    """A generated 120 m facade, tiled into 64 blocks; the blocks any camera sees hold at most 17%
    of the Gaussians, so a cache of a quarter of the scene suffices and really pages. Copy the
    store before training it."""
    root = tmp_path_factory.mktemp("wall")
    assert make_scene_main(["wall", str(root / "data"), "--wall-length", "120", "--cameras", "32"]) == 0
    assert tile_main([str(root / "data"), "--out", str(root / "wall.zarr"), "--max-per-block", "400"]) == 0
    return root / "data", root / "wall.zarr"
