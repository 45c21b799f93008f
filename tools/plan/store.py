"""The planner on a store that exists: its own blocks, Gaussians and extent boxes, the regions
the trainer would give R ranks (`train.region.Ownership.current`, saved regions included) and
the dataset's training cameras as the trainer loads them. Planned this way the figures are those
of a real run of the store (`tests/test_plan.py` checks them against `mpirun`'s byte counts)."""
from __future__ import annotations

import math

import numpy as np
import torch

from storage import Store
from storage.schema import block_schema
from tools.bench.mpi import Layout
from tools.plan.city import PlanError
from train.camera import Camera
from train.layout import BlockTable, ownership_weights
from train.region import Ownership

# What projection needs of a Gaussian; colours are not planned (SH degree 0), so shN keeps no coefficient.
_PROJECTED = ("means", "scales", "quats", "opacities", "sh0", "shN")


def store_layout(store: Store, ranks: int, cameras: list[Camera], max_samples: int) -> tuple[Layout, int]:
    """The store's blocks in Morton order over `ranks` trainer regions, and the weight each sample
    stands for: every Gaussian (weight 1) when the store holds at most `max_samples`, else every
    weight-th row of each block."""
    table = BlockTable.from_store(store.table)
    total = int(table.counts.sum())
    if total == 0:
        raise PlanError(f"--store {store.name}: holds no Gaussians")
    weight = max(1, math.ceil(total / max_samples))
    counts = -(-table.counts.astype(np.int64) // weight)  # samples per block: rows 0, weight, 2 weight, ...
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    # The samples are written into arrays made once: a block's arrays are let go as soon as its
    # rows are copied (slices kept as views held every block's whole parameters, SH included:
    # 11.6 GB of RSS for the 44.5 M city).
    schema = block_schema(store.sh_degree)
    splats = {name: np.empty((int(counts.sum()), *(schema[name][0] if name != "shN" else (0, 3))), schema[name][1])
              for name in _PROJECTED}
    for key, lo, n, rows in zip(table.keys, starts, counts, table.counts):
        params = store.read_params(key)
        if len(params["means"]) != rows:
            raise PlanError(f"--store {store.name}: block {key} holds {len(params['means'])} rows, its table {rows}")
        for name in _PROJECTED:
            if name != "shN":
                splats[name][lo:lo + n] = params[name][::weight]
    splats = {name: torch.from_numpy(a) for name, a in splats.items()}
    try:
        ownership = Ownership.current(store.state, store.table, ranks, cameras)
    except ValueError as e:
        raise PlanError(f"--store {store.name}: {e}") from e
    owners = np.array([ownership.owner(k) for k in table.keys], dtype=np.int64)  # non-decreasing: Morton order
    bounds = np.searchsorted(owners, np.arange(ranks + 1), side="left").astype(np.int64)
    work = ownership_weights(table.counts, table.extents, cameras)
    layout = Layout(splats, np.arange(len(splats["means"]), dtype=np.int64), starts, counts, table.extents, work,
                    bounds)
    return layout, weight
