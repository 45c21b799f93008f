"""One training step, structured as in docs/architecture.md §6, as a chain of typed phases.

`page_in` pins and loads the blocks the step's cameras see; `project_owned_batch` has owners
project their Gaussians into every camera that sees them; `route_splats` sends the splats of
cameras rendered elsewhere through the `Exchange`; `rasterize_and_loss` has each camera's rank
rasterize the union (local splats first in owner-rank order, so the image equals a single
process's), compute the loss and backpropagate; `backprop_owned` returns the travelled splats'
gradients to their owners, who backpropagate through their projections; `adam_update` steps
sparse Adam on the rows the `AdamStep` mode selects (by default those that contributed to a
pixel; under dense Adam every row, each first brought up to date by `catch_up` after paging)
and adds the densification statistics.
`train_step` composes them; each phase's wall and CPU seconds go to `StepStats`. A step whose
blocks do not fit the cache at once (`train.waves.plan_waves`) pages them in waves instead:
`project_waves` before the rasterization, `step_waves` (backpropagation and Adam) after it.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass, field

import numba
import numpy as np
import torch
from torch import Tensor

from octree.bounds import BOX_LIMIT, EXTENT_SIGMA, extent_boxes
from storage.schema import PARAM_NAMES
from train.camera import Camera
from train.exchange import Exchange, Held, Incoming
from train.losses import SSIM_LAMBDA, Regularizers, training_loss
from train.blockwise import block_threads, row_groups, share_blocks
from train.optim import (
    ADDRESSES, PARALLEL_ROWS, STATS_AT, AdamConfig, AdamStep, LazyDense, SparseAdam, adam_batch, block_of_rows,
    joined_parts, numpy_arrays,
)
from train.region import Region
from train.render import ProjectedBatch, RasterOutput, Splats2D, pack_grads, project_batch, rasterize
from train.render.errors import all_finite
from train.render.semantics import num_sh_bases
from train.stats import DeviceStats, accumulate_stats, add_stats, add_stats_blocks, empty_stats
from train.waves import SPLAT_STEP_BYTES, check_splats, plan_waves, raster_bytes, step_bytes, wave_bytes


@dataclass
class StepStats:
    loss: float = 0.0  # mean over this rank's cameras
    psnr: float = 0.0
    skipped: bool = False  # a non-finite loss or gradient somewhere: no parameter changed
    blocks: int = 0  # blocks paged in for the step
    waves: int = 0  # waves the step paged its blocks in (0: they fitted the cache at once)
    projected: int = 0  # splats this rank projected (all cameras)
    local: int = 0  # splats this rank rasterized that it owns
    received: int = 0  # splats this rank rasterized that another rank owns
    contributed: int = 0  # owned Gaussians stepped by Adam
    extents: dict[str, tuple] = field(default_factory=dict)  # new extent box of every block the step changed
    occlusion: dict[str, int] = field(default_factory=dict)  # --occlusion on: `OcclusionReport.fields()` of the step
    # Seconds in each phase: io (paging blocks in), project, exchange (both directions and the
    # NaN vote, waiting for other ranks included), render (rasterize, loss, backward), backprop
    # (owners through their projections), adam (and statistics, extents).
    timings: dict[str, float] = field(default_factory=dict)
    # CPU seconds of this thread in the same phases: the work a rank did, which wall seconds do
    # not show when ranks share cores or wait for each other. (Compute threads beyond the caller's
    # are not counted: under MPI each rank computes on one thread.)
    cpu: dict[str, float] = field(default_factory=dict)


# The phases whose CPU seconds are a rank's work (the rest is paging and waiting on other ranks).
COMPUTE_PHASES = ("project", "render", "backprop", "adam")


class _Clock:
    """Adds the wall and CPU time since the last mark to a phase."""

    def __init__(self, timings: dict[str, float], cpu: dict[str, float]) -> None:
        self.timings, self.cpu = timings, cpu
        self.last, self.last_cpu = time.perf_counter(), time.thread_time()

    def mark(self, phase: str) -> None:
        now, now_cpu = time.perf_counter(), time.thread_time()
        self.timings[phase] = self.timings.get(phase, 0.0) + now - self.last
        self.cpu[phase] = self.cpu.get(phase, 0.0) + now_cpu - self.last_cpu
        self.last, self.last_cpu = now, now_cpu


@dataclass
class Gathered:
    """The owned Gaussians visible to some camera of the step, as one differentiable batch."""

    keys: list[str]  # block keys in Morton order
    offsets: list[int]  # start row of each block in the batch; offsets[-1] == total rows
    params: dict[str, Tensor]  # name -> leaf tensor [N, ...] requiring grad

    def rows_of(self, keys: list[str]) -> np.ndarray:  # [n] int64 rows of these blocks in the batch
        index = {k: i for i, k in enumerate(self.keys)}
        parts = [np.arange(self.offsets[index[k]], self.offsets[index[k] + 1]) for k in keys]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def block_of_ids(offsets: list[int], ids: Tensor) -> np.ndarray:  # [M] int64 -> [M] int64
    """The block (index into the batch's keys) of each of these batch rows, the blocks starting at `offsets`."""
    return np.searchsorted(np.asarray(offsets), ids.cpu().numpy(), side="right") - 1


# A batch of several blocks up to this many bytes is copied by numpy on the calling thread from
# the cache's numpy views: torch.cat's work per part, not the bytes, made the gather of 345
# blocks of ~145 rows (50k Gaussians) 3.9 ms of a ~52 ms step (2.5 so). Larger batches are
# copied by threads, where the bytes dominate.
NUMPY_GATHER_BYTES = 8 << 20


def gather(blocks: dict[str, dict[str, Tensor]], keys: list[str], requires_grad: bool,
           sh_coeffs: int | None = None, arrays: list[dict[str, np.ndarray] | None] | None = None) -> Gathered:
    """The blocks' rows as one batch; with `sh_coeffs`, shN's leading coefficients only (those the
    step's SH degree reads, `sh_coeffs_gathered`): the rest are never read and would get a zero
    gradient, and at degree 0 shN is three quarters of a row (a 200k-Gaussian batch of 21 blocks
    copied 36 MB of it a step, 12.7 -> 3 ms for the whole gather). `arrays`: each key's
    `optim.numpy_arrays` views (the cache's memo), where the caller has them."""
    offsets = [0]
    for k in keys:
        offsets.append(offsets[-1] + int(blocks[k]["means"].shape[0]))
    joined = _joined_numpy(blocks[keys[0]], arrays, offsets[-1], sh_coeffs) if len(keys) > 1 and arrays else None
    if joined is not None:
        return Gathered(keys, offsets, {name: t.requires_grad_(requires_grad) for name, t in joined.items()})
    parts = {name: [blocks[k][name] if name != "shN" or sh_coeffs is None else blocks[k][name][:, :sh_coeffs]
                    for k in keys] for name in PARAM_NAMES}
    threads = numba.get_num_threads()
    if len(keys) > 1 and threads > 1 and blocks[keys[0]]["means"].device.type == "cpu":
        joined = _joined_on_threads(parts, offsets, threads)
    else:
        # A leaf sharing a block's memory is safe: Adam writes the block only after the backward.
        joined = {name: joined_parts(p) if keys else torch.zeros(0) for name, p in parts.items()}
    return Gathered(keys, offsets, {name: t.detach().requires_grad_(requires_grad) for name, t in joined.items()})


def _joined_numpy(first: dict[str, Tensor], arrays: list[dict[str, np.ndarray] | None], rows: int,
                  sh_coeffs: int | None) -> dict[str, Tensor] | None:
    """`gather`'s tensors copied from the blocks' [N, D] numpy views (shN's cut to the leading
    `sh_coeffs` coefficients); None where a block has no views or the batch is over
    NUMPY_GATHER_BYTES. `first`: the first block's tensors, which give the shapes."""
    if any(a is None for a in arrays):
        return None
    shapes = {name: (sh_coeffs, 3) if name == "shN" and sh_coeffs is not None else tuple(first[name].shape[1:])
              for name in PARAM_NAMES}
    if rows * 4 * sum(math.prod(shape) for shape in shapes.values()) > NUMPY_GATHER_BYTES:  # float32
        return None
    joined = {}
    for name, shape in shapes.items():
        cols = math.prod(shape)
        parts = [a[name] if a[name].shape[1] == cols else a[name][:, :cols] for a in arrays]
        joined[name] = torch.from_numpy(np.concatenate(parts)).reshape(rows, *shape)
    return joined


def _joined_on_threads(parts: dict[str, list[Tensor]], offsets: list[int], threads: int) -> dict[str, Tensor]:
    """Each array's blocks copied into one CPU tensor, in `threads` row ranges of blocks per array
    copied side by side (torch's copies release the GIL; on one thread they took 3.5 ms of a
    200k-Gaussian step): the same tensors as `torch.cat`."""
    out = {name: torch.empty((offsets[-1], *p[0].shape[1:]), dtype=p[0].dtype) for name, p in parts.items()}
    cuts = [0]
    for t in range(1, threads):
        cuts.append(max(cuts[-1], int(np.searchsorted(offsets, offsets[-1] * t / threads))))
    cuts.append(len(offsets) - 1)
    ranges = [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]
    tasks = [(name, a, b) for name in parts for a, b in ranges]

    def copy(taken: Iterator[int]) -> None:
        for i in taken:
            name, a, b = tasks[i]
            torch.cat(parts[name][a:b], out=out[name][offsets[a]:offsets[b]])

    share_blocks(len(tasks), threads, copy)
    return out


def gather_for_degree(blocks: dict[str, dict[str, Tensor]], keys: list[str], requires_grad: bool, sh_degree: int,
                      backend: str, arrays: list[dict[str, np.ndarray] | None] | None = None) -> Gathered:
    """`gather` with the SH coefficients a projection at this degree reads (`sh_coeffs_gathered`)."""
    return gather(blocks, keys, requires_grad=requires_grad, sh_coeffs=sh_coeffs_gathered(sh_degree, backend),
                  arrays=arrays)


def sh_coeffs_gathered(sh_degree: int, backend: str) -> int | None:
    """shN's coefficients `gather` takes for a step at this degree: on the CPU those the degree
    reads; on a GPU all of them, since `adam_batch` writes the batch's rows back whole (and a
    copy on the device is cheap)."""
    return num_sh_bases(sh_degree) - 1 if backend == "cpu" else None


def project_owned(
    gathered: Gathered,
    visible: list[list[str]],  # per camera of the step: owned visible block keys
    cameras: list[Camera],
    sh_degree: int,
    backend: str,
) -> ProjectedBatch:
    """The batch projected into every camera that sees some of it (`splats` leaves the others
    out); splat ids are rows of the gathered batch."""
    views = []
    for i, (cam, keys) in enumerate(zip(cameras, visible)):
        if keys:
            # A camera that sees the whole batch (always, with one camera a step) needs no row list.
            views.append((i, cam, None if len(keys) == len(gathered.keys) else gathered.rows_of(keys)))
    return project_batch(gathered.params, views, sh_degree, backend=backend, check=bool(views))


def _parts_for_camera(
    i: int, rank: int, kept: dict[int, Splats2D], incoming: Incoming
) -> tuple[list[tuple[int, Splats2D]], Splats2D]:
    """Camera i's splats as (source rank, splats) in rank order, and their union: owner order is
    Morton order, so the union is the batch a single process would rasterize."""
    parts = list(incoming.get(i, []))
    if i in kept:
        parts.append((rank, kept[i]))
    parts.sort(key=lambda p: p[0])
    return parts, (Splats2D.cat([p for _, p in parts]) if parts else Splats2D.empty())


def _raster_memory(cache, i: int, camera: Camera, parts: list[tuple[int, Splats2D]], rank: int
                   ) -> AbstractContextManager[None]:
    """Camera i's rasterizer memory, counted in the cache (`cache` None: nowhere) while it renders
    and backpropagates."""
    if cache is None:
        return nullcontext()
    received = sum(len(p) for src, p in parts if src != rank)
    nbytes = raster_bytes(sum(len(p) for _, p in parts), received, camera.width, camera.height)
    return cache.working(nbytes, f"rasterizing camera {i}", strict=False)


def _split_by_parts(values: Tensor, parts: list[tuple[int, Splats2D]]) -> list[Tensor]:
    return list(torch.split(values, [len(p) for _, p in parts]))


def _extents(blocks: dict[str, dict[str, Tensor]]) -> dict[str, tuple]:
    """New extent box of each block, in one pass over all of them (a box per block cost ~0.1 ms
    in numpy calls, which added up to a fifth of a step with small blocks). Blocks on a GPU are
    reduced there, and only the boxes come to the host."""
    if not blocks:
        return {}
    if next(iter(blocks.values()))["means"].device.type != "cpu":
        return dict(zip(blocks, _extent_boxes_device(blocks).tolist()))
    return _host_extents(list(blocks), [{name: t[name].detach().numpy() for name in ("means", "scales")}
                                        for t in blocks.values()])


def _host_extents(keys: list[str], arrays: list[dict[str, np.ndarray]]) -> dict[str, tuple]:
    """`_extents` of blocks on the host from numpy views of their means and scales (the cache's
    `numpy_arrays` memo, where the trainer has it: a city's street view changes hundreds of
    small blocks a step, and a tensor call or two for each cost more than their boxes)."""
    means, scales = (arrays[0][name] if len(arrays) == 1 else np.concatenate([a[name] for a in arrays])
                     for name in ("means", "scales"))
    starts = np.cumsum([0] + [len(a["means"]) for a in arrays[:-1]])
    return dict(zip(keys, map(tuple, extent_boxes(means, scales, starts).tolist())))


def _extent_boxes_device(blocks: dict[str, dict[str, Tensor]]) -> Tensor:  # [B, 6] float64 on the host
    """`octree.bounds.extent_boxes` (the same sigma and limit, float64) by torch's scatter reductions."""
    means, scales = (joined_parts([t[name].detach() for t in blocks.values()]) for name in ("means", "scales"))
    r = (EXTENT_SIGMA * torch.exp(scales.amax(dim=1).to(torch.float64)))[:, None]  # [N, 1]
    means = means.to(torch.float64)
    rows = block_of_rows([len(t["means"]) for t in blocks.values()], means.device)[:, None].expand(-1, 3)
    boxes = torch.empty(len(blocks), 6, dtype=torch.float64, device=means.device)
    boxes[:, :3] = math.inf
    boxes[:, 3:] = -math.inf
    boxes[:, :3].scatter_reduce_(0, rows, means - r, "amin")
    boxes[:, 3:].scatter_reduce_(0, rows, means + r, "amax")
    return boxes.clamp_(-BOX_LIMIT, BOX_LIMIT).cpu()


# ---- the phases ----

@dataclass
class Paged:
    """The step's owned blocks, pinned in the cache (`page_in`'s caller unpins `keys`)."""

    keys: list[str]  # Morton order
    visible: list[list[str]]  # per camera of the step: the owned blocks it sees
    cached: dict  # key -> storage.cache.Block
    tensors: dict[str, dict[str, Tensor]]  # key -> every array of the block

    def arrays(self) -> list[dict[str, np.ndarray] | None]:
        """Each block's `optim.numpy_arrays` views, in `keys` order: the cache's memo, so on the
        step's thread."""
        return [self.cached[k].arrays(numpy_arrays) for k in self.keys]


@dataclass
class Projected:
    """An owner's batch and its projection into the step's cameras."""

    gathered: Gathered
    projection: ProjectedBatch
    owned: dict[int, Splats2D]  # camera index -> this rank's splats for it (ids: batch rows)
    sh_degree: int  # the SH degree projected: shN's coefficients past it have a zero gradient

    def grad_columns(self) -> dict[str, int]:
        """Leading columns of each parameter's gradient (as [N, -1]) that may be nonzero."""
        return {name: (num_sh_bases(self.sh_degree) - 1) * 3 if name == "shN" else math.prod(p.shape[1:])
                for name, p in self.gathered.params.items()}


@dataclass
class Delivered:
    """Splats the occlusion pass already carried to the ranks that render their cameras: the step
    sends them no second time. The owner puts the rows of these blocks first in its part for the
    camera (block by block, in the order they went), leaves them off the wire, and puts the
    gradients that come back for the part in its own order again; the camera's rank holds them."""

    first: dict[int, list[str]]  # camera -> this rank's blocks whose rows lead its part, in delivery order
    held: Held  # rows left off the wire per (dest, camera); the splats held here per (source, camera)


@dataclass
class Routed:
    """Splats where their camera is rendered: received from other owners, and kept."""

    incoming: Incoming  # camera index -> [(source rank, leaf splats)]
    kept: dict[int, Splats2D]  # this rank's splats for the cameras it renders, as leaves
    sent_order: dict[int, Tensor] = field(default_factory=dict)  # camera -> [M] rows of its part in the order sent


@dataclass
class Rendered:
    """This rank's cameras rasterized, their losses backpropagated to the splat leaves."""

    losses: list[Tensor]  # [] per rendered camera
    psnrs: list[float]
    grads_of: dict[tuple[int, int], Tensor]  # (source rank, camera) -> [M, 9] pack_grads layout
    flags_of: dict[tuple[int, int], Tensor]  # (source rank, camera) -> [M] contributed
    abs_of: dict[tuple[int, int], Tensor]  # (source rank, camera) -> [M, 2] absolute 2D mean gradients (absgrad)


@dataclass
class Back:
    """What an owner gets back for one camera's splats (from whichever rank rendered them)."""

    grads: Tensor  # [M, 9] pack_grads layout
    contributed: Tensor  # [M] bool: reached a pixel
    absgrad: Tensor | None  # [M, 2] absolute per-pixel 2D mean gradients, summed (with --absgrad)

    @property
    def statistic(self) -> Tensor:  # [M, >= 2]: the 2D mean gradient the statistics take, first two columns
        return self.absgrad if self.absgrad is not None else self.grads


@dataclass
class Backprop:
    """Each owned camera's splat gradients and contributed flags, and the batch rows to step."""

    back: dict[int, Back]  # camera index -> its splats' gradients, flags, absgrad
    contributed: Tensor  # [N] bool over the batch: the rows Adam steps


def page_in(cameras: list[Camera], region: Region, cache, visible: list[list[str]] | None = None) -> Paged:
    """Pin and load every owned block a camera of the step sees (blocks stay pinned); `visible`:
    each camera's blocks where occlusion culling chose them, else those in its frustum."""
    if visible is None:
        visible = [region.visible(c) for c in cameras]
    keys = region.union(visible)
    cache.pin(keys)  # all or nothing
    cached = {k: cache.get(k) for k in keys}
    return Paged(keys, visible, cached, {k: b.tensors for k, b in cached.items()})


def project_owned_batch(paged: Paged, cameras: list[Camera], sh_degree: int, backend: str) -> Projected:
    g = gather_for_degree(paged.tensors, paged.keys, True, sh_degree, backend,
                          paged.arrays() if len(paged.keys) > 1 else None)
    projection = project_owned(g, paged.visible, cameras, sh_degree, backend)
    return Projected(g, projection, projection.splats, sh_degree)


def _delivered_first(part: Splats2D, keys: list[str], offsets: list[int], first: list[str]) -> Tensor:  # [M] int64
    """The part's rows (ids: rows of the batch whose blocks are `keys`, starting at `offsets`)
    reordered so that those of the blocks `first` lead, block by block in that order, and the
    others follow as they were; a block's own rows keep their order (which is what the
    rasterizer's ties between identical splats, all in one block, can depend on)."""
    index = {k: i for i, k in enumerate(keys)}
    place = np.full(len(keys), len(first), dtype=np.int64)  # each block's place in the lead, past it if none
    place[[index[k] for k in first]] = np.arange(len(first))
    return torch.from_numpy(np.argsort(place[block_of_ids(offsets, part.ids)], kind="stable")).to(part.ids.device)


def route_splats(owned: dict[int, Splats2D], cam_rank: list[int], exchange: Exchange, n_cams: int,
                 blocks: tuple[list[str], list[int]], delivered: Delivered | None = None) -> Routed:
    """owned: camera index -> this rank's splats for it; blocks: the keys and start rows of the
    batch their ids index (where `delivered`, the occlusion pass's splats, lead a part)."""
    rank = exchange.rank
    outgoing = {(cam_rank[i], i): s for i, s in owned.items() if cam_rank[i] != rank}
    sent_order: dict[int, Tensor] = {}
    if delivered is not None:
        for i, first in delivered.first.items():
            if (cam_rank[i], i) in outgoing:
                sent_order[i] = _delivered_first(owned[i], *blocks, first)
                outgoing[(cam_rank[i], i)] = owned[i].select(sent_order[i])
    incoming = exchange.send_splats(outgoing, n_cams, None if delivered is None else delivered.held)
    # Own splats cross the same boundary as received ones (leaves whose gradients are handed
    # back), so each owner backpropagates its projections in camera order, whoever rendered
    # them: gradient sums, hence parameters, come out the same for any number of ranks.
    kept = {i: s.as_leaves() for i, s in owned.items() if cam_rank[i] == rank}
    return Routed(incoming, kept, sent_order)


def rasterize_and_loss(
    routed: Routed,
    cameras: list[Camera],
    cam_rank: list[int],
    images: dict[int, Tensor],  # camera index -> ground truth [H, W, 3]
    rank: int,
    background: Tensor,  # [3]
    backend: str,
    stats: StepStats,
    absgrad: bool = False,  # also the absolute per-pixel 2D mean gradients (gsplat's absgrad)
    ssim_lambda: float = SSIM_LAMBDA,  # the D-SSIM term's weight in the loss
    cache=None,  # storage.BlockCache that counts the rasterizer's memory (None: not counted)
) -> Rendered:
    n_cams = len(cameras)
    out = Rendered([], [], {}, {}, {})
    for i in (i for i in range(n_cams) if cam_rank[i] == rank):
        parts, s = _parts_for_camera(i, rank, routed.kept, routed.incoming)
        with _raster_memory(cache, i, cameras[i], parts, rank):
            raster = rasterize(s, cameras[i], background, backend=backend, absgrad=absgrad, packed_grads=True)
            loss, view_psnr = training_loss(raster.rgb, images[i], ssim_lambda)
            if loss.requires_grad:  # a camera that sees no splat has nothing to differentiate
                (loss / n_cams).backward()
        out.losses.append(loss.detach())
        out.psnrs.append(view_psnr)
        # The CPU rasterizer hands the gradients over packed (no leaves split and packed again).
        grads = (_split_by_parts(raster.packed_grads(), parts) if raster.packed_grads is not None
                 else [pack_grads(part) for _, part in parts])
        for (src, part), flags, g in zip(parts, _split_by_parts(raster.contributed, parts), grads):
            out.flags_of[(src, i)] = flags
            out.grads_of[(src, i)] = g
        if absgrad:
            for (src, part), a in zip(parts, _split_by_parts(raster.absgrad(), parts)):
                out.abs_of[(src, i)] = a
        stats.local += sum(len(p) for src, p in parts if src == rank)
        stats.received += sum(len(p) for src, p in parts if src != rank)
    return out


def return_grads(routed: Routed, rendered: Rendered, exchange: Exchange, absgrad: bool = False) -> dict[int, Back]:
    """Gradients and contributed flags (and absgrad) of every camera's splats of this owner,
    remote ones returned through the exchange."""
    rank = exchange.rank
    remote_grads = {key: g for key, g in rendered.grads_of.items() if key[0] != rank}
    remote_flags = {key: f for key, f in rendered.flags_of.items() if key[0] != rank}
    remote_abs = {key: a for key, a in rendered.abs_of.items() if key[0] != rank} if absgrad else None
    back = {i: Back(*v) for (_, i), v in exchange.return_grads(routed.incoming, remote_grads, remote_flags,
                                                               remote_abs).items()}
    for i, order in routed.sent_order.items():
        back[i] = Back(*(None if v is None else _unpermuted(v, order)
                         for v in (back[i].grads, back[i].contributed, back[i].absgrad)))
    back.update({i: Back(rendered.grads_of[(rank, i)], rendered.flags_of[(rank, i)], rendered.abs_of.get((rank, i)))
                 for i in routed.kept})
    return back


def _unpermuted(values: Tensor, order: Tensor) -> Tensor:  # [M, ...] in `order` -> [M, ...] in row order
    out = torch.empty_like(values)
    out[order] = values
    return out


def backprop_owned(projected: Projected, back: dict[int, Back], mode: str) -> Backprop:
    """Owners backpropagate their projections; the rows Adam steps are those that reached a
    pixel (mode contributed), every row a camera projected (visible), or every row (dense)."""
    projected.projection.backward({i: b.grads for i, b in back.items()})
    g = projected.gathered
    stepped = torch.full((g.offsets[-1],), mode == "dense", dtype=torch.bool, device=g.params["means"].device)
    if mode != "dense":
        for i, b in back.items():
            ids = projected.owned[i].ids  # each row at most once a camera
            # (no boolean indexing: on a GPU it waits for the device to count the rows)
            if mode == "visible":
                stepped[ids] = True
            else:
                stepped[ids] |= b.contributed
    return Backprop(back, stepped)


def catch_up_block(lazy: LazyDense, cache, key: str, done: int) -> int:
    """Dense Adam: the cached block `key`'s rows take the steps they missed, up to `done` (the
    block is marked dirty if any did); returns how many rows were behind."""
    block = cache.get(key)
    behind = lazy.catch_up(block.tensors, done, block.arrays(numpy_arrays))
    if behind:
        cache.mark_dirty(key)
    return behind


def catch_up(paged: Paged, cache, adam_step: AdamStep) -> None:
    """Dense Adam: every row of the step's blocks takes the steps it missed before this one (on a
    GPU all blocks at once)."""
    if paged.keys and paged.tensors[paged.keys[0]]["means"].device.type != "cpu":
        behind = adam_step.lazy.catch_up_batch([paged.tensors[k] for k in paged.keys], adam_step.number - 1)
        for k, rows in zip(paged.keys, behind):
            if rows:
                cache.mark_dirty(k)
        return
    for k in paged.keys:
        catch_up_block(adam_step.lazy, cache, k, adam_step.number - 1)


def stepped_grads_finite(projected: Projected, bp: Backprop) -> bool:
    columns = projected.grad_columns()
    for name, p in projected.gathered.params.items():
        if p.grad is None or columns[name] == 0:
            continue
        # Only stepped rows matter; the masked check runs only when something is not finite.
        g = p.grad.reshape(len(p.grad), math.prod(p.grad.shape[1:]))[:, :columns[name]]
        if not all_finite(g) and not all_finite(g[bp.contributed]):
            return False
    return True


def losses_finite(rendered: Rendered) -> bool:
    return all(all_finite(l) for l in rendered.losses)


def adam_update(
    paged: Paged,
    projected: Projected,
    bp: Backprop,
    cameras: list[Camera],
    cache,
    lrs: dict[str, float],
    adam: AdamConfig,
    stats: StepStats,
    perturb=None,  # train.densify.Perturb: applied to each block's rows the step saw, after Adam
    global_step: int = 0,  # > 0: Adam's bias correction by this step (visible, dense), not each row's count
    batched: bool | None = None,  # step the batch at once with torch ops (default: where it is on a GPU)
) -> None:
    """Sparse Adam on the rows `bp` selects in each block, then the densification statistics
    (summed in camera order: the sums must not depend on who rendered what) of every Gaussian a
    camera saw, as gsplat counts them. On a GPU (or with `batched`) the batch is stepped at once
    on the device (`adam_update_batched`)."""
    g, owned, n_cams = projected.gathered, projected.owned, len(cameras)
    if batched if batched is not None else g.params["means"].device.type != "cpu":
        adam_update_batched(paged, projected, bp, cameras, cache, lrs, adam, stats, perturb, global_step)
        return
    acc = empty_stats(g.offsets[-1])
    for i in sorted(bp.back):
        accumulate_stats(acc, owned[i].ids, owned[i].radii, bp.back[i].statistic, cameras[i], n_cams)
    grads = {name: (p.grad if p.grad is not None else torch.zeros_like(p)) for name, p in g.params.items()}
    threads = block_threads(g.offsets, numba.get_num_threads())
    # Side by side, each block's step keeps to one core (the same arithmetic as split over them).
    optimizer = SparseAdam(grads, bp.contributed, lrs, adam, global_step, grad_columns=projected.grad_columns(),
                           parallel_rows=PARALLEL_ROWS if threads == 1 else np.iinfo(np.int64).max)
    arrays = paged.arrays()

    def step_blocks(blocks: Iterator[int]) -> tuple[dict[int, int], dict[str, tuple]]:
        """Adam and the statistics of the blocks drawn, and (with no perturbation to come) their
        new extents: rows stepped per block changed, and the extents."""
        changed = {}
        for b in blocks:
            lo, hi = g.offsets[b], g.offsets[b + 1]
            t = paged.tensors[paged.keys[b]]
            rows = optimizer.step(t, lo, arrays[b])
            if rows == 0 and not acc["count"][lo:hi].any():
                continue
            add_stats(t, arrays[b], acc, lo, hi)
            changed[b] = rows
        if perturb is not None or not changed:
            return changed, {}
        if any(arrays[b] is None for b in changed):
            return changed, _extents({paged.keys[b]: paged.tensors[paged.keys[b]] for b in changed})
        return changed, _host_extents([paged.keys[b] for b in changed], [arrays[b] for b in changed])

    stepped, extents = {}, {}
    if _at_once(g.offsets, arrays, optimizer):
        stepped = _step_at_once(g.offsets, arrays, optimizer, acc)
        if perturb is None and stepped:
            extents = _host_extents([paged.keys[b] for b in stepped], [arrays[b] for b in stepped])
    else:
        for rows, boxes in share_blocks(len(paged.keys), threads, step_blocks):
            stepped.update(rows)
            extents.update(boxes)
    changed = sorted(stepped)
    stats.contributed += sum(stepped.values())
    if perturb is not None:
        for b in changed:
            t = paged.tensors[paged.keys[b]]
            seen = np.flatnonzero(acc["count"][g.offsets[b]:g.offsets[b + 1]])
            perturb(paged.keys[b], t, torch.from_numpy(seen).to(t["means"].device))
        extents = _extents({paged.keys[b]: paged.tensors[paged.keys[b]] for b in changed})
    for b in changed:
        cache.mark_dirty(paged.keys[b])
        stats.extents[paged.keys[b]] = extents[paged.keys[b]]


def _at_once(offsets: list[int], arrays: list[dict[str, np.ndarray] | None], optimizer: SparseAdam) -> bool:
    """Whether the step's blocks are stepped by one compiled call (`_step_at_once`): several blocks
    on the host, none with so many rows that its own step would be split over the cores."""
    return (optimizer.compiled and len(arrays) > 1 and all(a is not None and ADDRESSES in a for a in arrays)
            and int(np.diff(offsets).max()) < PARALLEL_ROWS)


def _step_at_once(offsets: list[int], arrays: list[dict[str, np.ndarray]], optimizer: SparseAdam,
                  acc: dict[str, np.ndarray]) -> dict[int, int]:
    """Adam and the statistics of every block in two compiled calls over the blocks' address
    table, runs of blocks of about equal rows to each core (with a call a block from the
    interpreter, Adam's phase of 345 blocks of ~145 rows took 8.3-8.75 ms, one block of the same
    rows 2.5). Returns the rows stepped in each block that changed, as `step_blocks` does."""
    offsets_np = np.asarray(offsets, dtype=np.int64)
    sizes, los = np.diff(offsets_np), offsets_np[:-1]
    table = np.stack([a[ADDRESSES] for a in arrays])  # [B, 23], each row kept with the block's views
    widths = np.array([arrays[0][name].shape[1] for name in PARAM_NAMES], dtype=np.int64)
    groups = row_groups(offsets_np, _GROUPS_PER_THREAD * numba.get_num_threads())
    rows = optimizer.step_blocks(table, sizes, los, widths, groups)
    changed = add_stats_blocks(table, STATS_AT, sizes, los, groups, rows, acc)
    return {b: int(rows[b]) for b in np.flatnonzero(changed).tolist()}


_GROUPS_PER_THREAD = 4  # runs of blocks per thread: cut at block ends, a run's rows are only about equal


def adam_update_batched(
    paged: Paged,
    projected: Projected,
    bp: Backprop,
    cameras: list[Camera],
    cache,
    lrs: dict[str, float],
    adam: AdamConfig,
    stats: StepStats,
    perturb=None,
    global_step: int = 0,
) -> None:
    """`adam_update` for a batch on a GPU: the statistics, Adam and the blocks' new rows stay on
    the device, and one small copy a step tells the host which blocks changed. The host path's
    per-block calls would each launch a score of kernels and wait for the device."""
    g, owned, n_cams = projected.gathered, projected.owned, len(cameras)
    device = g.params["means"].device
    acc = DeviceStats(g.offsets[-1], device)
    for i in sorted(bp.back):
        acc.add(owned[i].ids, owned[i].radii, bp.back[i].statistic, cameras[i], n_cams)
    grads = {name: (p.grad if p.grad is not None else torch.zeros_like(p)) for name, p in g.params.items()}
    blocks = [paged.tensors[k] for k in paged.keys]
    adam_batch(blocks, g.params, grads, bp.contributed, lrs, adam, global_step)
    sizes = [hi - lo for lo, hi in zip(g.offsets[:-1], g.offsets[1:])]
    for name, values in (("grad2d", acc.grad2d), ("count", acc.count)):
        torch._foreach_add_([b[name] for b in blocks], list(torch.split(values, sizes)))
    torch._foreach_maximum_([b["max_radii"] for b in blocks], list(torch.split(acc.max_radii, sizes)))
    seen = acc.count > 0  # [N]
    of_block = block_of_rows(sizes, device)
    per_block = torch.zeros(2, len(blocks), dtype=torch.int64, device=device)
    per_block.index_add_(1, of_block, torch.stack([bp.contributed, seen]).to(torch.int64))
    changed = []
    for b, (k, rows, saw) in enumerate(zip(paged.keys, *per_block.tolist())):
        if rows == 0 and saw == 0:
            continue
        if perturb is not None:
            lo, hi = g.offsets[b], g.offsets[b + 1]
            perturb(k, paged.tensors[k], torch.nonzero(seen[lo:hi]).squeeze(1))
        cache.mark_dirty(k)
        changed.append(k)
        stats.contributed += rows
    stats.extents.update(_extents({k: paged.tensors[k] for k in changed}))


# ---- views larger than the cache: the step in waves (train/waves.py) ----

@dataclass
class WaveForward:
    """Pass 1 of a step in waves: every camera's splats of all waves; the blocks are released."""

    waves: list[list[str]]  # contiguous Morton ranges of the step's blocks
    visible: list[list[list[str]]]  # wave -> camera -> its blocks in the wave
    counts: list[dict[int, int]]  # wave -> camera index -> splats the wave gave that camera
    owned: dict[int, Splats2D]  # camera index -> its splats of all waves, in wave order (ids: rows of the step)
    keys: list[str] = field(default_factory=list)  # the step's blocks, in the order of its rows
    offsets: list[int] = field(default_factory=lambda: [0])  # start row of each block; offsets[-1] == rows


def project_waves(
    waves: list[list[str]],
    visible: list[list[str]],  # per camera: the owned blocks it sees
    cameras: list[Camera],
    cache,
    sh_degree: int,
    backend: str,
    held: ExitStack,  # with more than one wave, the splats' reservation in the cache, until it closes
    prepare: Callable[[str], None] | None = None,  # called on each block before it is read (dense Adam's catch-up)
    clock: _Clock | None = None,
    backward: bool = True,  # a second pass backpropagates wave by wave (`step_waves`)
) -> WaveForward:
    """Page each wave (pinned while it is projected, the next one loading meanwhile), project it
    into every camera that sees some of it and let it go: only the detached splats stay. Each
    camera's splats come out in the order one batch of all the blocks gives them."""
    fwd = WaveForward(waves, [], [], {})
    parts: dict[int, list[Splats2D]] = {}
    row0 = 0
    # The splats must leave room for the largest wave, paged again beside them (or next).
    largest = max(wave_bytes(keys, visible, cache, backward) for keys in waves) if len(waves) > 1 else 0
    for w, keys in enumerate(waves):
        cache.pin(keys)
        try:
            projection = step_bytes(keys, visible, cache, backward=False)
            with cache.working(projection, f"the projection of wave {w} of the step"):
                if w + 1 < len(waves):
                    cache.prefetch(waves[w + 1])
                for k in keys if prepare is not None else ():
                    prepare(k)
                inside = set(keys)
                vis = [[k for k in v if k in inside] for v in visible]
                g = gather_for_degree({k: cache.get(k).tensors for k in keys}, keys, False, sh_degree, backend)
                if clock is not None:
                    clock.mark("io")
                splats = project_owned(g, vis, cameras, sh_degree, backend).splats
                rows = g.offsets[-1]
                fwd.keys.extend(keys)
                fwd.offsets.extend(row0 + o for o in g.offsets[1:])
                del g  # its copy of the rows is what the reservation counted
                if clock is not None:
                    clock.mark("project")
        finally:
            cache.unpin(keys)
        fwd.visible.append(vis)
        fwd.counts.append({i: len(p) for i, p in splats.items()})
        if len(waves) > 1:
            check_splats(sum(sum(c.values()) for c in fwd.counts), cache, largest)
            held.enter_context(cache.working(sum(fwd.counts[-1].values()) * SPLAT_STEP_BYTES,
                                             f"the 2D splats of wave {w} of the step"))
        for i, p in splats.items():
            p.ids = p.ids + row0
            parts.setdefault(i, []).append(p)
        row0 += rows
    fwd.owned = {i: p[0] if len(p) == 1 else Splats2D.cat(p) for i, p in sorted(parts.items())}
    return fwd


def splat_grads_finite(back: dict[int, Back], mode: str) -> bool:
    """The vote of a step in waves, taken before any wave is stepped: the splat gradients of the
    rows Adam will step (their parameters' gradients come only wave by wave)."""
    return all(all_finite(b.grads if mode != "contributed" else b.grads[b.contributed]) for b in back.values())


def _slice_back(b: Back, lo: int, hi: int) -> Back:
    return Back(b.grads[lo:hi], b.contributed[lo:hi], None if b.absgrad is None else b.absgrad[lo:hi])


def step_waves(
    fwd: WaveForward,
    back: dict[int, Back],
    cameras: list[Camera],
    cache,
    sh_degree: int,
    backend: str,
    adam_step: AdamStep,
    regularizers: Regularizers,
    lrs: dict[str, float],
    adam: AdamConfig,
    stats: StepStats,
    clock: _Clock,
    perturb=None,
) -> bool:
    """Pass 2: page the waves again, last first (it is still resident), backpropagate each one's
    share of the splat gradients through its projection, computed again, and step Adam on it.
    False when a wave's parameter gradients are not finite although the splat gradients were:
    that wave and those before it stay as they were (the ones after it have stepped)."""
    start = {i: 0 for i in back}
    starts = []
    for counts in fwd.counts:
        starts.append(dict(start))
        for i in back:
            start[i] += counts.get(i, 0)
    for w in reversed(range(len(fwd.waves))):
        keys = fwd.waves[w]
        with ExitStack() as stack:
            cache.pin(keys)
            stack.callback(cache.unpin, keys)
            stack.enter_context(cache.working(step_bytes(keys, fwd.visible[w], cache),
                                              f"the backward of wave {w} of the step"))
            if w > 0:
                cache.prefetch(fwd.waves[w - 1])
            cached = {k: cache.get(k) for k in keys}
            paged = Paged(keys, fwd.visible[w], cached, {k: b.tensors for k, b in cached.items()})
            clock.mark("io")
            projected = project_owned_batch(paged, cameras, sh_degree, backend)
            if any(len(p) != fwd.counts[w][i] for i, p in projected.owned.items()):
                raise RuntimeError(f"wave {w} of the step projected differently the second time: the projection "
                                   "must be deterministic for a step in waves")
            clock.mark("project")
            bp = backprop_owned(projected, {i: _slice_back(b, starts[w][i], starts[w][i] + fwd.counts[w][i])
                                            for i, b in back.items() if i in fwd.counts[w]}, adam_step.mode)
            regularizers.add_grads(projected.gathered.params, bp.contributed)
            clock.mark("backprop")
            if not stepped_grads_finite(projected, bp):
                return False
            adam_update(paged, projected, bp, cameras, cache, lrs, adam, stats, perturb, adam_step.global_step)
            clock.mark("adam")
    return True


def _render_owned(owned: dict[int, Splats2D], cameras: list[Camera], cam_rank: list[int], images: dict[int, Tensor],
                  exchange: Exchange, background: Tensor, backend: str, stats: StepStats, absgrad: bool,
                  ssim_lambda: float, clock: _Clock, cache, blocks: tuple[list[str], list[int]],
                  delivered: Delivered | None) -> tuple[Rendered, dict[int, Back]]:
    """The middle of a step, the same whether its blocks were paged at once or in waves: the
    owners' splats to where their cameras are rendered, the rasterization and losses, and the
    splat gradients back to their owners."""
    routed = route_splats(owned, cam_rank, exchange, len(cameras), blocks, delivered)
    clock.mark("exchange")
    rendered = rasterize_and_loss(routed, cameras, cam_rank, images, exchange.rank, background, backend, stats,
                                  absgrad, ssim_lambda, cache)
    clock.mark("render")
    back = return_grads(routed, rendered, exchange, absgrad)
    clock.mark("exchange")
    return rendered, back


def _record_losses(stats: StepStats, rendered: Rendered) -> None:
    if rendered.losses:  # (one camera, most steps: its loss as it is, without a stack and a mean)
        losses = rendered.losses
        stats.loss = float(losses[0] if len(losses) == 1 else torch.stack(losses).mean())
        stats.psnr = float(sum(rendered.psnrs) / len(rendered.psnrs))


def train_step(
    cameras: list[Camera],  # the step's global batch; every rank knows all of them
    cam_rank: list[int],  # rank that renders each camera
    images: dict[int, Tensor],  # camera index -> ground truth [H, W, 3], for cameras this rank renders
    region: Region,
    cache,  # storage.BlockCache
    exchange: Exchange,
    sh_degree: int,
    lrs: dict[str, float],
    adam: AdamConfig,
    background: Tensor,  # [3]
    backend: str = "cpu",
    perturb=None,  # train.densify.Perturb (MCMC's noise on the means), or None
    adam_step: AdamStep = AdamStep(),  # which rows Adam steps; default: those that reached a pixel
    absgrad: bool = False,  # the statistics sum absolute per-pixel 2D mean gradients (gsplat's absgrad)
    visible: list[list[str]] | None = None,  # per camera: its blocks after occlusion culling (None: its frustum's)
    ssim_lambda: float = SSIM_LAMBDA,  # the D-SSIM term's weight in the loss
    regularizers: Regularizers = Regularizers(),  # the opacity and scale regularisers (none by default)
    waves: list[list[str]] | None = None,  # `train.waves.plan_waves` of the step's blocks: None when they fit at once
    delivered: Delivered | None = None,  # splats the occlusion pass already sent where they are rendered
) -> StepStats:
    stats = StepStats()
    clock = _Clock(stats.timings, stats.cpu)
    if waves is not None:
        return _train_step_in_waves(waves, visible if visible is not None else [region.visible(c) for c in cameras],
                                    cameras, cam_rank, images, cache, exchange, sh_degree, lrs, adam, background,
                                    backend, perturb, adam_step, absgrad, ssim_lambda, regularizers, stats, clock,
                                    delivered)
    paged = page_in(cameras, region, cache, visible)
    try:
        stats.blocks = len(paged.keys)
        clock.mark("io")
        if adam_step.lazy is not None:
            catch_up(paged, cache, adam_step)
            clock.mark("adam")
        projected = project_owned_batch(paged, cameras, sh_degree, backend)
        stats.projected = sum(len(s) for s in projected.owned.values())
        clock.mark("project")
        rendered, back = _render_owned(projected.owned, cameras, cam_rank, images, exchange, background, backend,
                                       stats, absgrad, ssim_lambda, clock, cache,
                                       (projected.gathered.keys, projected.gathered.offsets), delivered)
        bp = backprop_owned(projected, back, adam_step.mode)
        # before the NaN vote: a scale that overflows exp() makes the step's update non-finite
        regularizers.add_grads(projected.gathered.params, bp.contributed)
        clock.mark("backprop")
        finite = losses_finite(rendered) and stepped_grads_finite(projected, bp)
        clock.mark("adam")
        skip = exchange.any(not finite)
        clock.mark("exchange")
        if skip:
            stats.skipped = True
            return stats
        adam_update(paged, projected, bp, cameras, cache, lrs, adam, stats, perturb, adam_step.global_step)
        _record_losses(stats, rendered)
        clock.mark("adam")
        return stats
    finally:
        cache.unpin(paged.keys)


def _train_step_in_waves(waves, visible, cameras, cam_rank, images, cache, exchange, sh_degree, lrs, adam, background,
                         backend, perturb, adam_step, absgrad, ssim_lambda, regularizers, stats, clock,
                         delivered) -> StepStats:
    """`train_step` for a view larger than the cache (its arguments): project in waves, rasterize
    and vote as one batch would, then step in waves."""
    lazy = adam_step.lazy
    prepare = None if lazy is None else (lambda k: catch_up_block(lazy, cache, k, adam_step.number - 1))
    with ExitStack() as held:  # the 2D splats' reservation, for the whole step
        fwd = project_waves(waves, visible, cameras, cache, sh_degree, backend, held, prepare, clock)
        stats.blocks, stats.waves = sum(map(len, waves)), len(waves)
        stats.projected = sum(len(s) for s in fwd.owned.values())
        rendered, back = _render_owned(fwd.owned, cameras, cam_rank, images, exchange, background, backend, stats,
                                       absgrad, ssim_lambda, clock, cache, (fwd.keys, fwd.offsets), delivered)
        finite = losses_finite(rendered) and splat_grads_finite(back, adam_step.mode)
        skip = exchange.any(not finite)
        clock.mark("exchange")
        if skip or not step_waves(fwd, back, cameras, cache, sh_degree, backend, adam_step, regularizers, lrs, adam,
                                  stats, clock, perturb):
            stats.skipped = True
            return stats
    stats.extents = {k: stats.extents[k] for wave in waves for k in wave if k in stats.extents}  # Morton order
    _record_losses(stats, rendered)
    return stats


@torch.no_grad()
def render_cameras(
    cameras: list[Camera],
    cam_rank: list[int],
    region: Region,
    cache,
    exchange: Exchange,
    sh_degree: int,
    background: Tensor,  # [3]
    backend: str = "cpu",
    prepare: Callable[[str], None] | None = None,  # called on each block before it is read (dense Adam's catch-up)
    visible: list[list[str]] | None = None,  # each camera's owned blocks to draw (default: its frustum's)
) -> dict[int, RasterOutput]:  # camera index -> image and its splats, for the cameras this rank renders
    """Forward only (evaluation, viewer): the same culling, projection and exchange as training."""
    rank, n_cams = exchange.rank, len(cameras)
    if visible is None:
        visible = [region.visible(c) for c in cameras]
    out: dict[int, RasterOutput] = {}
    for i, cam in enumerate(cameras):
        keys = visible[i]
        # a view larger than the cache is projected in waves, as in training
        with ExitStack() as held:
            waves = plan_waves(keys, [keys], cache, backward=False) or [keys]
            owned = project_waves(waves, [keys], [cam], cache, sh_degree, backend, held, prepare, backward=False).owned
            mine = {i: owned[0]} if 0 in owned else {}
            outgoing = {(cam_rank[i], i): s for s in mine.values() if cam_rank[i] != rank}
            incoming = exchange.send_splats(outgoing, n_cams)
            if cam_rank[i] == rank:
                parts, s = _parts_for_camera(i, rank, mine, incoming)
                with _raster_memory(cache, i, cam, parts, rank):
                    out[i] = rasterize(s, cam, background, backend=backend)
    return out
