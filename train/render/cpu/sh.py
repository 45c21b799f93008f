"""Real spherical harmonics up to degree 3 (the 3DGS basis and signs) and their gradients, for numba.

Basis b of a unit direction (x, y, z); the colour is sum_b basis_b * coeff_b + 0.5, clamped at 0.
"""
from __future__ import annotations

import math

from numba import njit

from train.render.cpu.compiled import FINITE_FASTMATH

# sqrt((2l+1)/(4 pi) * (l-|m|)!/(l+|m|)!) per (l, |m|), with the 3DGS sign convention below.
_C0 = 0.5 / math.sqrt(math.pi)
_C1 = math.sqrt(3.0 / (4.0 * math.pi))
_C2_1 = 0.5 * math.sqrt(15.0 / math.pi)  # xy, yz, xz
_C2_0 = 0.25 * math.sqrt(5.0 / math.pi)  # 2zz - xx - yy
_C2_2 = 0.25 * math.sqrt(15.0 / math.pi)  # xx - yy
_C3_3 = 0.25 * math.sqrt(35.0 / (2.0 * math.pi))
_C3_2 = 0.5 * math.sqrt(105.0 / math.pi)
_C3_1 = 0.25 * math.sqrt(21.0 / (2.0 * math.pi))
_C3_0 = 0.25 * math.sqrt(7.0 / math.pi)


@njit(cache=True, fastmath=FINITE_FASTMATH)
def sh_basis(x, y, z):  # unit direction -> 16-tuple
    xx, yy, zz = x * x, y * y, z * z
    return (_C0,
            -_C1 * y, _C1 * z, -_C1 * x,
            _C2_1 * x * y, -_C2_1 * y * z, _C2_0 * (2.0 * zz - xx - yy), -_C2_1 * x * z, _C2_2 * (xx - yy),
            -_C3_3 * y * (3.0 * xx - yy), _C3_2 * x * y * z, -_C3_1 * y * (4.0 * zz - xx - yy),
            _C3_0 * z * (2.0 * zz - 3.0 * xx - 3.0 * yy), -_C3_1 * x * (4.0 * zz - xx - yy),
            0.5 * _C3_2 * z * (xx - yy), -_C3_3 * x * (xx - 3.0 * yy))


@njit(cache=True, fastmath=FINITE_FASTMATH)
def sh_basis_grads(x, y, z):  # -> three 16-tuples: d basis / dx, dy, dz (x, y, z as free variables)
    xx, yy, zz = x * x, y * y, z * z
    c3e = 0.5 * _C3_2
    gx = (0.0, 0.0, 0.0, -_C1,
          _C2_1 * y, 0.0, -2.0 * _C2_0 * x, -_C2_1 * z, 2.0 * _C2_2 * x,
          -6.0 * _C3_3 * x * y, _C3_2 * y * z, 2.0 * _C3_1 * x * y, -6.0 * _C3_0 * x * z,
          -_C3_1 * (4.0 * zz - 3.0 * xx - yy), 2.0 * c3e * x * z, -_C3_3 * (3.0 * xx - 3.0 * yy))
    gy = (0.0, -_C1, 0.0, 0.0,
          _C2_1 * x, -_C2_1 * z, -2.0 * _C2_0 * y, 0.0, -2.0 * _C2_2 * y,
          -_C3_3 * (3.0 * xx - 3.0 * yy), _C3_2 * x * z, -_C3_1 * (4.0 * zz - xx - 3.0 * yy), -6.0 * _C3_0 * y * z,
          2.0 * _C3_1 * x * y, -2.0 * c3e * y * z, 6.0 * _C3_3 * x * y)
    gz = (0.0, 0.0, _C1, 0.0,
          0.0, -_C2_1 * y, 4.0 * _C2_0 * z, -_C2_1 * x, 0.0,
          0.0, _C3_2 * x * y, -8.0 * _C3_1 * y * z, _C3_0 * (6.0 * zz - 3.0 * xx - 3.0 * yy),
          -8.0 * _C3_1 * x * z, c3e * (xx - yy), 0.0)
    return gx, gy, gz
