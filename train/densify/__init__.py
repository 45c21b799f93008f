"""Adaptive density control across blocks and ranks: gsplat's strategies, refined block by block
(`default`, `mcmc`), moved between blocks and ranks, blocks split and merged (`refine`), hooked
into the training loop by `Densifier`."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
from torch import Tensor

from octree.keys import parse_key
from storage.rows import Block
from train.densify import mcmc
from train.densify.config import STRATEGIES, ConfigError, DensifyConfig
from train.densify.default import refines_at, resets_at
from train.densify.keyed import NOISE, RELOCATE, keyed_generator
from train.densify.refine import Prepare, RefineReport, Refiner
from train.exchange import Exchange
from train.region import Ownership

__all__ = ["STRATEGIES", "ConfigError", "DensifyConfig", "Densifier", "RefineReport", "Refiner"]

# (block key, its tensors, rows [R] the step saw) -> None: a change to the block after Adam
Perturb = Callable[[str, Block, Tensor], None]


class Densifier:
    """The strategy's hook into the loop: which steps end with a refinement or an opacity reset,
    which blocks a refinement covers, and (MCMC) the noise on the means after every step.

    The default strategy covers the blocks whose Gaussians gathered statistics since the last
    refinement (`observe`; kept in every commit, so a resume refines what the uninterrupted run
    would), and every owned block where a rule could change for a block nobody looked at: the
    first refinement, and the first after the too-large pruning starts (step > reset_every).
    Elsewhere a block without statistics could only be pruned, and it was not at the last
    refinement with the same parameters, unless they changed unseen: under dense Adam
    (`every_block`) every Gaussian moves every step, so every refinement covers every owned
    block. An opacity reset covers every owned block. MCMC covers every owned block: its draw is
    over the whole scene."""

    def __init__(self, cfg: DensifyConfig, store, cache, exchange: Exchange, scene_scale: float, seed: int,
                 pending: set[str], prepare: Prepare | None = None, every_block: bool = False) -> None:
        self.cfg, self.seed, self.every_block = cfg, seed, every_block
        self.refiner = Refiner(store, cache, exchange, cfg, scene_scale, seed, prepare)
        self.pending = set(pending)  # blocks with statistics since the last refinement
        refining = [s for s in range(cfg.refine_start_iter + 1, cfg.stop_iter) if self._refines(s)]
        self._full = {s for s in (refining[:1] + [s for s in refining if s > cfg.reset_every][:1])}
        self._last = refining[-1] if refining else -1

    def _refines(self, step: int) -> bool:
        return mcmc.refines_at(step, self.cfg) or refines_at(step, self.cfg)

    def due(self, step: int) -> bool:
        return self._refines(step) or resets_at(step, self.cfg)

    def observe(self, stepped: list[str], step: int) -> None:
        if step < self._last and self.cfg.strategy == "default":
            self.pending.update(stepped)

    def perturb(self, step: int, means_lr: float) -> Perturb | None:
        """MCMC's noise on the means of the step (after its update; `means_lr`: the next step's)."""
        if self.cfg.strategy != "mcmc":
            return None
        scaler = means_lr * self.cfg.noise_lr
        return lambda key, block, rows: mcmc.perturb_means(block, rows, scaler,
                                                          keyed_generator(self.seed, step, key, NOISE))

    def run(self, step: int, ownership: Ownership, rank: int) -> RefineReport | None:
        """The refinement or reset of `step` over this rank's blocks (Morton order); a report when
        the blocks changed shape (the trainer then commits), None after a reset alone."""
        table = self.refiner.store.table
        owned = ownership.keys_of(table, rank)
        if self.cfg.strategy == "mcmc":
            return self._mcmc(step, owned, ownership)
        reset = resets_at(step, self.cfg)
        if not refines_at(step, self.cfg):
            self.refiner.reset(step, owned)
            return None
        keys = owned if self.every_block or step in self._full else [k for k in owned if k in self.pending]
        report = self.refiner.refine(step, keys, ownership, reset)
        self.pending.clear()
        return report

    def _mcmc(self, step: int, owned: list[str], ownership: Ownership) -> RefineReport:
        """One pass for every block's live opacity mass and dead count, one allgather, the same
        allocation of draws to blocks on every rank; then each block relocates and grows."""
        refiner, cfg = self.refiner, self.cfg
        mine = {}
        for i, key in enumerate(owned):
            refiner.cache.prefetch(owned[i + 1 : i + 5])
            refiner.prepare(key, step + 1)
            mine[key] = mcmc.summarize(refiner.cache.get(key).tensors, cfg)
        every = {k: v for part in refiner.exchange.allgather(mine) for k, v in part.items()}
        table = refiner.store.table
        keys = sorted(table, key=lambda k: parse_key(k).morton_rank())
        total, dead = sum(table[k].count for k in keys), sum(every[k][1] for k in keys)
        draws = dict(zip(keys, mcmc.allocate(np.array([every[k][0] for k in keys]),
                                             mcmc.samples_wanted(total, dead, cfg), self.seed, step).tolist()))

        def grow(key: str, block: Block):
            return mcmc.relocate_block(block, draws[key], cfg, keyed_generator(self.seed, step, key, RELOCATE))

        return refiner.refine(step, owned, ownership, reset=False, grow=grow)
