"""Split Morton-ordered blocks into R contiguous rank regions of balanced weight."""
from __future__ import annotations

import numpy as np

_BISECTION_STEPS = 200  # more than enough to reach float64 resolution of the capacity


def _prefix(weights: np.ndarray) -> np.ndarray:  # [B] -> [B + 1]
    return np.concatenate([[0.0], np.cumsum(np.asarray(weights, dtype=np.float64))])


def region_weights(weights: np.ndarray, bounds: np.ndarray) -> np.ndarray:  # [B], [R + 1] -> [R]
    prefix = _prefix(weights)
    return prefix[bounds[1:]] - prefix[bounds[:-1]]


def _greedy(prefix: np.ndarray, cap: float, parts: int) -> np.ndarray:  # -> bounds [parts + 1]
    """Fill each region up to `cap`; the last one takes the rest. Minimises the region count for `cap`."""
    n = len(prefix) - 1
    bounds = np.zeros(parts + 1, dtype=np.int64)
    for r in range(parts):
        start = int(bounds[r])
        end = int(np.searchsorted(prefix, prefix[start] + cap, side="right")) - 1
        if n >= parts:
            # At least one block per region, and one left for each region after this one.
            end = min(max(end, start + 1), n - (parts - r - 1))
        bounds[r + 1] = min(end, n)
    bounds[parts] = n
    return bounds


def partition(weights: np.ndarray, parts: int) -> np.ndarray:  # weights [B] -> bounds [parts + 1]
    """Bounds b of `parts` contiguous regions, region r = blocks [b[r], b[r+1]), minimising the heaviest.

    The optimum of the linear partition problem, by bisection on the capacity with a greedy
    feasibility check (O(parts log B) each). Every region gets at least one block when B >= parts;
    otherwise the trailing regions are empty.
    """
    w = np.asarray(weights, dtype=np.float64)
    if parts < 1:
        raise ValueError(f"need at least one region, got {parts}")
    if w.ndim != 1 or not np.isfinite(w).all() or (w < 0).any():
        raise ValueError("block weights must be a 1D array of finite non-negative numbers")
    prefix = _prefix(w)

    def feasible(cap: float) -> bool:
        bounds = _greedy(prefix, cap, parts)
        return float(np.max(prefix[bounds[1:]] - prefix[bounds[:-1]])) <= cap

    # The heaviest region weighs at least the heaviest block and at least the mean.
    lo = max(float(w.max()) if len(w) else 0.0, float(prefix[-1]) / parts)
    hi = float(prefix[-1])
    if feasible(lo):
        return _greedy(prefix, lo, parts)
    for _ in range(_BISECTION_STEPS):
        mid = 0.5 * (lo + hi)
        if not lo < mid < hi:
            break
        lo, hi = (lo, mid) if feasible(mid) else (mid, hi)
    return _greedy(prefix, hi, parts)
