"""Which rank renders which camera of a step.

A camera's splats cross the network unless the rank that renders it owns them, so each camera
should go to the rank owning most of what it sees; every rank must also render exactly its share
of the global batch. That is an assignment problem (cameras x rank slots), solved exactly.
"""
from __future__ import annotations

import numpy as np
from scipy.optimize import linear_sum_assignment


def assign_cameras(affinity: np.ndarray, per_rank: int) -> list[int]:
    """affinity [B, R]: Gaussians of rank r visible to camera b. Returns the rank of each camera.

    Maximises the splats that stay local, with exactly `per_rank` cameras per rank (B = R * per_rank).
    Ties resolve deterministically (the solver is deterministic for equal input).
    """
    n_cams, n_ranks = affinity.shape
    if n_cams != n_ranks * per_rank:
        raise ValueError(f"{n_cams} cameras cannot be split {per_rank} per rank over {n_ranks} ranks")
    slots = np.repeat(np.arange(n_ranks), per_rank)  # slot -> rank
    gain = affinity[:, slots].astype(np.float64)  # [B, B]
    cams, chosen = linear_sum_assignment(gain, maximize=True)
    ranks = np.empty(n_cams, dtype=np.int64)
    ranks[cams] = slots[chosen]
    return ranks.tolist()
