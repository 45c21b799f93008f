"""A refinement across blocks and ranks: densify each block, move the Gaussians that left their
cell, merge small siblings, split full blocks. The trainer commits the result.

Phases (every rank runs every collective, with or without work):
1. **grow** (each owner, block by block through the cache): the strategy's clone, split and
   prune on a block's rows; rows whose mean now lies outside the block's cell leave it. A mean
   beyond the root cube is filed under the border cell that holds it clamped onto the cube, so
   nothing is lost (see docs/densify.md).
2. **plan** (one allgather of small tables): every rank learns the new count of every block and
   where the leaving rows go, and computes the same merges (`octree.restructure.plan_merges`).
3. **route** (one `Exchange.send_rows`): leaving rows, and every row of a block that merges,
   go to the owner of their final block (`Ownership`: the region its cell starts in).
4. **assemble** (each owner): a final block's rows in canonical order, sorted by (kind, source
   block's Morton rank, row in it), kind 0 for rows of the block itself or of a block merged into
   it, 1 for rows that moved in; then a block over the cap splits into octree children (rows in
   their order). Every step is a pure function of the rows, never of who held them, so 1, 2 or 4
   ranks, any cache budget and a resume give the same blocks bit for bit.
"""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch

from octree.keys import BlockKey, parse_key
from octree.restructure import cell_holds, home_cells, plan_merges, split_rows
from octree.root import RootCube
from storage.rows import Block, pack_rows, take_rows, unpack_rows
from storage.schema import bytes_per_gaussian
from train.densify.config import DensifyConfig
from train.densify.default import Grown, refine_block, reset_opacities
from train.densify.keyed import SPLIT, keyed_generator
from train.exchange import Exchange
from train.region import Ownership

_HEADER = 5  # int64 per travelling row: final block (depth, code), kind, source block's Morton rank, source row
_PREFETCH = 4  # blocks read ahead while one is refined

# Called with (block key, steps done) before a refinement reads a block's values: the trainer's
# dense Adam brings the block's rows up to date there.
Prepare = Callable[[str, int], None]


def _as_is(key: str, done: int) -> None:
    """No preparation: the blocks in the cache are current."""


@dataclass
class RefineReport:
    """One rank's share of a refinement (sum over ranks for the scene's)."""

    refined: int = 0  # blocks this rank refined
    cloned: int = 0
    split: int = 0  # Gaussians split (each adds one)
    pruned: int = 0
    relocated: int = 0  # MCMC: dead Gaussians removed, their number drawn again among `added`
    added: int = 0  # MCMC: Gaussians drawn by opacity into this rank's blocks
    migrated_out: int = 0  # rows that left one of this rank's blocks for another block
    migrated_in: int = 0  # rows that arrived in one of this rank's blocks from another block
    blocks_split: int = 0  # blocks over the cap split into their children
    blocks_merged: int = 0  # parents made by merging small siblings
    bytes_sent: int = 0  # rows sent to other ranks
    seconds: float = 0.0

    def fields(self) -> dict:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(self).items()}


@dataclass
class _Travelling:
    """Rows on their way to their final block: header [n, _HEADER] int64 and the rows' arrays."""

    header: np.ndarray
    arrays: dict[str, np.ndarray]


