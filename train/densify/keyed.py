"""Random numbers keyed by what they are for, never drawn from a global stream.

A refinement's samples come from a generator seeded by (seed, step, block, purpose): the same
Gaussians in the same block get the same numbers whichever rank refines the block, in whatever
order blocks are paged, and after a resume.
"""
from __future__ import annotations

import numpy as np
import torch

from octree.keys import parse_key

SPLIT = 1  # the split samples of the default strategy
NOISE = 2  # MCMC's noise on the means
RELOCATE = 3  # MCMC's choice of where dead Gaussians go


def keyed_generator(seed: int, step: int, key: str, purpose: int) -> torch.Generator:
    """A CPU generator for one block's draws of one kind at one step (draw on the CPU, then move:
    the numbers must not depend on the device)."""
    k = parse_key(key)
    state = np.random.SeedSequence([seed, step, k.depth, k.code, purpose]).generate_state(2, np.uint32)
    return torch.Generator(device="cpu").manual_seed(int(state[0]) << 32 | int(state[1]))
