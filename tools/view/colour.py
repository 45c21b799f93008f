"""Block colours: by owner rank (a fixed palette, so a rank keeps its colour in every view and in
the map), by Gaussian count or by the step that last wrote the block (a colour ramp)."""
from __future__ import annotations

import numpy as np

from tools.view.config import COLOUR_MODES
from tools.view.scene import BlockScene

# matplotlib's tab10 then tab20's light half: 20 distinguishable ranks before colours repeat.
PALETTE = np.array([
    (31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
    (140, 86, 75), (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207),
    (174, 199, 232), (255, 187, 120), (152, 223, 138), (255, 152, 150), (197, 176, 213),
    (196, 156, 148), (247, 182, 210), (199, 199, 199), (219, 219, 141), (158, 218, 229),
], dtype=np.uint8)

# viridis at 5 stops, interpolated: dark = low, yellow = high.
_RAMP = np.array([(68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37)], dtype=np.float64)


def rank_colour(rank: int) -> tuple[int, int, int]:
    return tuple(int(v) for v in PALETTE[rank % len(PALETTE)])  # type: ignore[return-value]


def ramp(values: np.ndarray) -> np.ndarray:  # [B] -> [B, 3] uint8
    """Values mapped linearly from their minimum to their maximum onto the ramp."""
    v = np.asarray(values, dtype=np.float64)
    span = v.max() - v.min() if len(v) else 0.0
    t = (v - v.min()) / span if span > 0 else np.full(len(v), 0.5)
    x = t * (len(_RAMP) - 1)
    i = np.minimum(x.astype(np.int64), len(_RAMP) - 2)
    f = (x - i)[:, None]
    return np.round(_RAMP[i] * (1 - f) + _RAMP[i + 1] * f).astype(np.uint8)


def block_colours(scene: BlockScene, mode: str) -> np.ndarray:  # [B, 3] uint8, in scene.rows order
    if mode not in COLOUR_MODES:
        raise ValueError(f"colour mode {mode!r}: choose from {', '.join(COLOUR_MODES)}")
    if mode == "owner":
        return PALETTE[scene.owners % len(PALETTE)]
    if mode == "count":
        # Counts span orders of magnitude after densification: a log ramp keeps small blocks apart.
        return ramp(np.log(scene.counts))
    # A version whose commit was collected is older than every kept one: it gets the ramp's start.
    versions = np.array([r.info.version for r in scene.rows], dtype=np.float64)
    return ramp(versions)


def legend(scene: BlockScene, mode: str) -> list[tuple[tuple[int, int, int], str]]:
    """(colour, text) lines that explain `block_colours`."""
    if mode == "owner":
        owners, counts = scene.owners, scene.counts
        return [(rank_colour(r), f"rank {r}: {int((owners == r).sum())} blocks, {int(counts[owners == r].sum()):,} Gaussians")
                for r in range(scene.ranks)]
    if mode == "count":
        c = scene.counts
        return [(tuple(int(v) for v in _RAMP[0]), f"{int(c.min()):,} Gaussians"),
                (tuple(int(v) for v in _RAMP[-1]), f"{int(c.max()):,} Gaussians (log scale)")]
    lo = min(scene.rows, key=lambda r: r.info.version)
    hi = max(scene.rows, key=lambda r: r.info.version)
    name = lambda r: f"version {r.info.version}" + ("" if r.step is None else f" (step {r.step})")  # noqa: E731
    return [(tuple(int(v) for v in _RAMP[0]), f"oldest: {name(lo)}"), (tuple(int(v) for v in _RAMP[-1]), f"newest: {name(hi)}")]
