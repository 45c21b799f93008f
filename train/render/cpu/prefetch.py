"""A hint to the core to start loading a cache line now, for reads whose addresses are known a few
iterations ahead but follow no pattern the hardware prefetcher can guess: a tile's list of
splat records, which are scattered over the whole depth-sorted array (3.2 MB at 50k splats)."""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

_READ, _KEEP_IN_ALL_CACHES, _DATA = 0, 3, 1  # llvm.prefetch's rw, locality and cache type arguments


@intrinsic
def prefetch(typingctx, address):
    """prefetch(address): address an integer byte address. Never faults and changes no value:
    a wrong address only wastes the hint."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        signature_ir = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = builder.module.declare_intrinsic("llvm.prefetch", [i8p], signature_ir)
        pointer = builder.inttoptr(context.cast(builder, args[0], signature.args[0], types.intp), i8p)
        builder.call(fn, [pointer, *(ir.Constant(i32, v) for v in (_READ, _KEEP_IN_ALL_CACHES, _DATA))])
        return context.get_dummy_value()

    return types.none(address), codegen
