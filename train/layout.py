"""Who owns which block, what each camera sees, and which rank renders it: from block tables.

The one definition shared by the trainer (`train.region`, `train.trainer`), the exchange-volume
bench (`tools.bench.mpi`) and the planner (`python -m tools.plan`). Everything here works from a
block table (Morton-ordered keys, Gaussian counts, extent boxes), never from the Gaussians, so the
planner's figures for 10^9 Gaussians come from the code that trains 10^6.

- ownership: `ownership_weights` (what owning a block costs) and `balanced_bounds` (contiguous
  Morton ranges of balanced weight, `octree.partition`);
- visibility: `visible_mask` (a camera's frustum against the extent boxes, `octree.frustum_cull`
  with gsplat's splat semantics) and `visible_counts` / `rank_affinity` (Gaussians a camera may see:
  of one rank's blocks, or of every rank's);
- camera assignment: `assign_step` (each camera of a step to the rank owning most of what it sees,
  exactly the per-rank batch on each rank, `train.assign`).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from octree.cull import frustum_cull
from octree.keys import parse_key
from octree.partition import partition
from storage.schema import bytes_per_gaussian
from train.assign import assign_cameras
from train.camera import Camera


@dataclass(frozen=True, eq=False)
class BlockTable:
    """Blocks in Morton order: what ownership, culling and the cache need to know of each."""

    keys: list[str]  # [B] block keys ("<depth>-<hex code>")
    counts: np.ndarray  # [B] int64 Gaussians per block
    extents: np.ndarray  # [B, 6] float64 extent boxes (x0, y0, z0, x1, y1, z1)

    def __post_init__(self) -> None:
        if self.counts.shape != (len(self.keys),) or self.extents.shape != (len(self.keys), 6):
            raise ValueError(f"block table: {len(self.keys)} keys, counts {self.counts.shape}, "
                             f"extents {self.extents.shape}")

    @classmethod
    def from_store(cls, table: Mapping, keys: list[str] | None = None) -> "BlockTable":
        """table: `Store.table` (key -> BlockInfo); keys: the subset to take (default all)."""
        chosen = sorted(table if keys is None else keys, key=lambda k: parse_key(k).morton_rank())
        extents = np.array([table[k].extent for k in chosen], dtype=np.float64).reshape(-1, 6)
        counts = np.array([table[k].count for k in chosen], dtype=np.int64)
        return cls(chosen, counts, extents)

    def nbytes(self, sh_degree: int) -> np.ndarray:  # [B] int64
        """Bytes each block takes in the store's format and in the cache (parameters, Adam, statistics)."""
        return self.counts * bytes_per_gaussian(sh_degree)


def visible_mask(extents: np.ndarray, camera: Camera) -> np.ndarray:  # [B, 6] -> [B] bool
    """Blocks that may hold a Gaussian with a splat in the camera's image (never a false False)."""
    if len(extents) == 0:
        return np.zeros(0, dtype=bool)
    return frustum_cull(extents, camera.viewmat, camera.K, camera.width, camera.height)


def ownership_weights(counts: np.ndarray, extents: np.ndarray, cameras: list[Camera]) -> np.ndarray:  # [B], [B, 6] -> [B]
    """What owning each block costs: its owner projects, backpropagates and steps its Gaussians
    for every camera that sees them, so a block weighs its Gaussian count times the number of
    `cameras` whose frustum meets its extent box (its count alone when no camera sees anything).
    Counts alone left the owners of much-viewed regions with 1.5x the mean projection work."""
    weights = np.asarray(counts, dtype=np.float64)
    seen = np.zeros(len(weights))
    for c in cameras:
        seen += visible_mask(extents, c)
    return weights * seen if seen.any() else weights


def balanced_bounds(counts: np.ndarray, extents: np.ndarray, cameras: list[Camera], ranks: int) -> np.ndarray:
    """Bounds [ranks + 1] of the Morton-ordered blocks' rank regions, region r = blocks
    bounds[r]:bounds[r + 1], balanced by `ownership_weights` over the training `cameras`."""
    return partition(ownership_weights(counts, extents, cameras), ranks)


def block_ranks(bounds: np.ndarray) -> np.ndarray:  # [R + 1] -> [B] int64 the rank owning each block
    return np.repeat(np.arange(len(bounds) - 1), np.diff(bounds))


def visible_counts(counts: np.ndarray, extents: np.ndarray, cameras: list[Camera]) -> np.ndarray:  # -> [C] int64
    """Gaussians of the blocks each camera may see: a rank's column of the step's affinity."""
    return np.array([int(counts[visible_mask(extents, c)].sum()) for c in cameras], dtype=np.int64)


def rank_affinity(counts: np.ndarray, owner: np.ndarray,  # [B], [B] rank of each block
                  ranks: int, visible: np.ndarray) -> np.ndarray:  # [C, B] bool (`visible_mask` of each camera) -> [C, R] int64
    """Gaussians of rank r's blocks that camera c may see: what the trainer knows before it projects."""
    out = np.zeros((len(visible), ranks), dtype=np.int64)
    for i, seen in enumerate(visible):
        out[i] = np.bincount(owner[seen], weights=counts[seen], minlength=ranks).astype(np.int64)
    return out


def assign_step(affinity: np.ndarray, per_rank: int) -> np.ndarray:  # [C, R] -> [C] int64
    """Each camera of a step to a rank, exactly `per_rank` a rank, keeping the most splats local."""
    n_cams, n_ranks = affinity.shape
    if n_ranks == 1:
        return np.zeros(n_cams, dtype=np.int64)
    return np.asarray(assign_cameras(np.asarray(affinity, dtype=np.float64), per_rank), dtype=np.int64)
