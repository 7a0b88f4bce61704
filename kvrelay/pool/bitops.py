"""``ctz(v)`` and ``popcount(v)`` on u64 inside numba kernels, as single LLVM intrinsics.

The packed tables scan buckets through occupancy and tag-match bit masks; a lookup table or a
multiply trick would cost several times the one instruction the CPU has for each. ``ctz(0)`` is 64.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llvmlite import ir  # type: ignore[import-untyped]
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_I64 = ir.IntType(64)


def _call(builder: Any, name: str, args: list[Any]) -> Any:
    fnty = ir.FunctionType(_I64, [a.type for a in args])
    fn = cgutils.get_or_insert_function(builder.module, fnty, name)  # type: ignore[no-untyped-call]
    return builder.call(fn, args)


@intrinsic  # type: ignore[misc]
def _ctz(typingctx: Any, v: Any) -> Any:
    if not isinstance(v, types.Integer):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        x = context.cast(builder, args[0], signature.args[0], types.uint64)
        return _call(builder, "llvm.cttz.i64", [x, ir.Constant(ir.IntType(1), 0)])

    return types.int64(v), codegen


@intrinsic  # type: ignore[misc]
def _popcount(typingctx: Any, v: Any) -> Any:
    if not isinstance(v, types.Integer):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        x = context.cast(builder, args[0], signature.args[0], types.uint64)
        return _call(builder, "llvm.ctpop.i64", [x])

    return types.int64(v), codegen


# Typed views for callers (numba passes ``typingctx`` itself).
ctz: Callable[[Any], int] = _ctz  # type: ignore[assignment]
popcount: Callable[[Any], int] = _popcount  # type: ignore[assignment]
