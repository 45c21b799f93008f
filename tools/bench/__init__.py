"""Benchmarks: `python -m tools.bench NAME [options]`, one module per NAME, each with `main(argv)`."""
from __future__ import annotations

import os
from pathlib import Path


def data_dir() -> Path:
    """The real test scenes: $OCTOSPLAT_DATA, else ../shared/data beside the repository."""
    env = os.environ.get("OCTOSPLAT_DATA")
    return Path(env) if env else Path(__file__).resolve().parents[2].parent / "shared" / "data"
