"""Which cameras each step trains on: a pure function of (seed, number of cameras, batch, step).

No RNG state needs saving: a resumed run asks for step s and gets the batch an uninterrupted run
got. Each epoch is a fresh seeded permutation; a global batch may straddle two epochs.
"""
from __future__ import annotations

import numpy as np


def epoch_permutation(seed: int, num_cameras: int, epoch: int) -> np.ndarray:  # [num_cameras]
    rng = np.random.default_rng([seed, epoch])
    return rng.permutation(num_cameras)


def step_cameras(seed: int, num_cameras: int, batch_size: int, step: int) -> np.ndarray:  # [batch_size]
    """Indices into the training cameras for global step `step` (0-based)."""
    if num_cameras <= 0:
        raise ValueError("no training cameras")
    flat = np.arange(step * batch_size, (step + 1) * batch_size)
    epochs, pos = np.divmod(flat, num_cameras)
    out = np.empty(batch_size, dtype=np.int64)
    for e in np.unique(epochs):
        sel = epochs == e
        out[sel] = epoch_permutation(seed, num_cameras, int(e))[pos[sel]]
    return out
