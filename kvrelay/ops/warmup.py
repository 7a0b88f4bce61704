"""Kernel warm-up: every numba kernel the relay uses, compiled or loaded before READY.

Three steps, one per kernel group of ``kvrelay._jit``: ``hashing`` (XXH3 entry points, the salt
of LoRA adapters and cache namespaces), ``ingest`` (msgpack walker, token parser) and ``pool``
(apply, cuckoo filter, publication take). Each imports its modules (which compile nothing),
compiles or loads the group's declared signatures, then, after a compile, runs the relay's Python
paths once on tiny inputs, so a kernel compiled lazily on some path is covered too: the first real
batch never pays a JIT pause on the event loop.

A first start (kernels missing from the on-disk cache) on a machine with two or more CPUs runs
each cold step of declared kernels in a worker process (``python -m kvrelay.ops.warmup --worker
STEP``) while this process does the pool step, the longest; the workers fill the cache and this
process then loads from it. numba compiles under one process-wide lock, so threads would not
overlap; processes do. With a warm cache nothing is spawned. ``KVRELAY_WARM_WORKERS=0`` turns
the workers off.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from kvrelay import _jit

#: Step order: hashing first (the other two call it). Steps done in this process run before
#: those handed to workers are waited for.
STEPS = ("hashing", "ingest", "pool")
_MODULES: dict[str, tuple[str, ...]] = {
    "hashing": ("kvrelay.hashing.xxh3", "kvrelay.hashing.tokens", "kvrelay.ingest.salt"),
    "ingest": ("kvrelay.ingest.tokens_kernel", "kvrelay.ingest.fastwalk", "kvrelay.ingest.decoder"),
    "pool": (
        "kvrelay.pool.ckf", "kvrelay.pool.pool", "kvrelay.publication.cbi1",
        "kvrelay.publication.delta_body",
    ),
}
_WHAT = {
    "hashing": "XXH3, salts",
    "ingest": "msgpack walker, token parser",
    "pool": "apply, cuckoo filter, publication",
}
#: Steps whose Python paths may still call a kernel that is not a declared ``_jit.kernel``: their
#: exercise runs on every start. For the others it runs only when something was compiled (a
#: test holds that, after ``_jit.warm``, their exercise loads and compiles nothing).
EXERCISE_ALWAYS = frozenset({"pool"})
#: The step a first start always does in this process, while workers do the others: the longest
#: (most of its kernels are typed on first use, so a worker could not do it without the same
#: exercise, and the cache index cannot tell it cold).
LOCAL_STEP = "pool"
WORKERS_ENV = "KVRELAY_WARM_WORKERS"


@dataclass(frozen=True)
class WarmEvent:
    """One progress report: a step started (``compiling`` / ``loading`` / ``worker``) or ended."""

    group: str
    state: str
    text: str
    seconds: float = 0.0
    compiled: int = 0
    loaded: int = 0
    worker: int = 0  # pid of the worker process that reported it, 0 for this process

    def __str__(self) -> str:
        return self.text


Progress = Callable[[WarmEvent], None]


def _import(group: str) -> None:
    for name in _MODULES[group]:
        importlib.import_module(name)


def _exercise_hashing() -> None:
    from kvrelay.ingest.salt import namespace_part, request_salt

    request_salt.__wrapped__("kvrelay-warmup", "kvrelay-warmup")
    namespace_part.__wrapped__("kvrelay-warmup")


def _exercise_ingest() -> None:
    import msgspec

    from kvrelay.ingest.decoder import HASH_FORMAT_EAGLE, HASH_FORMAT_STANDARD, Decoder

    stored = {
        "type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": None,
        "token_ids": list(range(1, 10)), "block_size": 4, "lora_id": None, "medium": "GPU",
        "lora_name": None,
    }
    removed = {"type": "BlockRemoved", "block_hashes": [12], "medium": "GPU"}
    fast = msgspec.msgpack.encode([time.time(), [stored, removed], 0])
    one = {**stored, "block_hashes": [b"\x01" * 32], "token_ids": list(range(1, 6))}  # 1 block
    slow = msgspec.msgpack.encode([time.time(), [one], 0])
    for fmt in (HASH_FORMAT_STANDARD, HASH_FORMAT_EAGLE):
        for payload in (fast, slow):  # the walker, then msgspec + the token parser
            res = Decoder(kv_block_size=4, dp_rank=0, hash_format=fmt).decode(payload)
            if res.batch.n_events == 0:
                raise RuntimeError("kernel warm-up: the decoder dropped the warm-up batch")


def _exercise_pool() -> None:
    import numpy as np

    from kvrelay.hashing.identity import DEFAULT_CKF_SEED, bucket_count_for
    from kvrelay.pool.batch import BatchBuilder, PackedBatch
    from kvrelay.pool.pool import FORMAT_EAGLE, FORMAT_STANDARD, Pool
    from kvrelay.publication import cbi1

    bc = bucket_count_for(64)
    for fmt, extra in ((FORMAT_STANDARD, 0), (FORMAT_EAGLE, 1)):
        batch = (
            BatchBuilder()
            .store([11, 12], np.arange(1, 9 + extra, dtype=np.uint32))
            .store([13], np.arange(20, 24 + extra, dtype=np.uint32), parent=12)
            .remove([13])
            .build()
        )
        pool = Pool(bucket_count=bc, seed=DEFAULT_CKF_SEED, block_size=4, hash_format=fmt)
        member = pool.add_member(1, 0)
        result = pool.apply(member, batch)
        if result.events_rejected:
            raise RuntimeError(f"kernel warm-up batch rejected: {result.errors}")
        again = pool.apply(member, PackedBatch.pack(batch))  # a live message's path: apply_packed
        if again.events_rejected:
            raise RuntimeError(f"kernel warm-up batch rejected: {again.errors}")
        pub = pool.take_publication()
        if pub is not None:
            buckets, words = pub
            cbi1.encode_delta(
                buckets.astype(np.uint64), words, seed=pool.seed, bucket_count=bc, dc_id=1,
                base_epoch=0, epoch=1,
            )
        pool.contains(np.array([1, 2], dtype=np.uint64))
        pool.resident_canonical(member)
        pool.apply(member, BatchBuilder().clear().build())
        pool.reset_member(member)
        pool.remove_member(member)


_EXERCISE: dict[str, Callable[[], None]] = {
    "hashing": _exercise_hashing,
    "ingest": _exercise_ingest,
    "pool": _exercise_pool,
}


def run_step(group: str, progress: Progress | None = None) -> WarmEvent:
    """One step in this process: import, compile or load the declared kernels, exercise."""
    t0 = time.perf_counter()
    _import(group)
    missing = _jit.missing(group)
    if progress is not None:
        what = _WHAT[group]
        if missing:
            text = f"{group}: compiling {what} ({len(missing)} kernels not in the cache)"
        elif group in EXERCISE_ALWAYS:  # kernels typed on first use: the cache may lack them
            text = f"{group}: loading {what} from the cache, or compiling what it lacks"
        else:
            text = f"{group}: loading {what} from the cache"
        progress(WarmEvent(group, "compiling" if missing else "loading", text))
    rep = _jit.warm(group)
    if rep.compiled or group in EXERCISE_ALWAYS:
        _EXERCISE[group]()
    seconds = time.perf_counter() - t0
    verb = "compiled" if rep.compiled else "ready" if group in EXERCISE_ALWAYS else "loaded"
    done = WarmEvent(
        group, "done", f"{group}: {_WHAT[group]} {verb} in {seconds:.1f} s",
        round(seconds, 3), rep.compiled, rep.loaded,
    )
    if progress is not None:
        progress(done)
    return done


class _Worker:
    """``python -m kvrelay.ops.warmup --worker GROUP``: its progress lines are relayed."""

    def __init__(self, group: str, progress: Progress | None) -> None:
        self.group = group
        self.done: WarmEvent | None = None
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvrelay.ops.warmup", "--worker", group],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, close_fds=True,
        )
        self._progress = progress
        self._reader = threading.Thread(target=self._read, name=f"kvrelay-warm-{group}",
                                        daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                ev = dataclasses.replace(WarmEvent(**json.loads(line)), worker=self.proc.pid)
            except (ValueError, TypeError):
                continue
            if ev.state == "done":
                self.done = ev
            if self._progress is not None:
                self._progress(ev)

    def wait(self) -> bool:
        """True when the worker finished its step (the cache now holds its kernels)."""
        rc = self.proc.wait()
        self._reader.join()
        return rc == 0 and self.done is not None

    def error(self) -> str:
        err = self.proc.stderr.read() if self.proc.stderr is not None else ""
        return (err.strip().splitlines() or [f"exit code {self.proc.returncode}"])[-1]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)


def _workers_allowed() -> bool:
    if os.environ.get(WORKERS_ENV, "") == "0":
        return False
    try:
        return len(os.sched_getaffinity(0)) >= 2
    except (AttributeError, OSError):
        return (os.cpu_count() or 1) >= 2


def serialized(progress: Progress | None) -> Progress | None:
    """``progress`` called under one lock: workers' reader threads and this thread report at
    once, and a caller that prints (text, then its newline) would glue two lines together."""
    if progress is None:
        return None
    lock = threading.Lock()
    report = progress

    def locked(ev: WarmEvent) -> None:
        with lock:
            report(ev)

    return locked


def warm_kernels(progress: Progress | None = None, workers: bool | None = None) -> float:
    """Compile or load every kernel (all steps); returns the seconds it took.

    ``workers``: each step with declared kernels missing from the cache is compiled in its own
    worker process while this process does the pool step, all at once (default: when 2+
    CPUs are usable and ``KVRELAY_WARM_WORKERS`` is not ``0``). A worker that fails is
    reported and its step is simply done here.
    """
    t0 = time.perf_counter()
    progress = serialized(progress)
    for g in STEPS:
        _import(g)
    offload: dict[str, _Worker] = {}
    if workers if workers is not None else _workers_allowed():
        # LOCAL_STEP's few declared kernels (and the XXH3 ones they call) before any worker
        # competes for the CPU, as when importing its modules compiled them: measured, starting
        # the workers first made a first start slower (its pool step is the critical path)
        _jit.warm(LOCAL_STEP)
        # this process does LOCAL_STEP; every other cold step of declared kernels goes to a worker
        cold = [g for g in STEPS if g != LOCAL_STEP and _jit.missing(g)]
        for g in cold:
            offload[g] = _Worker(g, progress)
            if progress is not None:
                progress(WarmEvent(g, "worker", f"{g}: compiling {_WHAT[g]} in a worker "
                                                f"process (pid {offload[g].proc.pid})"))
    try:
        # this process's own steps first (hashing, then pool, which compiles lazily through
        # its exercise), so they overlap the workers instead of waiting for them
        for g in sorted(STEPS, key=lambda g: g != LOCAL_STEP):
            if g not in offload:
                run_step(g, progress)
        for g in [g for g in STEPS if g in offload]:
            w = offload.pop(g)
            if not w.wait() and progress is not None:
                progress(WarmEvent(g, "compiling", f"{g}: worker failed ({w.error()}); "
                                                   "compiling here"))
            run_step(g, progress)  # after a worker: loads what it compiled
    finally:
        for w in offload.values():
            w.kill()
    return time.perf_counter() - t0


def _orphan_guard() -> None:
    """A worker whose parent died (SIGKILL during a first start) stops instead of compiling on."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="kvrelay-warm-orphan-guard", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] != "--worker" or args[1] not in STEPS:
        print("usage: python -m kvrelay.ops.warmup --worker {hashing,ingest,pool}",
              file=sys.stderr)
        return 2
    _orphan_guard()

    def emit(ev: WarmEvent) -> None:
        print(json.dumps(asdict(ev)), flush=True)

    run_step(args[1], emit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
