"""What a run of R ranks would hold, page and send, computed without rendering.

The layout is the trainer's (`train.layout`: the octree over the Gaussians, regions balanced by
`ownership_weights` over the training cameras, each step's cameras assigned by `assign_step` on
the Gaussians of visible blocks); the splats a camera gets are those `train.render.project` keeps
among the Gaussians of the blocks `frustum_cull` keeps (`tools.bench.mpi.splat_rows`), counted on
a sample of the Gaussians and multiplied by the weight each sample stands for.

Per step and rank:
- state: Gaussians owned x `bytes_per_gaussian(sh_degree)` (parameters, Adam moments, statistics:
  the store's and the cache's own rule);
- cache: the bytes of the owned blocks some camera of the step sees, which the owner pins at once
  (it projects its Gaussians into every camera of the step);
- exchange: a splat travels when its owner is not its camera's rank: 48 B forward (12 float32)
  and 40 B back (9 gradient float32 and the contributed flag); gsplat's distributed mode deals the
  Gaussians round robin, so (R - 1) / R of every camera's splats travel, 56 B forward and 40 B back
  (`tools.bench.mpi`). A rank sends its splats forward and receives their gradients, and the
  other way round for the cameras it renders; its link is busy max(out, in) / bandwidth.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from storage.schema import bytes_per_gaussian
from tools.bench.mpi import (
    GSPLAT_BACKWARD_BYTES,
    GSPLAT_FORWARD_BYTES,
    OURS_BACKWARD_BYTES,
    OURS_FORWARD_FLOATS,
    Layout,
    build_layout,
    splat_rows,
)
from train.camera import Camera
from train.layout import assign_step, rank_affinity, visible_mask

OURS_FORWARD_BYTES = OURS_FORWARD_FLOATS * 4  # float32 on the wire


@dataclass
class StepPlan:
    """One step: its cameras, who renders them, and what every rank pages and sends."""

    cameras: np.ndarray  # [C] int64 indices into the training cameras
    ranks: np.ndarray  # [C] int64 the rank rendering each
    splats: np.ndarray  # [C, R] float64 splats of camera c owned by rank r
    cache_bytes: np.ndarray  # [R] float64 bytes of owned blocks some camera of the step sees

    @property
    def pairs(self) -> np.ndarray:  # [C] splats of each camera
        return self.splats.sum(axis=1)

    def travelling(self) -> tuple[float, float]:
        """Splats that cross ranks: (ours, gsplat's round robin)."""
        local = self.splats[np.arange(len(self.ranks)), self.ranks]
        n_ranks = self.splats.shape[1]
        return float((self.pairs - local).sum()), float(self.pairs.sum() * (n_ranks - 1) / n_ranks)

    def rank_traffic(self) -> dict[str, np.ndarray]:
        """Splats each rank sends (it owns them, another renders) and receives (it renders, another owns),
        ours and round robin: name -> [R]."""
        n_ranks = self.splats.shape[1]
        mine = self.ranks[:, None] == np.arange(n_ranks)[None, :]  # [C, R] camera rendered by rank
        pairs = self.pairs[:, None]
        return {"ours sent": np.where(mine, 0.0, self.splats).sum(axis=0),
                "ours received": np.where(mine, pairs - self.splats, 0.0).sum(axis=0),
                "gsplat sent": np.where(mine, 0.0, pairs / n_ranks).sum(axis=0),
                "gsplat received": np.where(mine, pairs * (n_ranks - 1) / n_ranks, 0.0).sum(axis=0)}


def link_bytes(traffic: dict[str, np.ndarray], system: str) -> np.ndarray:  # -> [R] bytes on the busier direction
    """Forward splats one way, their gradients the other: each rank's outgoing and incoming bytes, the larger."""
    fwd, bwd = ((OURS_FORWARD_BYTES, OURS_BACKWARD_BYTES) if system == "ours"
                else (GSPLAT_FORWARD_BYTES, GSPLAT_BACKWARD_BYTES))
    sent, received = traffic[f"{system} sent"], traffic[f"{system} received"]
    return np.maximum(sent * fwd + received * bwd, received * fwd + sent * bwd)


@dataclass
class Plan:
    layout: Layout  # the samples in octree blocks and rank regions
    weight: int  # Gaussians each sample stands for
    sh_degree: int
    steps: list[StepPlan]

    @property
    def ranks(self) -> int:
        return self.layout.ranks

    def rank_gaussians(self) -> np.ndarray:  # [R] int64
        return self.layout.rank_gaussians() * self.weight

    def rank_blocks(self) -> np.ndarray:  # [R] int64
        return np.diff(self.layout.bounds)

    def rank_state_bytes(self) -> np.ndarray:  # [R] int64
        return self.rank_gaussians() * bytes_per_gaussian(self.sh_degree)

    def rank_cache_bytes(self) -> np.ndarray:  # [R] the most any planned step pins
        return np.max([s.cache_bytes for s in self.steps], axis=0)

    def mean_traffic(self) -> dict[str, np.ndarray]:  # name -> [R] splats per step
        per_step = [s.rank_traffic() for s in self.steps]
        return {k: np.mean([t[k] for t in per_step], axis=0) for k in per_step[0]}


def plan_run(splats: dict[str, np.ndarray],  # the samples, gsplat's parameters
             weight: int,  # Gaussians each sample stands for
             cameras: list[Camera],  # the training cameras
             steps: list[np.ndarray],  # each step's camera indices, R x per_rank of them
             ranks: int, per_rank: int, max_per_block: int, sh_degree: int,
             log: Callable[[str], None] = lambda line: None) -> Plan:
    """The trainer's layout and the given steps, on the samples (a leaf holds at most
    max_per_block // weight samples, so at most max_per_block Gaussians)."""
    layout = build_layout(splats, ranks, max(1, max_per_block // weight), cameras)
    log(f"layout: {len(layout.counts):,} blocks over {ranks} ranks")
    return plan_layout(layout, weight, cameras, steps, per_rank, sh_degree, log)


def plan_layout(layout: Layout, weight: int, cameras: list[Camera], steps: list[np.ndarray], per_rank: int,
                sh_degree: int, log: Callable[[str], None] = lambda line: None) -> Plan:
    """The given steps on a layout: a sampled city's (`plan_run`) or a store's (`tools.plan.store`)."""
    ranks = layout.ranks
    owner_of_row = layout.owner
    counts = layout.counts * weight  # [B] Gaussians
    block_bytes = counts * bytes_per_gaussian(sh_degree)
    block_rank = layout.block_rank
    planned = []
    for cams in steps:
        step_cams = [cameras[i] for i in cams]
        visible = np.array([visible_mask(layout.extents, c) for c in step_cams]).reshape(len(cams), -1)  # [C, B]
        cam_rank = assign_step(rank_affinity(counts, block_rank, ranks, visible), per_rank)
        splat_counts = np.zeros((len(cams), ranks))
        for i, cam in enumerate(step_cams):
            splat_counts[i] = np.bincount(owner_of_row[splat_rows(layout, cam, visible[i])], minlength=ranks) * weight
        seen = visible.any(axis=0)
        cache = np.bincount(block_rank[seen], weights=block_bytes[seen], minlength=ranks)
        planned.append(StepPlan(np.asarray(cams), cam_rank, splat_counts, cache))
        log(f"step {len(planned)} of {len(steps)}: {splat_counts.sum():,.0f} splats")
    return Plan(layout, weight, sh_degree, planned)