class Refiner:
    """Refines the blocks a rank owns; `store`, `cache`, `exchange` and `ownership` are the
    trainer's, read at every call (the trainer replaces the ownership after a rebalance)."""

    def __init__(self, store, cache, exchange: Exchange, cfg: DensifyConfig, scene_scale: float, seed: int,
                 prepare: Prepare | None = None) -> None:
        self.store, self.cache, self.exchange, self.cfg = store, cache, exchange, cfg
        self.scene_scale, self.seed = scene_scale, seed
        self.prepare = prepare or _as_is
        octree = store.attrs["octree"]
        self.root = RootCube.from_attrs(octree)
        self.max_depth = int(octree["max_depth"])
        self.cap = int(cfg.max_per_block or octree["max_per_block"])
        self._row_bytes = bytes_per_gaussian(store.sh_degree)

    def reset(self, step: int, keys: list[str]) -> None:
        """Clamp every owned block's opacities (gsplat's reset), streamed through the cache."""
        for i, key in enumerate(keys):
            self.cache.prefetch(keys[i + 1 : i + 1 + _PREFETCH])
            self.prepare(key, step + 1)
            reset_opacities(self.cache.get(key).tensors, self.cfg.prune_opa)
            self.cache.mark_dirty(key)

    def refine(self, step: int, keys: list[str], ownership: Ownership, reset: bool,
               grow: Callable[[str, Block], Grown] | None = None) -> RefineReport:
        """Refine `keys` (owned blocks, Morton order) with `grow` (default: the default strategy's
        `refine_block`); then, if `reset`, reset every owned block's opacities. Leaves the cache
        dirty: the trainer commits."""
        start = time.perf_counter()
        report = RefineReport(refined=len(keys))
        table = self.store.table
        leaves = sorted(table, key=lambda k: parse_key(k).morton_rank())
        depths = np.array([parse_key(k).depth for k in leaves], dtype=np.int64)
        codes = np.array([parse_key(k).code for k in leaves], dtype=np.int64)

        # 1. grow
        grown = {k: info.count for k, info in table.items()}  # rows each block holds after growing
        leaving: list[_Travelling] = []
        arrivals: Counter[str] = Counter()
        for i, key in enumerate(keys):
            self.cache.prefetch(keys[i + 1 : i + 1 + _PREFETCH])
            stays, moves = self._home(key, self._grow(step, key, report, reset, grow), depths, codes, report)
            if moves is not None:
                leaving.append(moves)
                names, inverse = _targets(moves.header)
                arrivals.update(dict(zip(names, np.bincount(inverse).tolist())))
            grown[key] = int(stays["means"].shape[0])
            self._put(key, stays)  # (an empty block is dropped)
        if reset:
            refined = set(keys)
            self.reset(step, [k for k in ownership.keys_of(table, self.exchange.rank) if k not in refined])

        # 2. plan
        parts = self.exchange.allgather(({k: grown[k] for k in keys}, dict(arrivals)))
        for part_grown, _ in parts:
            grown.update(part_grown)
        after = dict(grown)  # rows each block holds once the moves land
        for _, part_arrivals in parts:
            for k, n in part_arrivals.items():
                after[k] = after.get(k, 0) + n
        after = {k: n for k, n in after.items() if n > 0}
        ordered = sorted(after, key=lambda k: parse_key(k).morton_rank())
        merged = {c.name: p.name for c, p in
                  plan_merges([parse_key(k) for k in ordered], [after[k] for k in ordered], self.cap // 4).items()}

        # 3. route: rows that left a block travel as kind 1, every row of a merging block as kind 0
        me = self.exchange.rank
        outgoing: dict[int, list[_Travelling]] = {}
        for moves in leaving:
            names, inverse = _targets(moves.header)
            finals = [merged.get(n, n) for n in names]
            _set_final(moves.header, finals, inverse)
            report.migrated_out += len(moves.header)
            owners = np.array([ownership.owner(f) for f in finals])[inverse]
            for dest in np.unique(owners).tolist():
                outgoing.setdefault(dest, []).append(_select(moves, owners == dest))
        for child in sorted(merged, key=lambda k: parse_key(k).morton_rank()):
            if ownership.owner(child) == me and grown.get(child, 0) > 0:
                rows = _numpy(self.cache.get(child).tensors)
                header = _header(merged[child], 0, child, np.arange(len(rows["means"])))
                outgoing.setdefault(ownership.owner(merged[child]), []).append(_Travelling(header, rows))
                self.cache.drop(child)
        received = self._send(outgoing, report)

        # 4. assemble
        names, inverse = _targets(received.header)
        arriving = {name: np.flatnonzero(inverse == i) for i, name in enumerate(names)}
        todo = set(arriving) | {k for k in keys if k not in merged and grown[k] > self.cap}
        report.blocks_merged = len({p for p in merged.values() if ownership.owner(p) == me})
        for key in sorted(todo, key=lambda k: parse_key(k).morton_rank()):
            rows_in = arriving.get(key, np.zeros(0, np.int64))
            report.migrated_in += int((received.header[rows_in, 2] == 1).sum())
            own = key not in merged and grown.get(key, 0) > 0
            self._place(key, self._assemble(key, own, _select(received, rows_in)), report)
        report.seconds = time.perf_counter() - start
        return report

    # ---- one block ----

    def _grow(self, step: int, key: str, report: RefineReport, reset: bool,
              grow: Callable[[str, Block], Grown] | None) -> Block:
        self.cache.pin([key])
        try:
            self.prepare(key, step + 1)
            tensors = self.cache.get(key).tensors
            if grow is None:
                grown = refine_block(tensors, step, self.cfg, self.scene_scale,
                                     keyed_generator(self.seed, step, key, SPLIT))
            else:
                grown = grow(key, tensors)
        finally:
            self.cache.unpin([key])
        for name in ("cloned", "split", "pruned", "relocated", "added"):
            setattr(report, name, getattr(report, name) + getattr(grown, name))
        if reset:
            reset_opacities(grown.block, self.cfg.prune_opa)
        return grown.block

    def _home(self, key: str, block: Block, depths: np.ndarray, codes: np.ndarray,
              report: RefineReport) -> tuple[Block, _Travelling | None]:
        """The rows that stay in the block, and the ones that leave it with their new cells."""
        means = block["means"].detach().cpu().numpy().astype(np.float64)
        point_codes = self.root.codes(means)  # clamped onto the border cells beyond the root cube
        stays = cell_holds(parse_key(key), point_codes)
        if stays.all():
            return block, None
        moving = np.flatnonzero(~stays)
        kept = take_rows(block, torch.from_numpy(np.flatnonzero(stays)).to(block["means"].device))
        d, c = home_cells(point_codes[moving], depths, codes)
        header = np.zeros((len(moving), _HEADER), np.int64)
        header[:, 0], header[:, 1] = d, c
        header[:, 3], header[:, 4] = parse_key(key).morton_rank(), moving
        rows = _numpy(take_rows(block, torch.from_numpy(moving).to(block["means"].device)))
        return kept, _Travelling(header, rows)

    def _assemble(self, key: str, own: bool, arrived: _Travelling) -> dict[str, np.ndarray]:
        """Every row of final block `key` (its own rows, if `own`, and what arrived), in
        canonical order: by kind, then source block's Morton rank, then row."""
        parts = [arrived]
        if own:
            rows = _numpy(self.cache.get(key).tensors)
            parts.insert(0, _Travelling(_header(key, 0, key, np.arange(len(rows["means"]))), rows))
        header = np.concatenate([p.header for p in parts])
        order = np.lexsort((header[:, 4], header[:, 3], header[:, 2]))
        return {n: np.concatenate([p.arrays[n] for p in parts])[order] for n in parts[0].arrays}

    def _place(self, key: str, rows: dict[str, np.ndarray], report: RefineReport) -> None:
        """Put a final block, split into its children while over the cap."""
        k = parse_key(key)
        parts = split_rows(self.root.codes(rows["means"].astype(np.float64)), k, self.cap, self.max_depth)
        if len(parts) > 1:
            report.blocks_split += 1
            self.cache.drop(key)
        for child, index in parts:
            self._put(child.name, {n: torch.from_numpy(np.ascontiguousarray(a[index])) for n, a in rows.items()})

    def _put(self, key: str, block: Block) -> None:
        """The block into the cache, dirty (an empty one is dropped instead)."""
        k = parse_key(key)
        cell = tuple(float(v) for v in self.root.cells(np.array([k.depth]), np.array([k.code]))[0])
        self.cache.put(key, block, cell)

    def _send(self, outgoing: dict[int, list[_Travelling]], report: RefineReport) -> _Travelling:
        schema = self.store.schema
        width = _HEADER * 8 + self._row_bytes
        packed = {}
        for dest, parts in outgoing.items():
            header = np.concatenate([p.header for p in parts])
            arrays = {n: np.concatenate([p.arrays[n] for p in parts]) for n in schema}
            packed[dest] = np.concatenate([header.view(np.uint8).reshape(len(header), -1), pack_rows(arrays, schema)], 1)
        report.bytes_sent = sum(int(p.nbytes) for d, p in packed.items() if d != self.exchange.rank)
        buf = self.exchange.send_rows(packed, width)
        header = np.ascontiguousarray(buf[:, : _HEADER * 8]).view(np.int64).reshape(len(buf), _HEADER)
        return _Travelling(header, unpack_rows(np.ascontiguousarray(buf[:, _HEADER * 8 :]), schema))


def _numpy(block: Block) -> dict[str, np.ndarray]:
    return {n: t.detach().cpu().numpy() for n, t in block.items()}


def _header(final: str, kind: int, source: str, rows: np.ndarray) -> np.ndarray:  # -> [n, _HEADER]
    k = parse_key(final)
    header = np.zeros((len(rows), _HEADER), np.int64)
    header[:, 0], header[:, 1], header[:, 2] = k.depth, k.code, kind
    header[:, 3], header[:, 4] = parse_key(source).morton_rank(), rows
    return header


def _targets(header: np.ndarray) -> tuple[list[str], np.ndarray]:
    """The distinct blocks the rows are bound for, and each row's index into them."""
    pairs, inverse = np.unique(header[:, :2], axis=0, return_inverse=True)
    return [BlockKey(int(d), int(c)).name for d, c in pairs], inverse.reshape(-1)


def _set_final(header: np.ndarray, finals: list[str], inverse: np.ndarray) -> None:
    """Rewrite the rows' destination (columns 0-1) to their final block and mark them moved (kind 1)."""
    keys = [parse_key(f) for f in finals]
    header[:, 0] = np.array([k.depth for k in keys], np.int64)[inverse]
    header[:, 1] = np.array([k.code for k in keys], np.int64)[inverse]
    header[:, 2] = 1


def _select(t: _Travelling, rows: np.ndarray) -> _Travelling:
    return _Travelling(t.header[rows], {n: a[rows] for n, a in t.arrays.items()})
