"""Options of `python -m tools.tile`, and its error type."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from octree.semantics import MAX_SH_DEGREE


class TileError(ValueError):
    """Input or output the tiler refuses; the message names the file and the problem."""


@dataclass(frozen=True)
class TileConfig:
    """How a source becomes a store.

    max_per_block: leaf capacity of the octree (Gaussians per block).
    min_cell_size: blocks are not split below this edge length (scene units of the store's frame);
        None allows down to the octree's finest level.
    sh_degree: SH degree of the store. None: the trained PLY's own, or 3 for points.
    memory_mb: working-memory budget. Inputs whose rows fit are sorted in memory; larger ones are
        sorted in chunks of this size into runs on disk (the external sort), and the k-NN search
        keeps at most a quarter of it in leaf point caches.
    overwrite: replace an existing store at the output path (never anything that is not a store).
    voxel_size: point clouds are first averaged in voxels of this size (open3d; in memory).
    init_random: Gaussians drawn in the cameras' view volume when a dataset has no points.
    data_factor: image downscale factor, passed to the dataset loader.
    init_opacity: opacity of Gaussians made from points (gsplat: 0.1; its mcmc preset: 0.5).
    init_scale: factor on the initial scale, the RMS distance to the 3 nearest points (gsplat: 1.0;
        its mcmc preset: 0.1).
    seed: seeds the random initialisation.
    scratch: folder for the external sort's runs; None: next to the output.
    allow_external_images: follow image paths that lead out of the dataset (see `DataConfig`).
    """

    max_per_block: int = 65536
    min_cell_size: float | None = None
    sh_degree: int | None = None
    memory_mb: float = 2048.0
    overwrite: bool = False
    voxel_size: float | None = None
    init_random: int = 100_000
    data_factor: int = 1
    init_opacity: float = 0.1
    init_scale: float = 1.0
    seed: int = 0
    scratch: Path | None = None
    allow_external_images: bool = False

    def __post_init__(self) -> None:
        if self.max_per_block < 1:
            raise TileError(f"--max-per-block must be at least 1, got {self.max_per_block}")
        if self.min_cell_size is not None and not self.min_cell_size > 0:
            raise TileError(f"--min-cell-size must be positive, got {self.min_cell_size}")
        if self.sh_degree is not None and not 0 <= self.sh_degree <= MAX_SH_DEGREE:
            raise TileError(f"--sh-degree must be in [0, {MAX_SH_DEGREE}], got {self.sh_degree}")
        if not self.memory_mb > 0:
            raise TileError(f"--memory-mb must be positive, got {self.memory_mb}")
        if self.voxel_size is not None and not self.voxel_size > 0:
            raise TileError(f"--voxel-size must be positive, got {self.voxel_size}")
        if self.init_random < 1:
            raise TileError(f"--init-random must be at least 1, got {self.init_random}")
        if not 0 < self.init_opacity < 1:
            raise TileError(f"--init-opacity must be in (0, 1), got {self.init_opacity}")
        if not (math.isfinite(self.init_scale) and self.init_scale > 0):
            raise TileError(f"--init-scale must be a positive number, got {self.init_scale}")

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_mb * 2**20)
