"""Rendering: `project` (3D Gaussians -> Splats2D), `rasterize` (Splats2D -> image) and
`render = rasterize . project`, with a "cpu" (torch + numba) and a "cuda" (gsplat) backend."""
from train.render.api import BACKENDS, check_splats, project, project_batch, rasterize, render
from train.render.batch import ProjectedBatch
from train.render.errors import RenderError
from train.render.splats2d import RasterOutput, Splats2D, pack_grads, unpack_grads

__all__ = ["BACKENDS", "ProjectedBatch", "RasterOutput", "RenderError", "Splats2D", "check_splats", "pack_grads",
           "project", "project_batch", "rasterize", "render", "unpack_grads"]
