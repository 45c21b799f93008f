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
the result.

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

from octree.order import box_depths, box_footprints, front_to_back
from train.camera import Camera
from train.region import Region
from train.render import Splats2D, rasterize
from train.step import gather, project_owned

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


@dataclass
class CameraCull:
    kept: list[str]  # blocks that may change the image, Morton order
    frustum: list[str]  # blocks in the frustum, Morton order
    waves: int  # rasterizations of the pass
    wave_blocks: int  # blocks the pass paged and projected


@dataclass
class OcclusionReport:
    """One step's culling, summed over its cameras (blocks and Gaussians per camera, so a block
    two cameras see counts twice); bytes over the union of the cameras' blocks."""

    frustum_blocks: int = 0
    frustum_gaussians: int = 0
    kept_blocks: int = 0
    kept_gaussians: int = 0
    bytes_not_read: int = 0  # block bytes in some frustum that the step did not page
    waves: int = 0
    wave_blocks: int = 0

    def fields(self) -> dict[str, int]:
        return {f"occ_{k}": v for k, v in vars(self).items()}


class OcclusionCuller:
    """The culling pass, and the last kept set of each camera (what the next steps prefetch)."""

    SLAB = 1.25  # a wave reaches this many times the depth of its nearest block

    def __init__(self, bytes_per_gaussian: int, max_waves: int = 3) -> None:
        if max_waves < 1:
            raise ValueError(f"max_waves {max_waves}: must be at least 1")
        self.bytes_per_gaussian = bytes_per_gaussian
        self.max_waves = max_waves
        self.last: dict[str, list[str]] = {}  # camera name -> its kept blocks when last culled

    def _nearest_first(self, camera: Camera, region: Region) -> np.ndarray:  # -> [F] region rows
        row = {k: i for i, k in enumerate(region.keys)}
        frustum = np.array([row[k] for k in region.visible(camera)], dtype=np.int64)  # what the step would page
        return frustum[front_to_back(region.extents[frustum], camera.viewmat)]

    def _wave(self, pending: np.ndarray, depth: np.ndarray) -> np.ndarray:  # [P] sorted by depth, [F] -> [W]
        """The next wave: the nearest pending block and every other one starting less than `SLAB`
        times as deep (a facade's blocks all start at about the same depth, and what it hides
        starts deeper; blocks reaching behind the camera make a wave of their own)."""
        if len(pending) == 0:
            return pending
        limit = depth[pending[0]]
        threshold = limit * self.SLAB if limit > 0 else 0.0
        return pending[: max(1, int(np.searchsorted(depth[pending], threshold, side="right")))]

    def prefetch_keys(self, cameras: list[Camera], region: Region) -> list[str]:
        """Blocks to prefetch for these cameras: each one's last kept set, else its first wave."""
        keys: list[list[str]] = []
        for cam in cameras:
            if cam.name in self.last:
                keys.append(self.last[cam.name])
            else:
                order = self._nearest_first(cam, region)
                depth = box_depths(region.extents[order], cam.viewmat)
                keys.append([region.keys[i] for i in order[self._wave(np.arange(len(order)), depth)]])
        return region.union(keys)

    @torch.no_grad()
    def cull_camera(
        self,
        camera: Camera,
        region: Region,
        cache,  # storage.BlockCache
        sh_degree: int,
        background: Tensor,  # [3]
        backend: str = "cpu",
    ) -> CameraCull:
        order = self._nearest_first(camera, region)
        foot = box_footprints(region.extents[order], camera.viewmat, camera.K, camera.width, camera.height)
        alive = np.ones(len(order), dtype=bool)
        rendered = np.zeros(len(order), dtype=bool)
        parts: list[Splats2D] = []
        waves = 0
        for _ in range(self.max_waves):
            pending = np.flatnonzero(alive & ~rendered)
            if len(pending) == 0:
                break
            take = self._wave(pending, foot.depth)
            keys = [region.keys[i] for i in order[take]]
            cache.pin(keys)
            try:
                g = gather({k: cache.get(k).tensors for k in keys}, keys, requires_grad=False)
                projected = project_owned(g, [keys], [camera], sh_degree, backend).splats
            finally:
                cache.unpin(keys)
            drawn = sum(len(p) for p in projected.values())
            parts.extend(projected.values())
            rendered[take] = True
            if drawn == 0:
                continue  # the wave lands nowhere in the image (a block around the camera, say)
            waves += 1
            sat = rasterize(Splats2D.cat(parts), camera, background, backend=backend).sat_depth.cpu().numpy()
            if not np.isfinite(sat).any():
                break  # no pixel saturates: nothing this translucent drops a block soon, more waves would only read
            pyramid = DepthPyramid(sat)
            test = np.flatnonzero(alive & foot.bounded)
            alive[test[foot.near[test] > pyramid.max_over(foot.rects[test])]] = False
        kept = sorted(order[alive].tolist())  # region rows are in Morton order
        result = CameraCull([region.keys[i] for i in kept], [region.keys[i] for i in sorted(order.tolist())],
                            waves, int(rendered.sum()))
        self.last[camera.name] = result.kept
        return result

    def cull(
        self,
        cameras: list[Camera],
        region: Region,
        cache,
        sh_degree: int,
        background: Tensor,  # [3]
        backend: str = "cpu",
    ) -> tuple[list[list[str]], OcclusionReport]:
        """Per camera the owned blocks that may change its image (Morton order), and the report."""
        counts = dict(zip(region.keys, region.counts.tolist()))
        report = OcclusionReport()
        kept: list[list[str]] = []
        frustum: set[str] = set()
        for cam in cameras:
            c = self.cull_camera(cam, region, cache, sh_degree, background, backend)
            kept.append(c.kept)
            frustum.update(c.frustum)
            report.frustum_blocks += len(c.frustum)
            report.frustum_gaussians += sum(counts[k] for k in c.frustum)
            report.kept_blocks += len(c.kept)
            report.kept_gaussians += sum(counts[k] for k in c.kept)
            report.waves += c.waves
            report.wave_blocks += c.wave_blocks
        unread = frustum - set().union(*kept)
        report.bytes_not_read = sum(counts[k] for k in unread) * self.bytes_per_gaussian
        return kept, report
