"""The block cache: blocks as torch tensors under a byte budget, paged in and written back.

One caller thread (the trainer) uses a cache; a small thread pool does the store I/O. Workers
only run pure I/O functions (read a block, write a block); every piece of bookkeeping happens in
the caller thread, so there are no locks. Zarr and numcodecs release the GIL while they read and
decode, so prefetching overlaps the caller's compute.

Budget: a tier counts the tensor bytes of its resident blocks plus the blocks in flight into it
(loads) or out of it (write-backs), plus the working memory its caller reserved (`working`: the
buffers a training step allocates beside its blocks), so that the budget bounds what a rank
holds. With a CUDA device there are two tiers, device memory and then pinned host memory; a
block evicted from the device moves to the host tier, and only the host tier writes back. On
CPU there is one tier.
"""
from __future__ import annotations

import contextlib
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from octree.bounds import Box
from storage.blockio import check_arrays
from storage.errors import (
    BlockDataError,
    BlockNotFoundError,
    CacheBudgetError,
    CommitProtocolError,
    StoreError,
    StoreWriteError,
)
from storage.schema import PARAM_NAMES, block_schema, bytes_per_gaussian
from storage.store import Store
from storage.table import BlockInfo, check_key, parse_box


@dataclass
class CacheStats:
    """Counters since the cache was made; bytes are raw (uncompressed) tensor bytes."""

    hits: int = 0  # get() found the block resident, or already loaded/loading by a prefetch
    misses: int = 0  # get() had to load the block itself
    bytes_read: int = 0
    bytes_written: int = 0
    io_wait_s: float = 0.0  # seconds the caller thread blocked on reads and write-backs
    io_s: float = 0.0  # seconds of store I/O by anyone; 1 - io_wait_s / io_s is the share that was hidden
    evictions: int = 0  # blocks that left the device tier
    writebacks: int = 0  # dirty blocks written to the store (eviction or flush)
    prefetch_skipped: int = 0  # prefetches dropped because only pinned blocks could have made room

    @property
    def hit_rate(self) -> float:
        return self.hits / max(1, self.hits + self.misses)


@dataclass(eq=False)
class Block:
    """A block in the cache. The trainer updates `tensors` in place and calls `mark_dirty`."""

    key: str
    cell: Box
    info: BlockInfo | None  # the stored version these tensors match; None if never written
    tensors: dict[str, Tensor]  # every array of the block schema, [N, ...], on the tier's device
    dirty: bool = False
    pins: int = 0
    _arrays: tuple[dict | None] | None = field(default=None, repr=False)  # (what `arrays` made,) once made

    def __setattr__(self, name: str, value: Any) -> None:
        # Arrays derived from tensors the block lets go of (evicted, moved to another tier) would
        # keep their memory alive outside the budget.
        if name == "tensors":
            object.__setattr__(self, "_arrays", None)
        object.__setattr__(self, name, value)

    def arrays(self, make: Callable[[dict[str, Tensor]], dict | None]) -> dict | None:
        """`make(tensors)` (numpy views of them, say), kept until `tensors` is replaced:
        the trainer steps the same resident blocks step after step, and 22 conversions to numpy
        cost more than the optimizer step of a small block. Dropped with the block."""
        if self._arrays is None:  # (reset whenever `tensors` is replaced: __setattr__)
            self._arrays = (make(self.tensors),)
        return self._arrays[0]

    @property
    def count(self) -> int:
        return int(self.tensors["means"].shape[0])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class _Tier:
    """An LRU of resident blocks on one device, with its byte accounting."""

    def __init__(self, device: torch.device, budget: int) -> None:
        self.device = device
        self.budget = budget
        self.blocks: OrderedDict[str, Block] = OrderedDict()  # least recently used first
        self.sizes: dict[str, int] = {}  # bytes of each block when it arrived
        self.used = 0  # bytes of resident blocks
        self.reserved = 0  # bytes in flight into or out of this tier
        self.working = 0  # bytes of the caller's working memory (`BlockCache.working`)

    @property
    def free(self) -> int:
        return self.budget - self.used - self.reserved - self.working

    def add(self, block: Block) -> None:
        self.blocks[block.key] = block
        self.sizes[block.key] = block.nbytes
        self.used += self.sizes[block.key]

    def pop(self, key: str) -> Block:
        self.used -= self.sizes.pop(key)
        return self.blocks.pop(key)

    def lru_unpinned(self) -> Block | None:
        return next((b for b in self.blocks.values() if b.pins == 0), None)

    def pinned_bytes(self) -> int:
        return sum(self.sizes[k] for k, b in self.blocks.items() if b.pins)


