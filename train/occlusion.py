"""Exact occlusion culling (`--occlusion on`): a forward-only pass per camera that returns the
blocks that can change its image; the normal step then runs on those alone.

The frustum's blocks are visited front to back (`octree.order.front_to_back`) in waves: the
nearest ones are paged, projected and rasterized forward only, the saturation depths of their
pixels (`RasterOutput.sat_depth`: the depth of the splat that took transmittance below 1e-4) go
into a coarse max-pyramid, and every block whose nearest possible splat depth lies strictly
behind the saturation depth of every pixel its footprint (`octree.order.box_footprints`) covers
is dropped; the next wave is taken from the blocks left, up to `max_waves` rasterizations, or
until a wave leaves every pixel unsaturated. A wave is the nearest block left and every block
starting less than `SLAB` times as deep. How many waves run changes only what is dropped, never
the result; nor does a camera's rest: one whose pass dropped nothing keeps its whole frustum
for its next 1, 2, 4, 8 and then 16 steps as such passes follow one another (a scene that
nothing saturates, or where no block hides behind another, pays for a pass now and then).

Under MPI the pass runs in rounds every rank takes together, one per wave: each rank projects its
owned blocks of each camera's wave and sends the splats to the rank that renders the camera
(`Exchange.send_splats`, as the step does), which rasterizes everything its camera has received
so far and judges every block of the frustum, whoever owns it; the verdicts (blocks dropped, pass
done) go to every rank (`allgather`). Each rank holds every camera's pass state and every block's
current extent (the trainer passes the extents each step changed around), so each derives the
next wave by itself, and the waves, hence what is kept, are those of one process holding every
block: at most `max_waves` rounds of two collectives a step. The splats of kept blocks that
crossed ranks are not sent again by the step (`train.step.Delivered`): the camera's rank keeps
them, and each block's splat count travels with the verdicts.

Why the result is the same image and the same gradients. Adding splats to a pixel can only make
it saturate sooner (every factor 1 - alpha is at most 1 and float multiplication is monotone), so
the saturation depth a wave measures is at least the one of the full frustum. A dropped block's
splats are strictly deeper than that at every pixel they can reach, so they sort after the splat
that terminates the pixel (the rasterizer sorts by depth first; ties, broken by content, cannot
arise across a strict gap) and the kernels never blend them, nor differentiate them: forward and
backward sums of every other splat see the same terms in the same order. They would get a zero
gradient and never count as contributed. What does change, and is refused or documented:

* densification statistics count every projected Gaussian (gsplat's `count`); a dropped block is
  not projected, so its Gaussians are not counted for that camera (`count`, `max_radii`; `grad2d`
  only ever gets zeros from it);
* `--adam visible` steps every projected Gaussian and MCMC's noise moves every projected mean:
  without culling the dropped ones would change, with it they would not; `--adam dense` steps
  every Gaussian (a dropped block's steps are taken when it is next paged), so its Gaussians
  move while later steps test the block by an extent box computed before they moved. So
  `--occlusion on` needs `--adam contributed`, under which a dropped Gaussian is not stepped and
  its block's extent stays exact, and refuses MCMC.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from octree.order import Footprints, box_depths, box_footprints, front_to_back
from train.camera import Camera
from train.exchange import Exchange, Held
from train.region import Region
from train.render import Splats2D, rasterize
from train.step import Delivered, block_of_ids, gather_for_degree, project_owned
from train.waves import raster_bytes, step_bytes

OCCLUSION_MODES = ("off", "on")


class DepthPyramid:
    """Max-pyramid of a saturation-depth image: level l holds the largest depth of each 2^l x 2^l
    cell (inf where a pixel never saturated; -inf beyond the image, where there is no pixel)."""

    SPAN = 8  # cells a side a query reads at most

    def __init__(self, sat_depth: np.ndarray) -> None:  # [H, W] float32, inf where unsaturated
        level = np.asarray(sat_depth, dtype=np.float64)
        self.levels = [level]
        while level.shape[0] > 1 or level.shape[1] > 1:
            h, w = -(-level.shape[0] // 2) * 2, -(-level.shape[1] // 2) * 2
            padded = np.full((h, w), -np.inf)
            padded[: level.shape[0], : level.shape[1]] = level
            level = padded.reshape(h // 2, 2, w // 2, 2).max(axis=(1, 3))
            self.levels.append(level)

    def max_over(self, rects: np.ndarray) -> np.ndarray:  # [B, 4] x0, y0, x1, y1 non-empty, in the image -> [B]
        """An upper bound of the saturation depth over each rectangle: the max over the cells of
        the finest level at which it spans at most `SPAN` cells a side (so the cells cover at most
        one cell more than the rectangle on each side)."""
        x0, y0, x1, y1 = (rects[:, i].astype(np.int64) for i in range(4))
        x1, y1 = x1 - 1, y1 - 1  # last pixel
        level = np.full(len(rects), len(self.levels) - 1)  # the top level is one cell: everything fits
        for l in reversed(range(len(self.levels) - 1)):
            fits = ((x1 >> l) - (x0 >> l) < self.SPAN) & ((y1 >> l) - (y0 >> l) < self.SPAN)
            level = np.where(fits, l, level)
        out = np.full(len(rects), -np.inf)
        for l, grid in enumerate(self.levels):
            at = np.flatnonzero(level == l)
            if len(at):
                cx0, cx1, cy0, cy1 = x0[at] >> l, x1[at] >> l, y0[at] >> l, y1[at] >> l
                for j in range(self.SPAN):
                    for i in range(self.SPAN):
                        out[at] = np.maximum(out[at], grid[np.minimum(cy0 + j, cy1), np.minimum(cx0 + i, cx1)])
        return out


def _frustum_rows(camera: Camera, world: Region, visible: list[str] | None = None) -> np.ndarray:  # -> [F] int64
    """The frustum's blocks (`visible`, world.visible(camera) where None: what the step would
    page) as rows of `world`, in Morton order."""
    row = {k: i for i, k in enumerate(world.keys)}
    return np.array([row[k] for k in (world.visible(camera) if visible is None else visible)], dtype=np.int64)


@dataclass
class CameraCull:
    """One camera's culling as one rank sees it: its owned blocks (all of them on one rank)."""

    kept: list[str]  # owned blocks that may change the image, Morton order
    frustum: list[str]  # owned blocks in the frustum, Morton order
    waves: int  # rasterizations of the pass (counted on the camera's rank, 0 elsewhere)
    wave_blocks: int  # owned blocks this rank paged and projected in the pass


