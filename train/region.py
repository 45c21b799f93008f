"""The blocks one rank owns, with the boxes that culling needs, in Morton order."""
from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from octree.keys import parse_key
from train.camera import Camera
from train.layout import BlockTable, balanced_bounds, ownership_weights, visible_mask


@dataclass
class Region:
    keys: list[str]  # owned block keys in Morton order
    extents: np.ndarray  # [B, 6] extent boxes (x0, y0, z0, x1, y1, z1)
    counts: np.ndarray  # [B] Gaussians per block

    @classmethod
    def from_table(cls, table: dict, keys: list[str] | None = None) -> "Region":
        """table: store.table (key -> BlockInfo); keys: the owned subset (default all)."""
        t = BlockTable.from_store(table, keys)
        return cls(t.keys, t.extents, t.counts)

    def update_extents(self, extents: dict[str, tuple]) -> None:
        """Training moves and grows Gaussians: culling must use each block's current extent."""
        index = {k: i for i, k in enumerate(self.keys)}
        for k, box in extents.items():
            self.extents[index[k]] = box

    def union(self, key_lists: Iterable[Iterable[str]]) -> list[str]:
        """Owned keys that are in any of the lists, in Morton order."""
        seen = set().union(*key_lists)
        return [k for k in self.keys if k in seen]

    def visible(self, camera: Camera) -> list[str]:
        """Owned blocks whose extent box meets the camera's frustum, in Morton order."""
        keys = self.keys
        return [keys[i] for i in np.flatnonzero(visible_mask(self.extents, camera)).tolist()]


@dataclass(frozen=True)
class Ownership:
    """Which rank owns which part of the octree: R contiguous ranges of Morton order, cut at
    `cuts` (the Morton rank, `BlockKey.morton_rank()`, where each region after the first
    starts). A block belongs to the region its cell starts in, so a block made by a refinement
    (a split's children, a merged parent, a new cell) has an owner before anyone has seen it."""

    cuts: tuple[int, ...]  # [R - 1] non-decreasing

    @property
    def size(self) -> int:
        return len(self.cuts) + 1

    @classmethod
    def balanced(cls, table: dict, size: int, cameras: list[Camera]) -> "Ownership":
        """Regions of balanced `ownership_weights` over the training `cameras` (by count without)."""
        everything = BlockTable.from_store(table)
        bounds = balanced_bounds(everything.counts, everything.extents, cameras, size)
        starts = [parse_key(k).morton_rank() for k in everything.keys]
        end = 1 << 63  # past every cell: a region with no block starts there
        return cls(tuple(starts[b] if b < len(starts) else end for b in bounds[1:-1]))

    @classmethod
    def current(cls, state: dict, table: dict, size: int, cameras: list[Camera]) -> "Ownership":
        """The regions `size` ranks train a commit on: those its trainer saved in the commit's
        state (`to_state`) when it ran on `size` ranks, rebalanced as it went; else balanced.
        Raises ValueError when the saved regions are malformed."""
        saved = state.get("regions")
        if saved is None:
            return cls.balanced(table, size, cameras)
        if not isinstance(saved, dict) or set(saved) != {"ranks", "cuts"}:
            raise ValueError(f"commit state: 'regions' must be {{'ranks': R, 'cuts': [...]}}, not {saved!r:.80}")
        ranks, cuts = saved["ranks"], saved["cuts"]
        if (type(ranks) is not int or ranks < 1 or not isinstance(cuts, list) or len(cuts) != ranks - 1
                or any(type(c) is not int or not 0 <= c <= 1 << 63 for c in cuts)
                or any(a > b for a, b in zip(cuts, cuts[1:]))):
            raise ValueError(f"commit state: 'regions' needs ranks >= 1 and ranks - 1 non-decreasing Morton "
                             f"ranks in [0, 2^63] as cuts, not {saved!r:.80}")
        if ranks != size:
            return cls.balanced(table, size, cameras)
        return cls(tuple(cuts))

    def to_state(self) -> dict:
        """The regions as a commit's state keeps them (JSON)."""
        return {"ranks": self.size, "cuts": list(self.cuts)}

    def owner(self, key: str) -> int:
        return bisect.bisect_right(self.cuts, parse_key(key).morton_rank())

    def keys_of(self, table: dict, rank: int) -> list[str]:
        return [k for k in table if self.owner(k) == rank]

    def weights(self, table: dict, cameras: list[Camera]) -> np.ndarray:  # [R]
        """Each region's `ownership_weights`."""
        everything = BlockTable.from_store(table)
        w = ownership_weights(everything.counts, everything.extents, cameras)
        owners = np.array([self.owner(k) for k in everything.keys], dtype=np.int64)
        return np.bincount(owners, weights=w, minlength=self.size)
