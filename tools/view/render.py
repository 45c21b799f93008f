"""Server-side rendering of one camera by paging only the blocks in its frustum.

The visible blocks (Morton order, the order the trainer gathers them in) are projected in
groups that fit half the cache budget, so a view of more blocks than the budget holds still
renders: only the 2D splats of all groups are kept, and one rasterization composites them. A
block that fails to read (corrupt, or collected by a trainer's commit) is named and skipped.
With a level of detail (`lod_pixels` > 0), blocks the camera sees at sub-pixel size are drawn
merged (`tools/view/lod.py`); with 0 the frame is exactly `render()` of the store.

With occlusion culling (`occlusion=True`, `train/occlusion.py`), the frustum's blocks are drawn
front to back in waves: after each wave, the saturation depths of what is drawn so far drop every
block lying behind all the pixels it could reach, which is then never paged. The splats of the
waves are the frame's splats (nothing is projected twice), and the blocks left after the last wave
are added to them: the same image bit for bit (the CPU rasterizer orders splats by depth, ties by
content, so the order they arrive in does not matter; a dropped block's splats would sort after the
splat that stops every pixel they reach). Blocks drawn merged are never dropped (a merged
Gaussian may reach beyond its block's extent box), though they occlude what lies behind them in
the image they make."""
from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from storage import CacheBudgetError, Store, StoreError
from storage.cache import BlockCache, param_bytes_per_gaussian
from storage.schema import PARAM_NAMES
from train.camera import Camera
from train.occlusion import OcclusionCuller
from train.region import Region
from train.render import RenderError, project, rasterize
from train.render.splats2d import Splats2D
from tools.view.config import ViewError
from tools.view.lod import LodStats, ProxyCache, Slot, lod_levels, proxy_for


_RETRIES = 5


class _CommitMoved(Exception):
    """A block of the frame's commit vanished because a newer commit was made."""


class FrameCancelled(Exception):
    """`render` gave up on a frame because its caller no longer wants it (the camera moved on)."""


@dataclass
class FrameStats:
    """What one frame cost and paged."""

    seconds: float = 0.0
    width: int = 0
    height: int = 0
    blocks: int = 0  # blocks in the view frustum that were rendered
    gaussians: int = 0  # Gaussians in those blocks
    culled: list[str] = field(default_factory=list)  # blocks in the frustum that culling dropped before paging
    culled_gaussians: int = 0  # Gaussians in those blocks
    waves: int = 0  # rasterizations of the culling pass
    projected: int = 0  # Gaussians projected: those of the blocks drawn as they are, and the merged ones
    splats: int = 0  # of those, the ones that landed in the image
    lod: LodStats = field(default_factory=LodStats)  # the blocks drawn merged
    paged_in: int = 0  # blocks read from the store for this frame (the rest were resident)
    bytes_read: int = 0  # tensor bytes read from the store for this frame
    skipped: list[str] = field(default_factory=list)  # blocks that could not be read
    restarts: int = 0  # times the frame started over because a newer commit collected its blocks

    def summary(self) -> str:
        merged = (f" ({self.lod.blocks} merged: {self.lod.gaussians:,} Gaussians as {self.lod.proxies:,})"
                  if self.lod.blocks else "")
        text = (f"{self.width}x{self.height} in {self.seconds * 1e3:.0f} ms: {self.blocks} blocks{merged}, "
                f"{self.gaussians:,} Gaussians ({self.splats:,} splats), paged in {self.paged_in} blocks "
                f"({self.bytes_read / 2**20:.1f} MiB)")
        if self.waves:
            text += (f", culled {len(self.culled)} blocks ({self.culled_gaussians:,} Gaussians) "
                     f"in {self.waves} waves")
        return text + (f", skipped {len(self.skipped)} unreadable" if self.skipped else "")


