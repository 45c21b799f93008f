"""Which cameras each step trains on: a pure function of (seed, number of cameras, batch, step)
and, for locality ordering, of where the cameras look.

No RNG state needs saving: a resumed run asks for step s and gets the batch an uninterrupted run
got. Each epoch is a fresh seeded permutation; a global batch may straddle two epochs.
"""
from __future__ import annotations

import functools

import numpy as np


@functools.lru_cache(maxsize=4)
def epoch_permutation(seed: int, num_cameras: int, epoch: int) -> np.ndarray:  # [num_cameras], read-only
    """Kept for the epoch's steps (a seeded generator costs ~0.1 ms, and each step asks)."""
    perm = np.random.default_rng([seed, epoch]).permutation(num_cameras)
    perm.flags.writeable = False
    return perm


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


def locality_order(features: np.ndarray) -> np.ndarray:  # features [W, F] -> [W] order
    """A greedy nearest-neighbour chain through the rows, starting at row 0: consecutive rows end
    up close together. Ties go to the lower index, so the order is a pure function of features."""
    n = len(features)
    order = np.empty(n, dtype=np.int64)
    left = np.ones(n, dtype=bool)
    current = 0
    for i in range(n):
        order[i] = current
        left[current] = False
        if i + 1 < n:
            d = np.where(left, np.linalg.norm(features - features[current], axis=1), np.inf)
            current = int(np.argmin(d))
    return order


class Schedule:
    """The cameras of every step: each epoch a seeded random permutation (`step_cameras`), and
    within each window of `window` consecutive steps (at most an epoch's worth) the steps
    reordered into a nearest-neighbour chain of their cameras' `features` (where they look), so
    that consecutive steps see mostly the same blocks and an out-of-core cache pages less. A step keeps its random cameras; only the
    order of steps inside a window changes, and every step still comes exactly once. A pure
    function of its arguments, as resuming needs."""

    def __init__(self, seed: int, num_cameras: int, batch_size: int,
                 features: np.ndarray | None = None,  # [num_cameras, F]
                 window: int = 0) -> None:
        if num_cameras <= 0:
            raise ValueError("no training cameras")
        self.seed, self.num_cameras, self.batch_size = seed, num_cameras, batch_size
        self.features = None if features is None else np.asarray(features, dtype=np.float64)
        # At most one epoch of steps: a longer window would chain a camera's visits of several
        # epochs together, training one view over and over (1.4 dB lost on lund_door at 500 steps).
        self.window = min(window, max(1, num_cameras // batch_size)) if self.features is not None and window > 1 else 1
        self._orders: dict[int, np.ndarray] = {}  # the window asked for last -> order of its steps
        # The steps asked for lately: the trainer asks for each step three times (planning it,
        # prefetching for it, training it), and a seeded permutation costs ~0.2 ms.
        self._recent: dict[int, np.ndarray] = {}

    def cameras(self, step: int) -> np.ndarray:  # [batch_size] indices into the training cameras
        if step not in self._recent:
            if len(self._recent) >= 4:
                del self._recent[next(iter(self._recent))]
            self._recent[step] = self._cameras(step)
        return self._recent[step].copy()

    def _cameras(self, step: int) -> np.ndarray:
        w, pos = divmod(step, self.window)
        if self.window == 1:
            return step_cameras(self.seed, self.num_cameras, self.batch_size, step)
        if w not in self._orders:
            first = w * self.window
            batches = [step_cameras(self.seed, self.num_cameras, self.batch_size, first + j) for j in range(self.window)]
            assert self.features is not None
            self._orders = {w: locality_order(np.stack([self.features[b].mean(axis=0) for b in batches]))}
        return step_cameras(self.seed, self.num_cameras, self.batch_size, w * self.window + int(self._orders[w][pos]))