@dataclass
class _InFlight:
    """A load into the device tier, or a write-back."""

    future: Future
    reserved: int  # bytes counted against `tier` until this lands
    tier: _Tier
    info: BlockInfo | None = None  # loads: the version being read
    block: Block | None = None  # write-backs: the block being written
    nbytes: int = 0  # write-backs: the block's bytes (an evicted block lets go of its tensors)


@dataclass
class _Done:
    """What a worker hands back."""

    seconds: float
    tensors: dict[str, Tensor] = field(default_factory=dict)  # loads
    info: BlockInfo | None = None  # write-backs


class BlockCache:
    """Blocks of `store` as tensors on `device`, within `budget_bytes` (device tier) and
    `host_budget_bytes` (pinned host tier; on CUDA it defaults to budget_bytes, on CPU there is
    none unless it is given). params_only: blocks hold only the Gaussian parameters (a reader
    such as the viewer has no use for Adam state, two thirds of a block); such a cache never writes."""

    def __init__(
        self,
        store: Store,
        budget_bytes: int,
        device: str | torch.device = "cpu",
        host_budget_bytes: int | None = None,
        workers: int = 2,
        params_only: bool = False,
    ) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
        self.store = store
        self.device = torch.device(device)
        self.stats = CacheStats()
        self._tiers = [_Tier(self.device, budget_bytes)]
        if self.device.type == "cuda" or host_budget_bytes is not None:
            # On CPU a second tier is the same memory; it exists there so the tiering can be tested.
            self._tiers.append(_Tier(torch.device("cpu"), budget_bytes if host_budget_bytes is None else host_budget_bytes))
        self.params_only = params_only
        self._bytes_per_row = param_bytes_per_gaussian(store.sh_degree) if params_only else bytes_per_gaussian(store.sh_degree)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="block-io")
        self._loads: dict[str, _InFlight] = {}
        self._writes: dict[str, _InFlight] = {}
        self._written: dict[str, BlockInfo] = {}  # latest version this cache wrote, per key
        self._flushed: dict[str, BlockInfo] = {}  # written since the last flush: the next commit's updates
        self._removed: set[str] = set()  # dropped since the last flush: the next commit's removals
        self._sealed_head: int | None = None  # store head at the last flush, until the next commit
        self._sealed = False

    # ------------------------------------------------------------------ public

    def get(self, key: str) -> Block:
        """The block on the device, loading it if needed (waiting only for what a prefetch left)."""
        self._harvest_writes()
        top = self._tiers[0]
        if key in top.blocks:
            self.stats.hits += 1
            top.blocks.move_to_end(key)
            return top.blocks[key]
        if key in self._writes:
            self._wait(self._writes[key].future)
            self._harvest_writes()
        lower = next((t for t in self._tiers[1:] if key in t.blocks), None)
        if lower is not None:
            self.stats.hits += 1
            block = lower.pop(key)
            try:
                self._make_room(top, block.nbytes, f"block {key}")
            except BaseException:
                lower.add(block)
                raise
            block.tensors = _to_device(block.tensors, self.device)
            top.add(block)
            return block
        if key in self._loads:
            self.stats.hits += 1
            return self._claim(key)
        self.stats.misses += 1
        info = self._lookup(key)
        nbytes = info.count * self._bytes_per_row
        self._make_room(top, nbytes, f"block {key}")
        start = time.perf_counter()
        future = _run_now(self._load, info)  # a demand load needs no worker; the caller waits anyway
        self.stats.io_wait_s += time.perf_counter() - start
        self._loads[key] = _InFlight(future, nbytes, top, info=info)
        top.reserved += nbytes
        return self._claim(key)

    def prefetch(self, keys: Iterable[str]) -> None:
        """Start loading blocks in the background, in order, as far as the budget allows without
        evicting pinned blocks; a later `get` waits only for what is left."""
        top = self._tiers[0]
        for key in keys:
            if self._present(key):
                continue
            info = self._lookup(key)
            nbytes = info.count * self._bytes_per_row
            if self._make_room(top, nbytes, f"block {key}", demand=False):
                task = self._pool.submit(self._load, info)
            else:
                # The bytes of evicted blocks still being written become this load's: it starts once
                # those writes have landed and let go of their tensors, so memory never exceeds the budget.
                waits = self._take_from_writebacks(top, nbytes - top.free)
                if waits is None:
                    self.stats.prefetch_skipped += 1
                    continue
                task = self._pool.submit(self._load_after, waits, info)
            self._loads[key] = _InFlight(task, nbytes, top, info=info)
            top.reserved += nbytes

    def _present(self, key: str) -> bool:
        """In a tier, or on its way into or out of one: nothing for a prefetch to do."""
        return key in self._loads or key in self._writes or any(key in t.blocks for t in self._tiers)

    def holds(self, keys: Iterable[str]) -> bool:
        """Whether a `prefetch` of any of these keys would do nothing: every one is present."""
        return all(self._present(key) for key in keys)

    def pin(self, keys: Iterable[str]) -> list[Block]:
        """Load and pin blocks: a pinned block is never evicted. All or nothing."""
        pinned: list[Block] = []
        try:
            for key in keys:
                block = self.get(key)
                block.pins += 1
                pinned.append(block)
        except BaseException:
            for block in pinned:
                block.pins -= 1
            raise
        return pinned

    def unpin(self, keys: Iterable[str]) -> None:
        for key in keys:
            block = self._tiers[0].blocks.get(key)
            if block is None or block.pins == 0:
                raise StoreError(f"cache of store {self.store.name}: block {key} is not pinned")
            block.pins -= 1

    def put(self, key: str, tensors: Mapping[str, Tensor], cell: Box) -> Block | None:
        """Add a new block or replace one (e.g. after densification; a replaced block keeps its
        pins); it is dirty. An empty block is dropped instead (returns None): empty blocks are
        not stored."""
        where = f"cache of store {self.store.name}, block {key}"
        self._check_full(where)
        check_key(key, where)
        cell = parse_box(cell, f"{where}: cell box", BlockDataError)
        if check_arrays(tensors, self.store.schema, where, array_type=Tensor) == 0:
            self.drop(key)
            return None
        old = self._forget(key, pinned_ok=True)
        self._make_room(self._tiers[0], sum(t.numel() * t.element_size() for t in tensors.values()), f"block {key}")
        block = Block(key, cell, None, _to_device(dict(tensors), self.device), dirty=True, pins=old.pins if old else 0)
        self._tiers[0].add(block)
        self._removed.discard(key)
        return block

    def drop(self, key: str) -> None:
        """Remove a block; the next flush reports it for removal from the store."""
        self._forget(key)
        self._flushed.pop(key, None)
        self._written.pop(key, None)
        if key in self.store.table:
            self._removed.add(key)

    def release(self, keys: Iterable[str]) -> None:
        """Let go of clean blocks this process no longer needs (another process owns them now);
        unlike `drop`, the store keeps them."""
        for key in keys:
            if key in self._loads:
                self._discard_load(key)
            for tier in self._tiers:
                block = tier.blocks.get(key)
                if block is not None:
                    if block.dirty or block.pins:
                        raise StoreError(f"cache of store {self.store.name}: block {key} is "
                                         f"{'dirty' if block.dirty else 'pinned'}; only a clean block is released")
                    tier.pop(key)

    def mark_dirty(self, key: str) -> None:
        block = self._tiers[0].blocks.get(key)
        if block is None:
            raise BlockNotFoundError(f"cache of store {self.store.name}: block {key} is not on the device")
        if self.params_only:  # (the message is made only then: a step marks hundreds of blocks)
            self._check_full(f"cache of store {self.store.name}, block {key}")
        block.dirty = True

    def flush(self) -> tuple[dict[str, BlockInfo], list[str]]:
        """Write back every dirty block and wait for all write-backs. Returns the table entries
        and removed keys for the next `store.commit`. Until that commit (or `store.refresh()`
        on other ranks) the cache refuses to write again: a write now would reuse the version
        number these entries name."""
        for tier in self._tiers:
            for block in [b for b in tier.blocks.values() if b.dirty]:
                self._write_back(block, tier, evicted=False)
        self._settle_writes()
        start = time.perf_counter()
        self.store.sync_written()  # another process may commit what this one wrote
        self.stats.io_wait_s += time.perf_counter() - start
        updated, removed = dict(self._flushed), sorted(self._removed)
        self._flushed.clear()
        self._removed.clear()
        self._sealed, self._sealed_head = True, self.store.head
        return updated, removed

    def resident(self) -> Iterator[Block]:
        """Blocks on the device tier, least recently used first."""
        return iter(list(self._tiers[0].blocks.values()))

    @property
    def budget(self) -> int:
        """Bytes the device tier may hold."""
        return self._tiers[0].budget

    @property
    def host_budget(self) -> int:
        """Bytes the tier in host memory may hold (the only tier on CPU; the pinned tier behind a GPU)."""
        return self._tiers[-1].budget

    def set_host_budget(self, nbytes: int) -> None:
        """Change the host tier's budget, between steps (`train.memory`: a ceiling on the process's
        resident memory). A lower one evicts least recently used unpinned blocks down to it now."""
        if nbytes <= 0:
            raise ValueError(f"budget must be positive, got {nbytes}")
        self._harvest_writes()
        tier = self._tiers[-1]
        tier.budget = nbytes
        if tier.free < 0:
            self._make_room(tier, 0, "a lower budget", demand=False)

    @property
    def row_bytes(self) -> int:
        """Bytes one Gaussian of a block takes in this cache."""
        return self._bytes_per_row

    def block_rows(self, key: str) -> int:
        """Gaussians of the newest version of block `key` (resident or not)."""
        return self._lookup(key).count

    def nbytes(self, tier: int = 0) -> int:
        """Bytes a tier holds now, in-flight bytes and working memory included (what the budget bounds)."""
        t = self._tiers[tier]
        return t.used + t.reserved + t.working

    @property
    def working_bytes(self) -> int:
        """Bytes of working memory reserved now (`working`), in the device tier."""
        return self._tiers[0].working

    @contextlib.contextmanager
    def working(self, nbytes: int, what: str, strict: bool = True) -> Iterator[None]:
        """Count `nbytes` of the caller's own memory (`what`: a step's gathered rows, gradients and
        projections) against the device budget until the context exits, evicting unpinned blocks
        to make room first; raises CacheBudgetError when the pinned blocks leave too little.
        strict False, for memory no plan could bound in advance (the rasterizer's, which depends on
        the splats other ranks send): the unpinned blocks make what room they can, and the rest is
        counted over the budget instead of refused, so that nothing is loaded into it meanwhile."""
        self._harvest_writes()
        top = self._tiers[0]
        if strict:
            self._make_room(top, nbytes, what)
        else:
            self._make_room(top, min(nbytes, top.budget), what, demand=False)
        top.working += nbytes
        try:
            yield
        finally:
            top.working -= nbytes

    def close(self) -> None:
        """Stop the workers. Dirty blocks that were not flushed are lost (with a warning)."""
        for pending in self._loads.values():
            pending.future.cancel()
        futures.wait([p.future for p in self._writes.values()])
        failed = []
        while self._writes:
            try:
                self._harvest_writes()
            except Exception as e:  # reported below; close must still release everything
                failed.append(str(e))
        self._pool.shutdown(wait=True, cancel_futures=True)
        lost = {b.key for t in self._tiers for b in t.blocks.values() if b.dirty} | set(self._flushed) | self._removed
        if lost or failed:
            warnings.warn(
                f"cache of store {self.store.name} closed with unflushed changes to blocks {sorted(lost)}"
                + "".join(f"; write-back failed: {f}" for f in failed),
                stacklevel=2,
            )
        for tier in self._tiers:
            tier.blocks.clear()
            tier.sizes.clear()
            tier.used = tier.reserved = tier.working = 0
        self._loads.clear()

    def __enter__(self) -> "BlockCache":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ workers (no bookkeeping here)

    def _load(self, info: BlockInfo) -> _Done:
        start = time.perf_counter()
        arrays = (self.store.read_params if self.params_only else self.store.read_block)(info.key, info)
        tensors = {name: torch.from_numpy(a) for name, a in arrays.items()}
        if self.device.type == "cuda":
            # A side stream, synchronised before handing over, so the copy overlaps compute
            # on the caller's stream and the caller never sees a half-copied tensor.
            stream = torch.cuda.Stream(device=self.device)
            with torch.cuda.stream(stream):
                tensors = {n: t.pin_memory().to(self.device, non_blocking=True) for n, t in tensors.items()}
            stream.synchronize()
        return _Done(time.perf_counter() - start, tensors=tensors)

    def _load_after(self, writes: list[Future], info: BlockInfo) -> _Done:
        """A prefetch that waits for the write-backs whose memory it takes over. They were
        submitted earlier to this FIFO pool, so they are running or done: no deadlock. A failed
        write is reported by `_harvest_writes`, not here."""
        futures.wait(writes)
        return self._load(info)

    def _write(self, block: Block, evicted: bool) -> _Done:
        start = time.perf_counter()
        arrays = {name: t.detach().cpu().numpy() for name, t in block.tensors.items()}
        info = self.store.write_block(block.key, arrays, block.cell)
        if evicted:
            # Nothing reads an evicted block's tensors again (a get waits and reads the store), so
            # its memory is free from here, for a prefetch chained after this write.
            block.tensors = {}
        return _Done(time.perf_counter() - start, info=info)

    # ------------------------------------------------------------------ bookkeeping

    def _lookup(self, key: str) -> BlockInfo:
        """The newest stored version of a block: this cache's own uncommitted write, else the table."""
        if key in self._removed:
            raise BlockNotFoundError(f"cache of store {self.store.name}: block {key} was dropped")
        written = self._written.get(key)
        head = self.store.head
        if written is not None and (head is None or written.version > head):
            return written
        return self.store.info(key)

    def _claim(self, key: str) -> Block:
        """Wait for a load and make its block resident (its bytes move from reserved to used)."""
        pending = self._loads.pop(key)
        pending.tier.reserved -= pending.reserved
        done = self._wait(pending.future)
        self.stats.io_s += done.seconds
        self.stats.bytes_read += pending.reserved
        info = pending.info
        assert info is not None
        block = Block(key, info.cell, info, done.tensors)
        pending.tier.add(block)
        return block

    def _make_room(self, tier: _Tier, nbytes: int, what: str, demand: bool = True) -> bool:
        """Evict until nbytes fit once the write-backs in flight have landed. A demand (get/put)
        then waits for them, and may also discard unclaimed prefetches; a prefetch only evicts,
        and reports False if the bytes are not free now."""
        if nbytes > tier.budget:
            raise CacheBudgetError(
                f"cache of store {self.store.name}: {what} needs {nbytes} B, more than the "
                f"{tier.device.type} budget of {tier.budget} B"
            )
        while tier.free < nbytes:
            # The bytes of evicted blocks still being written count as free here: they will be, and
            # counting them so makes the choice of victims a function of the calls alone. Counted as
            # taken, a write that had not landed yet cost one more eviction (and write-back) than a
            # fast one, so what the cache wrote depended on the write-back threads' timing.
            landing = [p for p in self._writes.values() if p.tier is tier and p.reserved]
            enough_landing = tier.free + sum(p.reserved for p in landing) >= nbytes
            victim = None if enough_landing else tier.lru_unpinned()
            if victim is not None:
                self._evict(victim, tier)
            elif not demand:
                return False
            elif tier is self._tiers[0] and self._loads and not enough_landing:
                self._discard_load(next(iter(self._loads)))
            elif landing:
                self._wait(landing[0].future)
                self._harvest_writes()
            else:
                raise CacheBudgetError(
                    f"cache of store {self.store.name}: {what} needs {nbytes} B but only {tier.free} B "
                    f"of the {tier.device.type} budget of {tier.budget} B can be freed "
                    f"({tier.pinned_bytes()} B are pinned, {tier.working} B are working memory)"
                )
        return True

    def _evict(self, block: Block, tier: _Tier) -> None:
        """Move a block down a tier, or out (written back if dirty)."""
        index = self._tiers.index(tier)
        lower = self._tiers[index + 1] if index + 1 < len(self._tiers) else None
        if lower is not None and tier.sizes[block.key] > lower.budget:
            lower = None
        if lower is None and block.dirty:
            self._check_unsealed(block.key)  # before anything moves: a refusal must lose nothing
        tier.pop(block.key)
        if tier is self._tiers[0]:
            self.stats.evictions += 1
        if lower is not None:
            self._make_room(lower, block.nbytes, f"block {block.key}")
            block.tensors = _to_device(block.tensors, lower.device, pin=self.device.type == "cuda")
            lower.add(block)
        elif block.dirty:
            self._write_back(block, tier, evicted=True)

    def _write_back(self, block: Block, tier: _Tier, evicted: bool) -> None:
        """Start writing a dirty block. An evicted block's bytes stay counted (reserved) in its
        tier until the write lands; a resident one (flush) is counted as resident anyway."""
        self._check_unsealed(block.key)
        if block.key in self._writes:  # one write per key at a time: both would use the same version
            self._wait(self._writes[block.key].future)
            self._harvest_writes()
        block.dirty = False
        # Taken before the submit: the write of an evicted block empties its tensors, maybe before
        # submit returns (a write-back's bytes were counted as 0 on a loaded machine).
        nbytes = block.nbytes
        reserved = nbytes if evicted else 0
        tier.reserved += reserved
        self._writes[block.key] = _InFlight(self._pool.submit(self._write, block, evicted), reserved, tier, block=block,
                                            nbytes=nbytes)

    def _take_from_writebacks(self, tier: _Tier, shortfall: int) -> list[Future] | None:
        """Move `shortfall` reserved bytes from in-flight eviction write-backs of `tier` to a
        load; returns the writes the load must wait for, or None if they hold too little."""
        pending = [p for p in self._writes.values() if p.tier is tier and p.reserved > 0]
        if sum(p.reserved for p in pending) < shortfall:
            return None
        waits = []
        for p in pending:
            if shortfall <= 0:
                break
            take = min(p.reserved, shortfall)
            p.reserved -= take
            tier.reserved -= take
            shortfall -= take
            waits.append(p.future)
        return waits

    def _check_full(self, where: str) -> None:
        if self.params_only:
            raise StoreError(f"{where}: a params-only cache holds no optimizer state, so it never writes")

    def _check_unsealed(self, key: str) -> None:
        if self._sealed and self.store.head == self._sealed_head:
            raise CommitProtocolError(
                f"cache of store {self.store.name}: block {key} must be written, but the cache was "
                f"flushed and the store has not been committed (or refreshed) since"
            )
        self._sealed = False

    def _settle_writes(self) -> None:
        """Wait for every write-back, then account for them (re-raising a failure)."""
        start = time.perf_counter()
        futures.wait([p.future for p in self._writes.values()])
        self.stats.io_wait_s += time.perf_counter() - start
        self._harvest_writes()

    def _harvest_writes(self) -> None:
        """Account for finished write-backs. A failed one is re-raised; if its block is still
        resident (a flush), it stays dirty."""
        for key in [k for k, p in self._writes.items() if p.future.done()]:
            pending = self._writes.pop(key)
            pending.tier.reserved -= pending.reserved
            assert pending.block is not None
            error = pending.future.exception()
            if error is not None:
                pending.block.dirty = True
                if isinstance(error, OSError):  # a full disk, a lost mount: name what it hit
                    raise StoreWriteError(self.store.name, f"block {key}", error, self.store.head,
                                          self.store.state.get("step")) from error
            done: _Done = pending.future.result()
            assert done.info is not None
            pending.block.info = done.info
            self._written[key] = self._flushed[key] = done.info
            self.stats.io_s += done.seconds
            self.stats.bytes_written += pending.nbytes
            self.stats.writebacks += 1

    def _discard_load(self, key: str) -> None:
        pending = self._loads.pop(key)
        pending.tier.reserved -= pending.reserved
        if not pending.future.cancel():
            # Wait so that its memory is really gone; its result, or failure, is thrown away.
            with contextlib.suppress(Exception):
                self._wait(pending.future)

    def _forget(self, key: str, pinned_ok: bool = False) -> Block | None:
        """Take a block out of the cache wherever it is (waiting for its write-back); returns it."""
        if key in self._loads:
            self._discard_load(key)
        if key in self._writes:
            self._wait(self._writes[key].future)
            self._harvest_writes()
        for tier in self._tiers:
            if key in tier.blocks:
                if tier.blocks[key].pins and not pinned_ok:
                    raise StoreError(f"cache of store {self.store.name}: block {key} is pinned")
                return tier.pop(key)
        return None

    def _wait(self, future: Future) -> Any:
        """future.result(), the time blocked counted as I/O wait."""
        start = time.perf_counter()
        try:
            return future.result()
        finally:
            self.stats.io_wait_s += time.perf_counter() - start


def param_bytes_per_gaussian(sh_degree: int) -> int:
    """Bytes of one Gaussian's parameters (all float32)."""
    schema = block_schema(sh_degree)
    return sum(int(np.prod(schema[n][0], dtype=np.int64)) * schema[n][1].itemsize for n in PARAM_NAMES)


def _run_now(fn: Callable[..., _Done], *args: Any) -> Future:
    """Run fn in the caller thread, as a finished Future (a demand load needs no worker)."""
    future: Future = Future()
    try:
        future.set_result(fn(*args))
    except BaseException as e:
        future.set_exception(e)
    return future


def _to_device(tensors: dict[str, Tensor], device: torch.device, pin: bool = False) -> dict[str, Tensor]:
    if all(t.device == device for t in tensors.values()):
        return tensors
    if pin and device.type == "cpu":
        return {n: torch.empty_like(t, device="cpu", pin_memory=True).copy_(t) for n, t in tensors.items()}
    return {n: t.to(device, non_blocking=True) for n, t in tensors.items()}
