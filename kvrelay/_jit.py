"""numba entry points with declared signatures, compiled in named groups when asked, not at import.

``njit(signatures)`` compiles (or loads from the cache) the moment the module is imported, which
makes a first start a silent minute inside an ``import`` and leaves no place to report progress
or to compile elsewhere. ``kernel(group, *signatures)`` declares the same thing lazily:
``warm(group)`` compiles or loads the declared signatures (the daemon does it before READY, with
progress); the first call before that, from Python or from other njit code, does the same for
that one kernel. Either way only the declared signatures exist afterwards (compilation is then
disabled, as with ``njit(signatures)``), so a plain Python int still converts to ``uint64`` and an
unexpected argument type is a ``TypeError``, never a silent extra specialization.

``missing(group)`` says, without compiling or loading anything, which declared signatures have
no entry in numba's on-disk cache: the daemon uses it to decide whether a first start should
fill the cache in parallel worker processes (``kvrelay.ops.warmup``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from numba import njit

F = TypeVar("F", bound=Callable[..., Any])

__all__ = [
    "GROUPS", "GroupReport", "declared", "inline", "kernel", "kernels", "missing", "signature_of",
    "warm",
]

#: Group names in the order the daemon warms them (hashing is called by the other two).
GROUPS = ("hashing", "ingest", "pool")

_LOCK = threading.RLock()


@dataclass
class _Kernel:
    group: str
    dispatcher: Any
    signatures: tuple[Any, ...]
    ready: bool = False

    @property
    def name(self) -> str:
        f = self.dispatcher.py_func
        return f"{f.__module__}.{f.__qualname__}"

    def ensure(self) -> tuple[int, int]:
        """Compile or load every declared signature once; ``(compiled, loaded)``."""
        with _LOCK:
            if self.ready:
                return 0, 0
            disp = self.dispatcher
            compiled = loaded = 0
            for sig in self.signatures:
                if _load_cached(disp, sig):
                    loaded += 1
                    continue
                hits = sum(disp.stats.cache_hits.values())
                disp.compile(sig)
                if sum(disp.stats.cache_hits.values()) > hits:
                    loaded += 1
                else:
                    compiled += 1
            disp.disable_compile()
            self.ready = True
            return compiled, loaded


_KERNELS: dict[str, list[_Kernel]] = {g: [] for g in GROUPS}


def kernel(group: str, *signatures: Any, **options: Any) -> Callable[[F], F]:
    """``njit(*signatures, cache=True, **options)``, compiled by ``warm(group)`` or first use.

    Without ``signatures`` the one signature is read from the function's annotations
    (``signature_of``), so a kernel with forty array arguments declares its types once.
    """
    if group not in _KERNELS:
        raise ValueError(f"unknown kernel group {group!r}; one of {GROUPS}")
    return _declare(group, signatures, options)


def signature_of(fn: Callable[..., Any]) -> Any:
    """numba signature from annotations: ``npt.NDArray[np.X]`` is a 1-D C-contiguous array of X,
    ``int`` (or ``int | np.int64``) int64, ``bool`` boolean, ``np.uint64`` etc. themselves,
    ``-> None`` void. Anything else is a ``TypeError`` at import, not a guess."""
    import typing

    import numpy as np
    from numba import types
    from numba.np.numpy_support import from_dtype

    def nb(t: Any, where: str) -> Any:
        if t is type(None):
            return types.void
        origin = typing.get_origin(t)
        if origin is np.ndarray:
            dtype = typing.get_args(typing.get_args(t)[1])[0]
            return types.Array(from_dtype(np.dtype(dtype)), 1, "C")
        alias = getattr(origin, "__value__", None)  # numpy 2.5 on Python 3.12+: NDArray is a
        if typing.get_origin(alias) is np.ndarray:  # type alias, ``NDArray[X]`` its own generic
            return types.Array(from_dtype(np.dtype(typing.get_args(t)[0])), 1, "C")
        if typing.get_origin(t) in (typing.Union, __import__("types").UnionType):
            options = set(typing.get_args(t))
            if options <= {int, np.int64}:
                return types.int64
        if t is int:
            return types.int64
        if t is bool:
            return types.boolean
        if isinstance(t, type) and issubclass(t, np.generic):
            return from_dtype(np.dtype(t))
        raise TypeError(f"{fn.__qualname__}: no numba type for {where} annotation {t!r}")

    hints = typing.get_type_hints(fn)
    ret = hints.pop("return", None)
    if ret is None:
        raise TypeError(f"{fn.__qualname__}: annotate the return type")
    args = [nb(hints[name], name) for name in fn.__code__.co_varnames[: fn.__code__.co_argcount]]
    return nb(ret, "return")(*args)


def declared(*signatures: Any, **options: Any) -> Callable[[F], F]:
    """A callee of kernels with declared signatures, compiled when a caller is first typed.

    Without them numba compiles a callee once per distinct argument type, e.g. once for a
    read-only and once for a writable array; with them a caller's argument converts to the
    declared type (writable to read-only, C to any layout) and every caller shares one copy.
    """
    return _declare(None, signatures, options)


def _declare(group: str | None, signatures: tuple[Any, ...], options: Any) -> Callable[[F], F]:
    def wrap(fn: F) -> F:
        disp: Any = njit(cache=True, **options)(fn)
        k = _Kernel(group or "", disp, signatures or (signature_of(fn),))
        if group is not None:
            _KERNELS[group].append(k)
        template = disp.get_call_template

        def first_call(*args: Any, **kws: Any) -> Any:
            # numba's dispatcher calls this on a call no compiled signature matches and invokes
            # what it returns: the dispatcher again, now resolving among the declared signatures.
            k.ensure()
            return disp

        def call_template(args: Any, kws: Any) -> Any:
            # Typing a call from other njit code: declared signatures only (with conversions).
            k.ensure()
            return template(args, kws)

        disp._compile_for_args = first_call
        disp.get_call_template = call_template
        return disp  # type: ignore[no-any-return]

    return wrap


def inline(fn: F) -> F:
    """A helper of other kernels: compiled once per signature, inlined by LLVM (``forceinline``).

    numba's own ``inline="always"`` re-types the helper's IR at every call site; on the walker
    and the apply kernel that cost tens of seconds of compile time for the same machine code.
    No CPython wrapper and no cache entry of its own (its callers are cached), so not callable
    from Python.
    """
    jit: Any = njit
    return jit(forceinline=True, no_cpython_wrapper=True, no_cfunc_wrapper=True)(fn)  # type: ignore[no-any-return]


def kernels(group: str) -> Iterator[tuple[str, int, bool]]:
    """``(name, declared signatures, ready)`` of each kernel of ``group`` imported so far."""
    for k in _KERNELS[group]:
        yield k.name, len(k.signatures), k.ready


@dataclass
class GroupReport:
    group: str
    kernels: int = 0
    compiled: int = 0
    loaded: int = 0
    seconds: float = 0.0
    names: list[str] = field(default_factory=list)


def warm(group: str) -> GroupReport:
    """Compile or load every declared signature of ``group`` (its modules must be imported)."""
    rep = GroupReport(group)
    t0 = time.perf_counter()
    for k in _KERNELS[group]:
        c, ld = k.ensure()
        rep.kernels += 1
        rep.compiled += c
        rep.loaded += ld
        rep.names.append(k.name)
    rep.seconds = time.perf_counter() - t0
    return rep


def _load_cached(disp: Any, sig: Any) -> bool:
    """numba's cache-hit path of ``Dispatcher.compile`` without its ``refresh()`` of the target.

    That refresh imports and installs every typing and lowering registry (~130 ms, a fifth of a
    warm start) and is only needed to compile; numba runs it itself before any compilation. A
    load needs only numba's runtime (NRT) symbols, initialized here.
    False when the cache has no entry (or this numba's internals differ): then compile() does it.
    """
    try:
        from numba.core.compiler_lock import global_compiler_lock
        from numba.core.runtime import rtsys  # type: ignore[attr-defined]

        with global_compiler_lock:
            rtsys.initialize(disp.targetctx)  # the one part of refresh() a load needs (NRT)
            cres = disp._cache._load_overload(sig, disp.targetctx)
            if cres is None:
                return False
            disp._cache_hits[sig] += 1
            if not cres.objectmode:
                disp.targetctx.insert_user_function(cres.entry_point, cres.fndesc, [cres.library])
            disp.add_overload(cres)
            return True
    except Exception:  # private numba API: fall back to the public path
        return False


def _cached(disp: Any, sig: Any) -> bool:
    """Whether numba's cache index holds ``sig`` for ``disp`` (reads the index file only)."""
    cache = disp._cache  # the index is keyed by the signature exactly as compile() got it
    key = cache._index_key(sig, disp.targetctx.codegen())
    return key in cache._cache_file._load_index()


def missing(group: str) -> list[str] | None:
    """Kernels of ``group`` with a declared signature absent from the on-disk cache.

    ``None`` when this numba's cache internals cannot be read (callers then assume nothing is
    missing and simply compile or load in-process).
    """
    out = []
    try:
        for k in _KERNELS[group]:
            if not k.ready and not all(_cached(k.dispatcher, s) for s in k.signatures):
                out.append(k.name)
    except Exception:  # private numba API: never let a probe break a start
        return None
    return out


# ---- LLVM IR kept for linking --------------------------------------------------------------
#
# A kernel loaded from numba's cache keeps, besides its machine code, its whole LLVM module
# parsed from the cached bitcode (``_shared_module``), in case a kernel compiled later calls it
# and links it in. A warmed relay compiles nothing more, yet those modules held about 13 MiB of
# a ~110 MiB resident set. ``release_link_modules`` keeps each module's bitcode compressed
# instead (about a tenth of it) and parses it again the moment numba asks for the module to link
# (``CPUCodeLibrary._get_module_for_linking``), so a later compilation works as before.

_LINK_BITCODE = "_kvrelay_link_bitcode"
_link_patched = False


def _patch_linking() -> bool:
    """Make numba parse a released module again when it needs it to link; False when this
    numba's internals differ (then nothing is released)."""
    global _link_patched
    if _link_patched:
        return True
    try:
        import zlib

        import llvmlite.binding as ll  # type: ignore[import-untyped]
        from numba.core.codegen import CPUCodeLibrary

        original = CPUCodeLibrary._get_module_for_linking
    except (ImportError, AttributeError):
        return False

    def _get_module_for_linking(self: Any) -> Any:
        packed = self.__dict__.pop(_LINK_BITCODE, None)
        if packed is not None and self._shared_module is None:
            self._shared_module = ll.parse_bitcode(zlib.decompress(packed))
        return original(self)  # type: ignore[no-untyped-call]

    CPUCodeLibrary._get_module_for_linking = _get_module_for_linking  # type: ignore[method-assign]
    _link_patched = True
    return True


def _libraries() -> Iterator[Any]:
    """The code libraries of every compiled or loaded kernel and helper of kvrelay."""
    import sys

    from numba.core.dispatcher import Dispatcher

    seen: set[int] = set()
    for name, mod in list(sys.modules.items()):
        if not name.startswith("kvrelay.") or mod is None:
            continue
        for value in list(vars(mod).values()):
            if not isinstance(value, Dispatcher):
                continue
            for cres in list(value.overloads.values()):
                lib = getattr(cres, "library", None)
                if lib is not None and id(lib) not in seen:
                    seen.add(id(lib))
                    yield lib


def release_link_modules() -> int:
    """Replace the LLVM modules the loaded kernels keep for linking by their compressed bitcode
    (see above); returns how many bytes of bitcode they held. Call it once the kernels are
    warm: a module released earlier is only parsed again when a kernel compiled later needs it.
    """
    import zlib

    with _LOCK:
        try:
            from numba.core.compiler_lock import global_compiler_lock
        except ImportError:
            return 0
        if not _patch_linking():
            return 0
        released = 0
        with global_compiler_lock:
            for lib in _libraries():
                module = getattr(lib, "_shared_module", None)
                if module is None or _LINK_BITCODE in lib.__dict__:
                    continue
                bitcode = module.as_bitcode()
                lib.__dict__[_LINK_BITCODE] = zlib.compress(bitcode, 1)
                lib._shared_module = None
                released += len(bitcode)
        return released
