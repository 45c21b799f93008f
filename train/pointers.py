"""Arrays of many blocks in one compiled call: a block's arrays by their addresses.

Each resident block's arrays are allocations of their own, so a step over hundreds of small blocks
made a compiled call from the interpreter per block, and that call's passing of arguments cost
more than the block's arithmetic (a street view of a city steps hundreds of blocks of ~100 rows).
Instead the caller passes a table of the blocks' array addresses, which the cache's memo of each
block's numpy views keeps (`optim.numpy_arrays`), and a kernel makes each block's arrays from it.

The addresses are only valid while the arrays live: the caller holds the views (the step's blocks
are pinned) for the length of the call. Every array is C-contiguous, of the dtype and shape the
kernel is told.
"""
from __future__ import annotations

import numba
import numpy as np
from numba import types
from numba.extending import intrinsic


@intrinsic
def _pointer(typingctx, address, like):  # -> a pointer to like's dtype at the integer address
    if not (isinstance(address, types.Integer) and isinstance(like, types.Array)):
        return None
    pointer = types.CPointer(like.dtype)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(pointer))

    return pointer(address, like), codegen


_F32, _I32, _I64 = np.empty(0, np.float32), np.empty(0, np.int32), np.empty(0, np.int64)


@numba.njit(inline="always")
def float_rows(address, n, width):  # -> [n, width] float32 at address
    return numba.carray(_pointer(address, _F32), (n, width))


@numba.njit(inline="always")
def float_vector(address, n):  # -> [n] float32 at address
    return numba.carray(_pointer(address, _F32), n)


@numba.njit(inline="always")
def int32_vector(address, n):  # -> [n] int32 at address
    return numba.carray(_pointer(address, _I32), n)


@numba.njit(inline="always")
def int64_vector(address, n):  # -> [n] int64 at address
    return numba.carray(_pointer(address, _I64), n)


def address(a: np.ndarray) -> int:
    """Where a C-contiguous array's first element lies."""
    if not a.flags.c_contiguous:
        raise ValueError("only a C-contiguous array's address describes all of it")
    return a.ctypes.data
