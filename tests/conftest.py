"""Shared fixtures: where the real test data lives."""
from __future__ import annotations

from pathlib import Path

import pytest

from tools.bench import data_dir
from train.render.cpu.compiled import ensure_compiled

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
