"""Shared fixtures: where the real test data lives."""
from __future__ import annotations

from pathlib import Path

import pytest

from tools.bench import data_dir

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def shared_data() -> Path:
    d = data_dir()
    if not d.is_dir():
        pytest.skip(f"real test data not found at {d} (set OCTOSPLAT_DATA)")
    return d
