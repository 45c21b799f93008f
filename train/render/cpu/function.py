"""The CPU rasterizer as a torch autograd Function over the numba kernels."""
from __future__ import annotations

import numba
import numpy as np
import torch
from torch import Tensor

from train.render.cpu import kernels
from train.render.cpu.binning import bin_tiles
from train.render.splats2d import GRAD_FLOATS, RasterOutput, Splats2D, unpack_grads

# Tiles differ in cost by orders of magnitude (sky vs foliage): hand them out one at a time. Only
# numba's TBB and work-queue layers do; under its OpenMP layer (`train.pools`' default) the tiles
# are split into one contiguous run a thread whatever the chunk size (a loop of 100 heavy then 100
# light iterations: 12.1 ms on two threads, 13.4 on one). The image's halves cost about the same:
# on ten views of the 50k bench, taking tiles from a shared counter changed the backward by
# -0.12 ms and the forward by +0.07 ms of 7.2 and 5.4 (docs/benchmarks.md).
_TILES_PER_CHUNK = 1


def _array(t: Tensor) -> np.ndarray:
    """A float32 C-contiguous numpy view of a CPU tensor (a copy only if it is not one already)."""
    return t.detach().to(torch.float32).contiguous().numpy()


class _Rasterize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, means2d: Tensor, conics: Tensor, opacities: Tensor, colors: Tensor,
                depths: Tensor, radii: Tensor, width: int, height: int, background: Tensor,
                absgrad: list | None, packed: list | None):
        bins = bin_tiles(_array(means2d), _array(conics), _array(opacities), _array(colors), _array(depths),
                         radii.detach().to(torch.int32).contiguous().numpy(), width, height)
        records = bins.records  # in depth order: the kernels index these, and results map back by bins.order
        bg = _array(background)
        rgb = np.empty((height, width, 3), np.float32)
        alpha = np.empty((height, width), np.float32)
        t_final = np.empty((height, width), np.float32)
        stop = np.empty((height, width), np.int32)
        sat_depth = np.empty((height, width), np.float32)
        tile_end = np.empty(bins.tiles_x * bins.tiles_y, np.int32)
        contributed = np.zeros(len(records), np.bool_)
        blended = np.zeros(bins.n_isects, np.uint8)
        with numba.parallel_chunksize(_TILES_PER_CHUNK):
            kernels.forward(bins.offsets, bins.gids, records, bins.order, bg, width, height, bins.tiles_x,
                            kernels.LANES, rgb, alpha, t_final, stop, sat_depth, tile_end, contributed, blended)
        ctx.state = (bins, bg, t_final, stop, tile_end, blended, width, height, absgrad, packed)
        contributed_t = torch.from_numpy(contributed)
        sat_t = torch.from_numpy(sat_depth)
        ctx.mark_non_differentiable(contributed_t, sat_t)
        return torch.from_numpy(rgb), torch.from_numpy(alpha)[..., None], contributed_t, sat_t

    @staticmethod
    def backward(ctx, v_rgb: Tensor, v_alpha: Tensor, _v_contributed, _v_sat_depth):
        bins, bg, t_final, stop, tile_end, blended, width, height, absgrad, packed = ctx.state
        grads = np.empty((bins.n_isects, kernels.GRAD_COLS), np.float32)  # every row written by the kernel
        absgrads = np.empty((bins.n_isects if absgrad is not None else 0, 2), np.float32)
        with numba.parallel_chunksize(_TILES_PER_CHUNK):
            kernels.backward(bins.offsets, bins.gids, bins.records, bg, width, height,
                             bins.tiles_x, kernels.LANES, t_final, stop, tile_end, blended, _array(v_rgb),
                             _array(v_alpha[..., 0]), grads, absgrads, absgrad is not None)
        per_splat = torch.from_numpy(kernels.reduce_grads(grads, bins.hit_starts, bins.hit_slots, bins.order))
        if absgrad is not None:
            absgrad.append(torch.from_numpy(kernels.reduce_grads(absgrads, bins.hit_starts, bins.hit_slots,
                                                                 bins.order)))
        if packed is not None:  # handed over as it is: no split into leaves to pack again
            packed.append(per_splat)
            return (None,) * 11
        return (*unpack_grads(per_splat), None, None, None, None, None, None, None)


def rasterize_cpu(splats: Splats2D, width: int, height: int, background: Tensor,
                  absgrad: bool = False, packed_grads: bool = False) -> RasterOutput:
    """background: [3] float32 on the CPU. absgrad: the backward also sums absolute per-pixel
    2D mean gradients, read after it with `RasterOutput.absgrad()`. packed_grads: the backward
    leaves the splats' gradients as one [M, 9] tensor (`RasterOutput.packed_grads()`) instead of
    accumulating them on the differentiable fields."""
    box: list[Tensor] | None = [] if absgrad else None  # the backward appends [M, 2]
    packed: list[Tensor] | None = [] if packed_grads else None  # the backward appends [M, 9]
    rgb, alpha, contributed, sat_depth = _Rasterize.apply(
        splats.means2d, splats.conics, splats.opacities, splats.colors, splats.depths, splats.radii,
        width, height, background, box, packed)
    m = len(splats)
    return RasterOutput(rgb, alpha, contributed, sat_depth,
                        None if box is None else lambda: box[-1] if box else torch.zeros(m, 2),
                        None if packed is None else lambda: packed[-1] if packed else torch.zeros(m, GRAD_FLOATS))
