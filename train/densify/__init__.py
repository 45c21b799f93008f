"""Adaptive density control across blocks and ranks: gsplat's strategies, refined block by block
(`default`), moved between blocks and ranks, blocks split and merged (`refine`), hooked into the
training loop by `Densifier`."""
from __future__ import annotations

from train.densify.config import STRATEGIES, ConfigError, DensifyConfig
from train.densify.default import refines_at, resets_at
from train.densify.refine import RefineReport, Refiner
from train.exchange import Exchange
from train.region import Ownership

__all__ = ["STRATEGIES", "ConfigError", "DensifyConfig", "Densifier", "RefineReport", "Refiner"]


class Densifier:
    """The strategy's hook into the loop: which steps end with a refinement or an opacity reset,
    and which blocks a refinement covers: those whose Gaussians gathered statistics since the
    last one (`observe`; kept in every commit, so a resume refines what the uninterrupted run
    would), and every owned block where a rule could change for a block nobody looked at: the
    first refinement, and the first after the too-large pruning starts (step > reset_every).
    Elsewhere a block without statistics could only be pruned, and it was not at the last
    refinement with the same parameters. An opacity reset covers every owned block."""

    def __init__(self, cfg: DensifyConfig, store, cache, exchange: Exchange, scene_scale: float, seed: int,
                 pending: set[str]) -> None:
        self.cfg = cfg
        self.refiner = Refiner(store, cache, exchange, cfg, scene_scale, seed)
        self.pending = set(pending)  # blocks with statistics since the last refinement
        refining = [s for s in range(cfg.refine_start_iter + 1, cfg.stop_iter) if refines_at(s, cfg)]
        self._full = {s for s in (refining[:1] + [s for s in refining if s > cfg.reset_every][:1])}
        self._last = refining[-1] if refining else -1

    def due(self, step: int) -> bool:
        return refines_at(step, self.cfg) or resets_at(step, self.cfg)

    def observe(self, stepped: list[str], step: int) -> None:
        if step < self._last:
            self.pending.update(stepped)

    def run(self, step: int, ownership: Ownership, rank: int) -> RefineReport | None:
        """The refinement or reset of `step` over this rank's blocks (Morton order); a report when
        the blocks changed shape (the trainer then commits), None after a reset alone."""
        table = self.refiner.store.table
        owned = ownership.keys_of(table, rank)
        reset = resets_at(step, self.cfg)
        if not refines_at(step, self.cfg):
            self.refiner.reset(owned)
            return None
        keys = owned if step in self._full else [k for k in owned if k in self.pending]
        report = self.refiner.refine(step, keys, ownership, reset)
        self.pending.clear()
        return report
