"""The numbers that define what a rendered pixel is: gsplat's 3DGS semantics, shared by every backend.

They are defined once in `octree.semantics` (the culling, the store and the tiler use them too);
only the tiling of the image, a detail of the rasterizers, is the renderer's own.
"""
from __future__ import annotations

from octree.semantics import (
    ALPHA_MAX,
    ALPHA_MIN,
    EPS2D,
    FAR_PLANE,
    MAX_SH_DEGREE,
    NEAR_PLANE,
    RADIUS_SIGMAS,
    SH_C0,
    T_MIN,
    num_sh_bases,
)

__all__ = ["ALPHA_MAX", "ALPHA_MIN", "EPS2D", "FAR_PLANE", "MAX_SH_DEGREE", "NEAR_PLANE", "RADIUS_SIGMAS", "SH_C0",
           "TILE_SIZE", "T_MIN", "num_sh_bases"]

TILE_SIZE = 16  # pixels per tile side (gsplat's default)
