"""``prefetch(arr, i)``: a CPU cache prefetch hint for ``arr[i]`` usable inside numba kernels.

The apply kernel is bound by dependent cache misses (lineage → owner → CKF bucket); issuing hints a
few events ahead overlaps those misses. A hint never faults and never changes results.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llvmlite import ir  # type: ignore[import-untyped]
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


@intrinsic  # type: ignore[misc]
def _prefetch(typingctx: Any, arr: Any, idx: Any) -> Any:
    if not isinstance(arr, types.Array) or not isinstance(idx, types.Integer):
        return None
    sig = types.void(arr, idx)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        aryty, idxty = signature.args
        ary = context.make_array(aryty)(context, builder, args[0])
        i = context.cast(builder, args[1], idxty, types.intp)
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [i])  # type: ignore[no-untyped-call]
        i8p = ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(ir.VoidType(), [i8p, ir.IntType(32), ir.IntType(32), ir.IntType(32)])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")  # type: ignore[no-untyped-call]
        i32 = ir.IntType(32)
        # read access, high temporal locality, data cache
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return sig, codegen


# Typed view for callers (numba passes ``typingctx`` itself).
prefetch: Callable[[Any, Any], None] = _prefetch  # type: ignore[assignment]
