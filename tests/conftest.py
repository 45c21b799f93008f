"""Shared fixtures: where the real test data lives, and a guard that keeps torch to one thread."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def data_dir() -> Path:
    env = os.environ.get("OCTOSPLAT_DATA")
    return Path(env) if env else REPO.parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    d = data_dir()
    if not d.is_dir():
        pytest.skip(f"real test data not found at {d} (set OCTOSPLAT_DATA)")
    return d
