"""``kvrelay._jit``: declared signatures only, nothing compiled at import, and a cache that one
process fills and another loads (what the parallel first start relies on).

The cache tests run in subprocesses with their own empty ``NUMBA_CACHE_DIR``, so they compile the
small ``hashing`` group for real (a few seconds) and never touch the session's cache.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from kvrelay import _jit
from kvrelay.hashing import xxh3
from kvrelay.ingest.tokens_kernel import fill_tokens
from tests.support.commands import REPO, clean_env

HASHING = ["xxh3_64_bytes", "xxh3_64_u64", "xxh3_64_u16", "xxh3_64_u64x2"]

PROBE = """
import json, sys, time
t0 = time.perf_counter()
from kvrelay import _jit
import kvrelay.hashing.xxh3 as x
import numba
before = {"numba_compiles_at_import": sum(
    sum(d.stats.cache_misses.values()) + sum(d.stats.cache_hits.values())
    for d in (x.xxh3_64_bytes, x.xxh3_64_u64, x.xxh3_64_u16, x.xxh3_64_u64x2))}
missing = [m.rsplit(".", 1)[1] for m in _jit.missing("hashing")]
rep = _jit.warm("hashing")
value = int(x.xxh3_64_u64(2**64 - 1, 7))
print(json.dumps({**before, "missing": missing, "compiled": rep.compiled, "loaded": rep.loaded,
                  "kernels": rep.kernels, "value": value,
                  "signatures": [len(x.xxh3_64_u64.overloads), len(x.xxh3_64_bytes.overloads)]}))
"""


def _probe(cache: Path) -> dict[str, object]:
    res = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=REPO, env=clean_env(NUMBA_CACHE_DIR=str(cache)),
        capture_output=True, text=True, timeout=300,
    )
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.splitlines()[-1])  # type: ignore[no-any-return]


def test_a_cache_filled_by_one_process_is_loaded_by_the_next(tmp_path: Path) -> None:
    import xxhash

    want = xxhash.xxh3_64_intdigest((2**64 - 1).to_bytes(8, "little"), 7)
    cold = _probe(tmp_path / "cache")
    assert cold["numba_compiles_at_import"] == 0  # importing compiled and loaded nothing
    assert sorted(cold["missing"]) == sorted(HASHING)  # type: ignore[call-overload]
    assert (cold["compiled"], cold["loaded"], cold["kernels"]) == (4, 0, 4)
    warm = _probe(tmp_path / "cache")
    assert warm["missing"] == []
    assert (warm["compiled"], warm["loaded"]) == (0, 4)
    for run in (cold, warm):
        assert run["value"] == want
        assert run["signatures"] == [1, 1]  # the declared ones, nothing else


def test_worker_process_fills_the_cache_for_this_process(tmp_path: Path) -> None:
    """``python -m kvrelay.ops.warmup --worker hashing`` reports each step as JSON lines and
    leaves the cache warm for another process."""
    res = subprocess.run(
        [sys.executable, "-m", "kvrelay.ops.warmup", "--worker", "hashing"], cwd=REPO,
        env=clean_env(NUMBA_CACHE_DIR=str(tmp_path / "c")), capture_output=True, text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    events = [json.loads(line) for line in res.stdout.splitlines()]
    assert [e["state"] for e in events] == ["compiling", "done"]
    assert events[1]["compiled"] == 4 and events[1]["group"] == "hashing"
    assert _probe(tmp_path / "c")["missing"] == []


def test_worker_usage_errors() -> None:
    from kvrelay.ops.warmup import main

    assert main(["--worker", "nope"]) == 2
    assert main([]) == 2


def test_declared_signatures_convert_or_refuse_but_never_specialize() -> None:
    before = len(fill_tokens.overloads)
    u8 = np.zeros(4, dtype=np.uint8)
    i64 = np.zeros(1, dtype=np.int64)
    with pytest.raises(TypeError):  # float offsets: no such signature, and no new compile
        fill_tokens(u8, i64.astype(np.float64), i64, i64, np.zeros(1, np.bool_), i64, i64,
                    np.zeros(1, np.uint32), np.zeros(1, np.int8))
    assert len(fill_tokens.overloads) == before == 1
    # a writable array converts to the declared read-only one; a Python int to uint64
    assert int(xxh3.xxh3_64_bytes(u8, 0, 4, 0)) == int(xxh3.xxh3_64_bytes(u8.copy(), 0, 4, 0))
    assert len(xxh3.xxh3_64_bytes.overloads) == 1


def test_groups_list_their_kernels() -> None:
    names = {name.rsplit(".", 1)[1] for name, _, _ in _jit.kernels("hashing")}
    assert set(HASHING) <= names
    assert {n.rsplit(".", 1)[1] for n, _, _ in _jit.kernels("ingest")} >= {"walk", "fill_tokens"}
    with pytest.raises(ValueError):
        _jit.kernel("nope", "int64()")


def test_signatures_from_annotations() -> None:
    from numba import types

    def k(a: npt.NDArray[np.uint64], b: npt.NDArray[np.bool_], n: int | np.int64,
          s: np.uint64, f: bool) -> int:
        return 0

    def v(x: np.uint32) -> None:
        return None

    def bad(x: float) -> int:
        return 0

    def unannotated(x: int):  # type: ignore[no-untyped-def]
        return x

    assert _jit.signature_of(k) == types.int64(
        types.uint64[::1], types.boolean[::1], types.int64, types.uint64, types.boolean
    )
    assert _jit.signature_of(v) == types.void(types.uint32)
    for fn in (bad, unannotated):
        with pytest.raises(TypeError):
            _jit.signature_of(fn)


EXERCISE_PROBE = """
import gc, json
import numba
from kvrelay import _jit
from kvrelay.ops import warmup
for g in warmup.STEPS:
    warmup._import(g)
    _jit.warm(g)