@dataclass
class CameraPass:
    """One camera's pass, held alike on every rank: each decides the next wave by itself, and only
    what the camera's rank measures (which blocks its saturation depths drop) travels."""

    order: np.ndarray  # [F] world rows of the frustum's blocks, nearest first (any order when resting)
    foot: Footprints | None  # of order's boxes (None: a resting camera's pass, done before it starts)
    alive: np.ndarray  # [F] bool: not dropped
    rendered: np.ndarray  # [F] bool: in some wave already
    done: bool = False  # no wave left, or the last left every pixel unsaturated
    waves: int = 0

    def pending(self) -> np.ndarray:  # -> [P] positions in order, nearest first
        return np.flatnonzero(self.alive & ~self.rendered)


@dataclass
class OcclusionReport:
    """One rank's culling of a step, over its owned blocks, summed over the step's cameras (blocks
    and Gaussians per camera, so a block two cameras see counts twice; bytes over the union of
    the cameras' blocks): summed over the ranks, the figures of one rank holding every block."""

    frustum_blocks: int = 0
    frustum_gaussians: int = 0
    kept_blocks: int = 0
    kept_gaussians: int = 0
    bytes_not_read: int = 0  # block bytes in some frustum that the step did not page
    waves: int = 0
    wave_blocks: int = 0
    bytes_sent: int = 0  # splats the pass's rounds sent to other ranks
    gaussians_not_sent: int = 0  # of owned blocks dropped for cameras other ranks render: not projected, so not sent
    splats_reused: int = 0  # received in the pass, kept for the step, which does not send them again (camera's rank)
    rested: int = 0  # cameras whose pass was left out, their last ones having dropped nothing (camera's rank)

    def fields(self) -> dict[str, int]:
        return {f"occ_{k}": v for k, v in vars(self).items()}


