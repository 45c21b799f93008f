"""The external sort's runs: each input chunk's rows grouped by leaf, in memory or as .npy files.

Leaf i's rows in run r are rows offsets[r][i] : offsets[r][i + 1], so a leaf is gathered with one
contiguous (memory-mapped) slice per run, and in input order, whatever the number of runs.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np


class Runs:
    def __init__(self, folder: Path | None) -> None:
        self.folder = folder  # None: keep runs in memory
        self.arrays: list[dict[str, np.ndarray]] = []
        self.offsets: list[np.ndarray] = []  # per run [B + 1], when grouped by leaf

    def add(self, arrays: dict[str, np.ndarray], offsets: np.ndarray | None = None) -> None:
        if self.folder is not None:
            stored = {}
            for name, a in arrays.items():
                if a.size == 0:  # nothing to map
                    stored[name] = a
                    continue
                file = self.folder / f"run{len(self.arrays)}-{name}.npy"
                np.save(file, a)
                stored[name] = np.load(file, mmap_mode="r")
            arrays = stored
        self.arrays.append(arrays)
        if offsets is not None:
            self.offsets.append(offsets)

    def column(self, name: str) -> list[np.ndarray]:
        return [run[name] for run in self.arrays]

    def gather(self, leaf: int, names: tuple[str, ...] | None = None) -> dict[str, np.ndarray]:
        names = names or tuple(self.arrays[0])
        pieces = [(run, off[leaf], off[leaf + 1]) for run, off in zip(self.arrays, self.offsets)]
        return {name: np.concatenate([run[name][a:b] for run, a, b in pieces]) for name in names}

    def clear(self) -> None:
        """Forget the runs (their files go with the scratch folder)."""
        self.arrays, self.offsets = [], []
