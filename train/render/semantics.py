"""The numbers that define what a rendered pixel is: gsplat's 3DGS semantics, shared by every backend."""
from __future__ import annotations

TILE_SIZE = 16  # pixels per tile side (gsplat's default)
EPS2D = 0.3  # added to the 2D covariance's diagonal (a low-pass filter of about one pixel)
NEAR_PLANE = 0.01  # camera-space z below which a Gaussian is dropped
FAR_PLANE = 1e10
RADIUS_SIGMAS = 3.33  # upper bound of the support radius in standard deviations
ALPHA_MIN = 1.0 / 255.0  # a splat with smaller alpha at a pixel is skipped there
ALPHA_MAX = 0.999  # alpha is clamped here so transmittance never reaches 0
T_MIN = 1e-4  # a pixel stops when its transmittance would fall to this (the splat that does it is excluded)
MAX_SH_DEGREE = 3  # SH colour degrees 0..3, (degree + 1)^2 coefficients per channel


def num_sh_bases(degree: int) -> int:
    return (degree + 1) ** 2