class OcclusionCuller:
    """The culling pass, and the last kept set of each camera (what the next steps prefetch)."""

    SLAB = 1.25  # a wave reaches this many times the depth of its nearest block

    # A camera whose pass dropped nothing rests this many of its steps, doubling with each such
    # pass in a row up to the last: its blocks are all kept meanwhile, which is always exact.
    REST = (1, 2, 4, 8, 16)

    def __init__(self, bytes_per_gaussian: int, max_waves: int = 3) -> None:
        if max_waves < 1:
            raise ValueError(f"max_waves {max_waves}: must be at least 1")
        self.bytes_per_gaussian = bytes_per_gaussian
        self.max_waves = max_waves
        self.last: dict[str, list[str]] = {}  # camera name -> its kept blocks when last culled
        self.fruitless: dict[str, int] = {}  # camera name -> its passes in a row that dropped nothing
        self.rest_left: dict[str, int] = {}  # camera name -> its steps left without a pass

    def _nearest_first(self, camera: Camera, world: Region,
                       visible: list[str] | None = None) -> np.ndarray:  # -> [F] world rows
        """`_frustum_rows`, nearest first."""
        frustum = _frustum_rows(camera, world, visible)
        return frustum[front_to_back(world.extents[frustum], camera.viewmat)]

    def _wave(self, pending: np.ndarray, depth: np.ndarray) -> np.ndarray:  # [P] sorted by depth, [F] -> [W]
        """The next wave: the nearest pending block and every other one starting less than `SLAB`
        times as deep (a facade's blocks all start at about the same depth, and what it hides
        starts deeper; blocks reaching behind the camera make a wave of their own)."""
        if len(pending) == 0:
            return pending
        limit = depth[pending[0]]
        threshold = limit * self.SLAB if limit > 0 else 0.0
        return pending[: max(1, int(np.searchsorted(depth[pending], threshold, side="right")))]

    def prefetch_keys(self, cameras: list[Camera], world: Region, owned: Region) -> list[str]:
        """Owned blocks to prefetch for these cameras: each one's last kept set, else its first wave."""
        keys: list[list[str]] = []
        for cam in cameras:
            if cam.name in self.last:
                keys.append(self.last[cam.name])
            else:
                order = self._nearest_first(cam, world)
                depth = box_depths(world.extents[order], cam.viewmat)
                keys.append([world.keys[i] for i in order[self._wave(np.arange(len(order)), depth)]])
        return owned.union(keys)

    def start(self, camera: Camera, world: Region, visible: list[str] | None = None) -> CameraPass:
        """A pass over the camera's frustum; `visible`: its blocks, where the caller has them."""
        order = self._nearest_first(camera, world, visible)
        foot = box_footprints(world.extents[order], camera.viewmat, camera.K, camera.width, camera.height)
        return CameraPass(order, foot, np.ones(len(order), dtype=bool), np.zeros(len(order), dtype=bool))

    @staticmethod
    def resting(camera: Camera, world: Region) -> CameraPass:
        """A pass that keeps the camera's whole frustum and draws nothing."""
        order = _frustum_rows(camera, world)
        return CameraPass(order, None, np.ones(len(order), dtype=bool), np.zeros(len(order), dtype=bool), done=True)

    def next_wave(self, p: CameraPass) -> np.ndarray:  # -> [W] positions in p.order, marked rendered
        """The pass's next wave; empty, and the pass done, when none is left."""
        pending = np.zeros(0, dtype=np.int64) if p.done else p.pending()
        if not len(pending):
            p.done = True
            return pending
        take = self._wave(pending, p.foot.depth)
        p.rendered[take] = True
        return take

    @staticmethod
    def worth_judging(p: CameraPass, wave_splats: int) -> bool:
        """Whether rasterizing after a wave can drop anything: the wave drew some splat into the
        image (else the saturation depths are those already judged, or there are none: a block
        around the camera), and some block is still pending (else all are drawn anyway)."""
        return wave_splats > 0 and len(p.pending()) > 0

    @staticmethod
    def verdict(p: CameraPass, sat: np.ndarray) -> tuple[np.ndarray, bool]:  # sat [H, W] float32, inf unsaturated
        """The positions (in p.order) of alive blocks that the saturation depths of everything drawn
        so far drop, and whether the pass is done."""
        if not np.isfinite(sat).any():  # nothing this translucent drops a block soon: more waves would only read
            return np.zeros(0, dtype=np.int64), True
        pyramid = DepthPyramid(sat)
        test = np.flatnonzero(p.alive & p.foot.bounded)
        return test[p.foot.near[test] > pyramid.max_over(p.foot.rects[test])], False

    @staticmethod
    def apply(p: CameraPass, dropped: np.ndarray, done: bool) -> None:
        p.alive[dropped] = False
        p.done |= done
        p.waves += 1

    @staticmethod
    def _project(keys: list[str], camera: Camera, cache, sh_degree: int, backend: str
                 ) -> tuple[Splats2D | None, np.ndarray]:  # and [len(keys)] int64 splats of each block
        """The wave's owned blocks projected into the camera, and how many splats each block gave
        (its rows come out together, in `keys` order). Their gathered copy and projection are
        counted in the cache beside them, never refused: a wave is one depth slab of a frustum,
        which no plan bounds."""
        cache.pin(keys)
        try:
            with cache.working(step_bytes(keys, [keys], cache, backward=False), f"culling for {camera.name}",
                               strict=False):
                g = gather_for_degree({k: cache.get(k).tensors for k in keys}, keys, False, sh_degree, backend)
                projected = list(project_owned(g, [keys], [camera], sh_degree, backend).splats.values())
        finally:
            cache.unpin(keys)
        if not projected or not len(projected[0]):
            return None, np.zeros(len(keys), dtype=np.int64)
        return projected[0], np.bincount(block_of_ids(g.offsets, projected[0].ids), minlength=len(keys))

    @staticmethod
    def _judge(p: CameraPass, parts: list[Splats2D], camera: Camera, cache, background: Tensor, backend: str
               ) -> tuple[np.ndarray, bool]:
        """The camera's rank, after a wave that drew something: the positions (in p.order) that the
        saturation depths of every wave so far drop, and whether the pass is done. The rasterizer's
        memory is counted in the cache as the step's is (`train.step`)."""
        splats = Splats2D.cat(parts)
        with cache.working(raster_bytes(len(splats), 0, camera.width, camera.height),
                           f"rasterizing {camera.name} to cull", strict=False):
            sat = rasterize(splats, camera, background, backend=backend).sat_depth.cpu().numpy()
        return OcclusionCuller.verdict(p, sat)

    @torch.no_grad()
    def cull(
        self,
        cameras: list[Camera],
        cam_rank: list[int],  # the rank that renders each camera
        world: Region,  # every block of the store, with current extents (the same on every rank)
        owned: Region,  # this rank's blocks
        cache,  # storage.BlockCache
        exchange: Exchange,
        sh_degree: int,
        background: Tensor,  # [3]
        backend: str = "cpu",
    ) -> tuple[list[CameraCull], OcclusionReport, Delivered]:
        """The pass of every camera of the step, in rounds every rank runs together: each rank
        projects its owned blocks of each camera's wave and sends them to the camera's rank
        (`send_splats`), which rasterizes them forward only and judges the blocks; the verdicts go
        to every rank (`allgather`), and the next wave follows from them alike everywhere. At most
        `max_waves` rounds of two collectives; the waves, and so what is kept, are the same on any
        number of ranks. The splats of kept blocks that crossed ranks are handed to the step
        (`Delivered`), which sends only the rest."""
        rank, mine = exchange.rank, set(owned.keys)
        rested = [self._rests(cam.name) for cam in cameras]
        passes = [self.resting(cam, world) if rests else self.start(cam, world) for cam, rests in zip(cameras, rested)]
        drawn: dict[int, list[Splats2D]] = {i: [] for i, r in enumerate(cam_rank) if r == rank}
        # What crossed ranks, block by block, for the step to reuse: wave keys in order, each
        # one's splat count, and (on the camera's rank) the splats, their rows in that order.
        sent_keys: dict[int, list[tuple[list[str], np.ndarray]]] = {}  # camera -> this rank's deliveries
        arrived: dict[tuple[int, int], list[tuple[list[str], np.ndarray, Splats2D | None]]] = {}  # (src, camera)
        wave_blocks = [0] * len(cameras)
        sent = exchange.bytes_sent
        for _ in range(self.max_waves):
            waves = {i: take for i, p in enumerate(passes) if len(take := self.next_wave(p))}
            if not waves:
                break
            projected: dict[int, Splats2D] = {}
            counts: dict[int, tuple[list[str], np.ndarray]] = {}  # remote cameras' deliveries of this round
            for i, take in waves.items():
                keys = [k for k in (world.keys[j] for j in passes[i].order[take]) if k in mine]
                wave_blocks[i] += len(keys)
                if not keys:
                    continue
                s, per_block = self._project(keys, cameras[i], cache, sh_degree, backend)
                if s is not None:
                    projected[i] = s
                if cam_rank[i] != rank:
                    counts[i] = (keys, per_block)
                    sent_keys.setdefault(i, []).append(counts[i])
            incoming = exchange.send_splats({(cam_rank[i], i): s for i, s in projected.items() if cam_rank[i] != rank},
                                            len(cameras))
            verdicts: dict[int, tuple[np.ndarray, bool]] = {}
            for i in (i for i in waves if cam_rank[i] == rank):
                wave = sorted([*incoming.get(i, []), *([(rank, projected[i])] if i in projected else [])],
                              key=lambda part: part[0])
                drawn[i].extend(s for _, s in wave)
                if self.worth_judging(passes[i], sum(len(s) for _, s in wave)):
                    verdicts[i] = self._judge(passes[i], drawn[i], cameras[i], cache, background, backend)
            for src, (theirs, delivered) in enumerate(exchange.allgather((verdicts, counts))):
                for i, (dropped, done) in theirs.items():
                    self.apply(passes[i], dropped, done)
                for i, (keys, per_block) in delivered.items():
                    if cam_rank[i] == rank:
                        got = dict(incoming.get(i, [])).get(src)
                        arrived.setdefault((src, i), []).append((keys, per_block, got))
        culls = []
        for i, (cam, p) in enumerate(zip(cameras, passes)):
            if not rested[i]:
                self._judged(cam.name, dropped=not p.alive.all())
            self.last[cam.name] = [world.keys[j] for j in sorted(p.order[p.alive].tolist())]  # world rows: Morton order
            culls.append(CameraCull(owned.union([self.last[cam.name]]), owned.union([[world.keys[j] for j in p.order]]),
                                    p.waves if cam_rank[i] == rank else 0, wave_blocks[i]))
        delivered = self._delivered(sent_keys, arrived, {cam.name: set(self.last[cam.name]) for cam in cameras},
                                    cameras, cam_rank)
        remote = [r != rank for r in cam_rank]
        report = self._report(culls, remote, owned, exchange.bytes_sent - sent)
        report.splats_reused = sum(len(s) for s in delivered.held.splats.values())
        report.rested = sum(r for r, owner in zip(rested, cam_rank) if owner == rank)
        return culls, report, delivered

    def _rests(self, name: str) -> bool:
        """Whether this camera's pass is left out this step (and one step of its rest taken)."""
        left = self.rest_left.get(name, 0)
        self.rest_left[name] = max(left - 1, 0)
        return left > 0

    def _judged(self, name: str, dropped: bool) -> None:
        """After a pass: a camera that dropped nothing rests (`REST`); one that did is culled again next time."""
        self.fruitless[name] = 0 if dropped else self.fruitless.get(name, 0) + 1
        self.rest_left[name] = self.REST[min(self.fruitless[name], len(self.REST)) - 1] if self.fruitless[name] else 0

    @staticmethod
    def _delivered(sent_keys: dict[int, list[tuple[list[str], np.ndarray]]],
                   arrived: dict[tuple[int, int], list[tuple[list[str], np.ndarray, Splats2D | None]]],
                   kept: dict[str, set[str]], cameras: list[Camera], cam_rank: list[int]) -> Delivered:
        """What the step need not send again: the splats of blocks the pass delivered to another
        rank and kept, in the order they went (both sides derive it alike). A block drawn in
        one wave and dropped after a later one is left out on both sides."""
        order: dict[int, list[str]] = {}
        skipped: dict[tuple[int, int], int] = {}
        for i, deliveries in sent_keys.items():
            keys = [k for ks, _ in deliveries for k in ks if k in kept[cameras[i].name]]
            rows = sum(int(n) for ks, per_block in deliveries for k, n in zip(ks, per_block)
                       if k in kept[cameras[i].name])
            if rows:
                order[i], skipped[(cam_rank[i], i)] = keys, rows
        held: dict[tuple[int, int], Splats2D] = {}
        for (src, i), deliveries in arrived.items():
            pieces = []
            for keys, per_block, splats in deliveries:
                if splats is None:
                    continue
                alive = np.repeat([k in kept[cameras[i].name] for k in keys], per_block)
                pieces.append(splats if alive.all() else splats.select(torch.from_numpy(alive)))
            if sum(len(p) for p in pieces):
                held[(src, i)] = Splats2D.cat(pieces)
        return Delivered(order, Held(skipped, held))

    def _report(self, culls: list[CameraCull], remote: list[bool], owned: Region, sent: int) -> OcclusionReport:
        counts = dict(zip(owned.keys, owned.counts.tolist()))
        report = OcclusionReport(bytes_sent=sent)
        for c, elsewhere in zip(culls, remote):
            frustum, kept = sum(counts[k] for k in c.frustum), sum(counts[k] for k in c.kept)
            report.gaussians_not_sent += (frustum - kept) if elsewhere else 0
            report.frustum_blocks += len(c.frustum)
            report.frustum_gaussians += frustum
            report.kept_blocks += len(c.kept)
            report.kept_gaussians += kept
            report.waves += c.waves
            report.wave_blocks += c.wave_blocks
        unread = set().union(*(c.frustum for c in culls)) - set().union(*(c.kept for c in culls))
        report.bytes_not_read = sum(counts[k] for k in unread) * self.bytes_per_gaussian
        return report