def counts():
    return {id(d): (sum(d.stats.cache_hits.values()), sum(d.stats.cache_misses.values()),
                    len(d.overloads), d.py_func.__qualname__)
            for d in gc.get_objects() if isinstance(d, numba.core.registry.CPUDispatcher)}

out = {}
for g in warmup.STEPS:
    before = counts()
    warmup._EXERCISE[g]()
    after = counts()
    out[g] = sorted(v[3] for k, v in after.items() if before.get(k) != v)
print(json.dumps(out))
"""


def test_steps_that_skip_their_exercise_on_a_warm_start_need_nothing_else() -> None:
    """After ``_jit.warm``, a step outside ``EXERCISE_ALWAYS`` loads or compiles nothing more
    when the relay's paths run: its declared kernels are all those paths call from Python."""
    from kvrelay.ops.warmup import EXERCISE_ALWAYS, STEPS

    res = subprocess.run([sys.executable, "-c", EXERCISE_PROBE], cwd=REPO, env=clean_env(),
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    touched = json.loads(res.stdout.splitlines()[-1])
    for step in STEPS:
        if step not in EXERCISE_ALWAYS:
            assert touched[step] == [], (step, touched[step])


NO_KERNELS_PROBE = """
import json, sys
import kvrelay.ops.worker, kvrelay.ops.tls  # what `python -m kvrelay.ops.worker` imports
import kvrelay.mirror.mirror, kvrelay.mirror.settings, kvrelay.service.server
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("numba", "llvmlite"))))
"""


def test_fan_out_workers_import_no_kernels() -> None:
    """``workers = N``'s fan-out worker processes and the mirror they run only re-serve bytes:
    they load no numba at all, so they rightly skip the warm-up and never touch the cache."""
    res = subprocess.run([sys.executable, "-c", NO_KERNELS_PROBE], cwd=REPO, env=clean_env(),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout.splitlines()[-1]) == []


IMPORT_PROBE = """
import json
from kvrelay import _jit
from kvrelay.ops import warmup
for step in warmup.STEPS:
    warmup._import(step)
print(json.dumps({g: _jit.missing(g) for g in warmup.STEPS}))
"""


def test_importing_the_kernel_modules_compiles_nothing(tmp_path: Path) -> None:
    """An eager ``njit(signature)`` would compile inside ``import`` (before a first start can hand
    its step to a worker) and hide the kernels it calls from ``missing``."""
    cache = tmp_path / "c"
    res = subprocess.run(
        [sys.executable, "-c", IMPORT_PROBE], cwd=REPO, env=clean_env(NUMBA_CACHE_DIR=str(cache)),
        capture_output=True, text=True, timeout=120,
    )
    assert res.returncode == 0, res.stderr
    missing = json.loads(res.stdout)
    import kvrelay.ingest.fastwalk
    import kvrelay.pool.ckf  # noqa: F401  (so _jit.kernels lists every group here too)

    assert missing["pool"], missing
    for step in ("hashing", "ingest", "pool"):  # every declared kernel is still missing
        assert sorted(missing[step]) == sorted(name for name, _, _ in _jit.kernels(step)), step
    assert not any(p.is_file() for p in cache.rglob("*")), sorted(cache.rglob("*"))