class FrustumRenderer:
    """Renders `store`'s current commit through a params-only block cache of `budget_bytes`. Made
    with `lod_pixels` > 0, merged blocks (`ProxyCache`) share that budget: they may take up to
    half of it (a view's proxies that do not fit would be merged again every frame), and what
    they hold is reserved in the block cache (`BlockCache.working`), so blocks get the rest, all
    of it in a view that merges nothing. `lod_pixels` may then change between frames, 0 included.
    With `occlusion`, blocks hidden behind what the nearer ones draw are never paged (above)."""

    def __init__(self, store: Store, budget_bytes: int, device: str = "cpu",
                 background: tuple[float, float, float] = (0.0, 0.0, 0.0), lod_pixels: float = 0.0,
                 occlusion: bool = False) -> None:
        if device == "cuda" and not torch.cuda.is_available():
            raise ViewError("--device cuda asked for, but torch sees no CUDA device")
        self.store = store
        self.lod_pixels = lod_pixels  # the browser's slider may change it between frames
        self.proxies = ProxyCache(budget_bytes // 2 if lod_pixels > 0 else 0)
        self.budget = budget_bytes
        self._held = contextlib.ExitStack()  # the proxies' reservation in the block cache
        self._held_bytes = 0
        self.device = torch.device(device)
        self.backend = "cuda" if device == "cuda" else "cpu"
        self.background = torch.tensor(background, dtype=torch.float32, device=self.device)
        self.culler = OcclusionCuller(param_bytes_per_gaussian(store.sh_degree)) if occlusion else None
        self.bad: dict[str, str] = {}  # key -> why it could not be read (reported once, then skipped)
        self._head: int | None = None
        self.cache: BlockCache | None = None
        self.region: Region | None = None
        self._sync()

    def _sync(self) -> None:
        """A new commit: blocks resident from the old one may be stale, so the cache starts over."""
        if self._head == self.store.head and self.cache is not None:
            return
        self._hold_proxies(0)
        if self.cache is not None:
            self.cache.close()
        self.cache = BlockCache(self.store, self.budget, self.device, params_only=True)
        self.region = Region.from_table(self.store.table)
        self._head = self.store.head
        self.bad = {}
        self.proxies.clear()

    def visible(self, camera: Camera) -> list[str]:
        """Blocks whose extent box meets the camera's frustum, in Morton order."""
        self._sync()
        assert self.region is not None
        return self.region.visible(camera)

    def render(self, camera: Camera, cancelled: Callable[[], bool] = lambda: False
               ) -> tuple[Tensor, FrameStats]:  # rgb [H, W, 3] float in [0, 1]
        """One frame, all of it from one commit: a trainer committing meanwhile may collect the
        versions this frame is reading; then the frame starts over from the newer commit.
        `cancelled` is asked between groups of blocks; when it says so, FrameCancelled is raised
        (a view of everything takes seconds, and the browser may have moved on)."""
        for attempt in range(_RETRIES):
            try:
                rgb, stats = self._render(camera, cancelled)
                stats.restarts = attempt
                return rgb, stats
            except _CommitMoved:
                continue
        raise ViewError(f"store {self.store.name}: commits followed each other faster than one frame rendered "
                        f"({_RETRIES} tries); try again")

    @torch.no_grad()
    def _render(self, camera: Camera, cancelled: Callable[[], bool]) -> tuple[Tensor, FrameStats]:
        start = time.perf_counter()
        frustum = self.visible(camera)
        keys = [k for k in frustum if k not in self.bad]
        assert self.cache is not None
        stats = FrameStats(width=camera.width, height=camera.height)
        misses, read = self.cache.stats.misses, self.cache.stats.bytes_read
        self._hold_proxies(self.proxies.nbytes())  # a frame an error cut short may have merged unreserved
        merged = self._merged(keys, camera)
        parts: list[Splats2D] = []
        drawn: list[str] = []
        if self.culler is not None:
            keys = self._waves(camera, frustum, merged, parts, drawn, stats, cancelled)
        drawn += self._draw(keys, camera, merged, parts, stats, cancelled)
        table = self.store.table
        stats.gaussians = sum(table[k].count for k in drawn)
        s = Splats2D.cat(parts) if parts else Splats2D.empty(self.device)
        stats.splats = len(s)
        rgb = rasterize(s, camera, self.background, self.backend).rgb.clamp(0, 1)
        stats.paged_in = self.cache.stats.misses - misses
        stats.bytes_read = self.cache.stats.bytes_read - read
        stats.seconds = time.perf_counter() - start
        return rgb, stats

    def _waves(self, camera: Camera, frustum: list[str], merged: dict[str, Slot], parts: list[Splats2D],
               drawn: list[str], stats: FrameStats, cancelled: Callable[[], bool]) -> list[str]:
        """The culling pass over the `frustum`'s blocks: draws its waves into `parts` (their blocks
        into `drawn`) and returns the blocks left to draw, Morton order; the frustum's others are
        culled."""
        assert self.culler is not None and self.region is not None
        p = self.culler.start(camera, self.region, frustum)
        keys = self.region.keys
        for _ in range(self.culler.max_waves):
            take = self.culler.next_wave(p)
            if not len(take):
                break
            wave = sorted(k for k in (keys[j] for j in p.order[take]) if k not in self.bad)
            before = len(parts)
            drawn += self._draw(wave, camera, merged, parts, stats, cancelled)
            if not self.culler.worth_judging(p, sum(len(s) for s in parts[before:])):
                continue
            sat = rasterize(Splats2D.cat(parts), camera, self.background, self.backend).sat_depth.cpu().numpy()
            dropped, done = self.culler.verdict(p, sat)
            # A merged Gaussian may reach beyond its block's box: a merged block is never dropped.
            self.culler.apply(p, dropped[np.array([keys[p.order[j]] not in merged for j in dropped], dtype=bool)], done)
            stats.waves += 1
        left = sorted(keys[j] for j in p.order[p.alive & ~p.rendered] if keys[j] not in self.bad)
        culled = [keys[j] for j in p.order[~p.alive & ~p.rendered] if keys[j] not in self.bad]
        stats.culled = culled
        stats.culled_gaussians = sum(self.store.table[k].count for k in culled)
        return left

    def _draw(self, keys: list[str], camera: Camera, merged: dict[str, Slot], parts: list[Splats2D],
              stats: FrameStats, cancelled: Callable[[], bool]) -> list[str]:
        """Projects these blocks (Morton order) into `parts`, a group that fits the budget at a time;
        returns the ones drawn (an unreadable one is skipped)."""
        assert self.cache is not None
        drawn = []
        for group in self._groups(keys):
            if cancelled():
                raise FrameCancelled
            # Taken before any merge of this group can push them out of the LRU (never None: `_merged`).
            cached = {k: self.proxies.get(merged[k]) for k in group if k in merged and merged[k] in self.proxies}
            blocks = self._pin([k for k in group if k not in cached], stats)
            try:
                present = [k for k in group if k in cached or k in blocks]
                rows = [self._rows(k, merged.get(k), cached, blocks, stats) for k in present]
                if rows:
                    splats = {n: torch.cat([r[n] for r in rows]) for n in PARAM_NAMES}
                    stats.blocks += len(rows)
                    stats.projected += int(splats["means"].shape[0])
                    drawn += present
                    try:
                        parts.append(project(splats, camera, self.store.sh_degree, self.backend))
                    except RenderError as e:  # the store checks what it writes; this is a last line
                        raise ViewError(f"store {self.store.name}, blocks {', '.join(group)}: {e}") from e
            finally:
                self.cache.unpin(blocks)
            self._hold_proxies(self.proxies.nbytes())
        return drawn

    def _merged(self, keys: list[str], camera: Camera) -> dict[str, Slot]:
        """The blocks this frame draws merged -> the slot of their proxy (`ProxyCache.choose`); a
        block once found not worth merging at that level is drawn as it is."""
        table = self.store.table
        out = {}
        for k, level in zip(keys, lod_levels([table[k] for k in keys], camera, self.lod_pixels)):
            if level is None:
                continue
            slot = self.proxies.choose(k, table[k].version, level)
            if slot in self.proxies and self.proxies.get(slot) is None:
                continue
            out[k] = slot
        return out

    def _rows(self, key: str, slot: Slot | None, cached: dict[str, dict[str, Tensor]],
              blocks: dict[str, dict[str, Tensor]], stats: FrameStats) -> dict[str, Tensor]:
        """What the frame projects for `key`: its merged proxy (made from the pinned block and kept
        on a miss) or the block itself."""
        info = self.store.table[key]
        proxy = None
        if slot is not None:
            if key in cached:
                proxy = cached[key]
            else:
                proxy = proxy_for(blocks[key], info, slot[2])
                self.proxies.put(slot, proxy)
        if proxy is None:
            return blocks[key]
        stats.lod.blocks += 1
        stats.lod.gaussians += info.count
        stats.lod.proxies += int(proxy["means"].shape[0])
        return proxy

    def _groups(self, keys: list[str]) -> list[list[str]]:
        """Consecutive runs of blocks whose parameters fit half the budget together (the other half
        lets the next group's loads evict this one's without waiting)."""
        per_row = param_bytes_per_gaussian(self.store.sh_degree)
        groups: list[list[str]] = [[]]
        size = 0
        for k in keys:
            nbytes = self.store.table[k].count * per_row
            if groups[-1] and size + nbytes > self.budget // 2:
                groups.append([])
                size = 0
            groups[-1].append(k)
            size += nbytes
        return [g for g in groups if g]

    def _pin(self, keys: list[str], stats: FrameStats) -> dict[str, dict[str, Tensor]]:
        """Load and pin the readable blocks of a group; an unreadable one is named once and skipped."""
        assert self.cache is not None
        blocks = {}
        try:
            for k in keys:
                try:
                    (block,) = self.cache.pin([k])
                except CacheBudgetError as e:
                    raise ViewError(f"{e}: give the viewer a larger --cache-mb") from e
                except (StoreError, OSError, ValueError) as e:  # zarr and numcodecs raise their own on damaged chunks
                    head = self.store.head
                    try:
                        self.store.refresh()
                    except StoreError as again:
                        raise ViewError(str(again)) from again
                    if self.store.head != head:
                        raise _CommitMoved from e
                    self.bad[k] = str(e)
                    stats.skipped.append(k)
                    print(f"warning: skipping block {k}: {e}", file=sys.stderr, flush=True)
                    continue
                blocks[k] = block.tensors
        except BaseException:
            self.cache.unpin(blocks)
            raise
        return blocks

    def _hold_proxies(self, nbytes: int) -> None:
        """Reserve `nbytes` (what the proxies hold) in the block cache, evicting unpinned blocks to
        make room; never refused, as the proxies are bounded by half the budget and a group's
        pins by the other half."""
        if nbytes == self._held_bytes:
            return
        self._held.close()
        self._held = contextlib.ExitStack()
        self._held_bytes = 0
        if nbytes and self.cache is not None:
            self._held.enter_context(self.cache.working(nbytes, "the level of detail's merged blocks", strict=False))
            self._held_bytes = nbytes

    def close(self) -> None:
        self._hold_proxies(0)
        if self.cache is not None:
            self.cache.close()
