"""What a Gaussian is when rendered: gsplat's 3DGS semantics, the one definition of each number.

The culling (`octree.cull`, `octree.bounds`), the renderers (`train.render`), the store's schema
check (`storage.store`) and the tiler all import these, so a block the culling keeps, a splat the
renderer draws and an SH degree the store accepts can never disagree. Plain numbers, no imports:
this is the bottom layer that both the geometry and the storage may depend on.
"""
from __future__ import annotations

EPS2D = 0.3  # added to the 2D covariance's diagonal (a low-pass filter of about one pixel)
NEAR_PLANE = 0.01  # camera-space z below which a Gaussian is dropped
FAR_PLANE = 1e10
# Upper bound of a splat's support radius in standard deviations: gsplat's opacity-aware radius
# is min(3.33, sqrt(2 ln(255 o))) sigma, so 3.33 also bounds the extent boxes the culling uses
# (3 sigma would cull a Gaussian that still colours a pixel).
RADIUS_SIGMAS = 3.33
ALPHA_MIN = 1.0 / 255.0  # a splat with smaller alpha at a pixel is skipped there
ALPHA_MAX = 0.999  # alpha is clamped here so transmittance never reaches 0
T_MIN = 1e-4  # a pixel stops when its transmittance would fall to this (the splat that does it is excluded)
# SH colour degrees 0..3, (degree + 1)^2 coefficients per channel: what the CPU kernels evaluate
# (`train/render/cpu/sh.py`), so what a store may hold.
MAX_SH_DEGREE = 3
SH_C0 = 0.28209479177387814  # the degree-0 basis, 1 / (2 sqrt(pi)): colour = SH_C0 * sh0 + 0.5


def num_sh_bases(degree: int) -> int:
    return (degree + 1) ** 2
