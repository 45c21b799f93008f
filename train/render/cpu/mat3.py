"""3x3 matrices as row-major 9-tuples for numba: they live in registers, where small arrays
allocated per splat inside a parallel loop would each be a heap allocation."""
from __future__ import annotations

from numba import njit

from train.render.cpu.compiled import FINITE_FASTMATH


@njit(cache=True, fastmath=FINITE_FASTMATH)
def mat3(a):  # [3, 3] array -> 9-tuple
    return (a[0, 0], a[0, 1], a[0, 2], a[1, 0], a[1, 1], a[1, 2], a[2, 0], a[2, 1], a[2, 2])


@njit(cache=True, fastmath=FINITE_FASTMATH)
def matmul(a, b):  # a b
    return (a[0] * b[0] + a[1] * b[3] + a[2] * b[6], a[0] * b[1] + a[1] * b[4] + a[2] * b[7],
            a[0] * b[2] + a[1] * b[5] + a[2] * b[8],
            a[3] * b[0] + a[4] * b[3] + a[5] * b[6], a[3] * b[1] + a[4] * b[4] + a[5] * b[7],
            a[3] * b[2] + a[4] * b[5] + a[5] * b[8],
            a[6] * b[0] + a[7] * b[3] + a[8] * b[6], a[6] * b[1] + a[7] * b[4] + a[8] * b[7],
            a[6] * b[2] + a[7] * b[5] + a[8] * b[8])


@njit(cache=True, fastmath=FINITE_FASTMATH)
def transpose(a):
    return (a[0], a[3], a[6], a[1], a[4], a[7], a[2], a[5], a[8])


@njit(cache=True, fastmath=FINITE_FASTMATH)
def matvec(a, v):  # a v for a 3-tuple v
    return (a[0] * v[0] + a[1] * v[1] + a[2] * v[2], a[3] * v[0] + a[4] * v[1] + a[5] * v[2],
            a[6] * v[0] + a[7] * v[1] + a[8] * v[2])


@njit(cache=True, fastmath=FINITE_FASTMATH)
def quat_to_rotmat(w, x, y, z):  # a unit quaternion -> rotation
    return (1.0 - 2.0 * (y * y + z * z), 2.0 * (x * y - w * z), 2.0 * (x * z + w * y),
            2.0 * (x * y + w * z), 1.0 - 2.0 * (x * x + z * z), 2.0 * (y * z - w * x),
            2.0 * (x * z - w * y), 2.0 * (y * z + w * x), 1.0 - 2.0 * (x * x + y * y))


@njit(cache=True, fastmath=FINITE_FASTMATH)
def rotmat_vjp(w, x, y, z, v):
    """Gradient w.r.t. (w, x, y, z) of <v, quat_to_rotmat(w, x, y, z)>."""
    return (2.0 * (-z * v[1] + y * v[2] + z * v[3] - x * v[5] - y * v[6] + x * v[7]),
            2.0 * (y * v[1] + z * v[2] + y * v[3] - 2.0 * x * v[4] - w * v[5] + z * v[6] + w * v[7] - 2.0 * x * v[8]),
            2.0 * (-2.0 * y * v[0] + x * v[1] + w * v[2] + x * v[3] + z * v[5] - w * v[6] + z * v[7] - 2.0 * y * v[8]),
            2.0 * (-2.0 * z * v[0] - w * v[1] + x * v[2] + w * v[3] - 2.0 * z * v[4] + y * v[5] + x * v[6] + y * v[7]))
