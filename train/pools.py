"""How the CPU kernels' thread pools run, set before numba and torch load (importing this module
loads neither).

A training step launches its parallel regions one after the other, many of them short (at 50k
splats each of the binning's several is under a millisecond), with serial Python between them.
What a region costs beyond its work is how soon the other cores join it:

- numba's TBB layer (chosen first by numba wherever `libtbb.so.12` happens to be installed: here
  it came with OpenCV's development package, on a fresh machine it is absent) opens a new task
  arena for every region, and a worker joins it late after a run of short regions: the records
  pass of the binning ran 1.05 ms alone and 1.75 ms right after the depth sort's regions, slower
  than on one thread.
- numba's OpenMP layer (GNU libgomp, on every Linux with gcc's runtime) keeps one team. With
  `OMP_WAIT_POLICY=PASSIVE` (which keeps numba's and torch's OpenMP pools from spinning against
  each other for milliseconds) its worker sleeps at the end of every region, and waking it costs
  each region again: a 50k-Gaussian step took 44.6 ms against 42.4 under TBB.
- libgomp's workers spinning `GOMP_SPINCOUNT` = 10,000 times (about 0.1 ms) before sleeping
  pick up the next short region at once and leave the cores to the other pool soon after:
  41.1 ms, the binning 3.45 ms against 4.93 under TBB (docs/benchmarks.md, ## opensplat).

So numba is asked for OpenMP first (then TBB, then its own work queue), and every setting is
a default that a run can override from its environment. Results do not depend on the layer: every
kernel computes each value in a fixed order whatever thread runs it.
"""
from __future__ import annotations

import os

POOL_ENVIRONMENT = {
    "NUMBA_THREADING_LAYER_PRIORITY": "omp tbb workqueue",
    "OMP_WAIT_POLICY": "PASSIVE",  # any OpenMP runtime: sleep between regions, never spin for long
    "GOMP_SPINCOUNT": "10000",  # GNU libgomp (numba's and torch's): but spin this long first
}


def configure_pools() -> None:
    """Set the pools' environment (`POOL_ENVIRONMENT`) where the caller has not; to take effect it
    must run before numba or torch is imported."""
    for name, value in POOL_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
