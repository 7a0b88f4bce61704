"""The daemon as supervisor of its fan-out workers (``[relay] workers = N``).

The ingest process (discovery, ingest, pools, publication) serves only a UNIX socket; N−1 worker
processes (``ops/worker.py``) mirror it and accept router connections on one public listening
socket that they all inherit (``pass_fds``). The daemon binds that socket before any worker
starts and holds it for its whole life, so the port is known (``bind = "…:0"`` works); the
first worker that serves makes it listen, so the port opens when a worker answers. A
connection that arrives while a worker restarts waits in the shared backlog for any live worker
instead of being reset with a dead worker's own socket, and a hot upgrade hands the very same
socket to the successor's workers (``ops/upgrade.py``): it is never closed, so the port never
refuses a connection. Whichever worker's loop is free first accepts, so connections go to the
workers with time for them.

* ``start`` returns once every worker reported READY (its mirror synchronized, its listener up):
  only then may the daemon tell systemd READY=1. Workers get an environment without
  ``NOTIFY_SOCKET``/``WATCHDOG_*``: only the supervisor talks to systemd.
* A worker that exits while the daemon runs is restarted with backoff (0.5 s doubling to 30 s;
  back to 0.5 s after it served 60 s) and counted in ``restarts``. Its router connections drop;
  routers reconnect and a live worker accepts them from the shared socket. A restart that
  cannot start a process (fork or exec refused) is retried with the same backoff, and a worker
  that dies before it read its spec is an exit like any other: no crash loop ends the watching
  of a slot. A worker that stops
  reporting (its event loop is wedged: no ``STATS`` line for ``HANG_S``) is killed, which then
  counts as an exit.
* Before each restart the front may repair what workers need (``prepare``): the internal
  socket, when its path was removed or its directory made inaccessible (``ops/front.py``).
* ``stop`` sends SIGTERM to every worker (each ends its streams with a clean EOF and exits 0)
  and kills those still running after the timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from kvrelay.logging import get_logger
from kvrelay.ops.worker import WorkerSpec
from kvrelay.service.server import LISTEN_BACKLOG

_LOG = get_logger("kvrelay.ops.supervisor")

RESTART_INITIAL_S = 0.5
RESTART_MAX_S = 30.0
#: A worker that served this long before exiting restarts after the initial delay again.
RESTART_RESET_S = 60.0
#: A serving worker silent this long (it reports every second) is wedged: killed and restarted.
HANG_S = 30.0
#: Longest wait, after a worker exited, for its reader to take the lines still in its pipe.
READ_TAIL_S = 2.0
#: Longest worker line read (a STATS report grows with the number of mirrored pools).
STATS_LINE_MAX = 4 * 1024 * 1024
_SYSTEMD_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID")


class WorkerStartError(RuntimeError):
    """A worker did not report READY in time (or exited first)."""




def shared_socket(host: str, port: int) -> socket.socket:
    """The public socket every worker accepts on, bound but not listening yet (the first
    address ``host`` resolves to, as a single relay's hand-over listener is; IPv6 only on an
    IPv6 address). The first worker that serves makes it listen (its server's ``listen(2)``
    on the shared socket holds for every process that has it): listening before any worker
    could answer, the port took connections a second before anything served them, and a health
    check with a short deadline timed out where the docs promise a refused connection."""
    family, kind, proto, _, addr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    return sock


def shared_listener(host: str, port: int) -> socket.socket:
    """``shared_socket``, listening at once (connections wait in its backlog for a worker)."""
    sock = shared_socket(host, port)
    try:
        sock.listen(LISTEN_BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


def worker_env(base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    for name in _SYSTEMD_ENV:
        env.pop(name, None)
    return env


@dataclass
class _Slot:
    index: int
    proc: asyncio.subprocess.Process | None = None
    started: float = 0.0
    ready: asyncio.Future[int] | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    exits: int = 0
    last_report: float = 0.0
    #: the per-worker counters (``_worker_counters``) of this slot's exited workers: a restarted
    #: worker counts from 0, its series (``{worker="i"}``) must not go backwards
    carried: dict[str, Any] = field(default_factory=dict)
    #: the task reading this worker's lines (``_read``): its last report is read before the
    #: worker's counts are kept
    reader: asyncio.Task[None] | None = None


class Supervisor:
    """Runs ``count`` workers built from ``spec_for(index)``. Single event loop."""

    def __init__(
        self,
        spec_for: Callable[[int], WorkerSpec],
        count: int,
        *,
        start_timeout_s: float = 60.0,
        argv: list[str] | None = None,
        env: dict[str, str] | None = None,
        pass_fds: tuple[int, ...] = (),
        prepare: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """``prepare``: awaited before each restart (the front repairs what a worker needs)."""
        if count < 1:
            raise ValueError("a supervisor needs at least one worker")
        self.spec_for = spec_for
        self.count = count
        self.start_timeout_s = start_timeout_s
        self.argv = argv or [sys.executable, "-m", "kvrelay.ops.worker"]
        self.env = worker_env(env)
        self.pass_fds = pass_fds  # the shared listener: every worker (and restart) inherits it
        self.prepare = prepare
        self.restarts = 0
        self.hung = 0  # workers killed for not reporting
        self.spawn_failures = 0  # restarts whose process could not be started (fork, exec)
        self.hang_s = HANG_S
        self._slots = [_Slot(i) for i in range(1, count + 1)]
        self._watchers: list[asyncio.Task[None]] = []
        self._readers: set[asyncio.Task[None]] = set()
        #: the final counters (``COUNTED``) of workers that exited, so the sums stay monotonic
        self._exited: dict[str, Any] = {}
        self._stopping = False

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Spawn every worker and wait until all of them serve; raises WorkerStartError."""
        try:
            for slot in self._slots:
                await self._spawn(slot)
            await asyncio.wait_for(
                asyncio.gather(*(self._ready(s) for s in self._slots)), self.start_timeout_s
            )
        except (TimeoutError, WorkerStartError, OSError) as exc:  # OSError: no process started
            await self.stop(5.0)
            raise WorkerStartError(f"workers did not all become ready: {exc!r}") from None
        for slot in self._slots:
            self._watchers.append(asyncio.create_task(self._watch(slot)))
        self._watchers.append(asyncio.create_task(self._hang_check()))
        _LOG.info("workers_ready", workers=self.count, pids=self.pids)

    async def _hang_check(self) -> None:
        while True:
            period = self.hang_s / 4
            due = time.monotonic() + period
            await asyncio.sleep(period)
            now = time.monotonic()
            # Woken late, the supervisor itself was not running (its event loop stalled, its
            # process stopped): it could not read the reports its workers wrote meanwhile, so
            # that time is not their silence. Without this credit, every healthy worker was
            # killed as hung right after the ingest process was frozen for HANG_S.
            late = now - due
            if late > 0:
                for slot in self._slots:
                    slot.last_report += late
            for slot in self._slots:
                proc, ready = slot.proc, slot.ready
                serving = ready is not None and ready.done() and not ready.exception()
                if (proc is None or proc.returncode is not None or not serving
                        or now - slot.last_report < self.hang_s):  # fmt: skip
                    continue
                self.hung += 1
                _LOG.error("worker_hung", worker=slot.index, pid=proc.pid,
                           silent_s=round(now - slot.last_report, 1))  # fmt: skip
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()

    async def _ready(self, slot: _Slot) -> int:
        assert slot.ready is not None
        return await slot.ready

    async def _spawn(self, slot: _Slot) -> None:
        """Start the slot's worker and hand it its spec. Raises only if no process could be
        started (``OSError``: fork or exec refused); a process that exits at once (before it
        read its spec) is the slot's worker all the same, its exit seen and restarted like any
        other. The spec is built once the process exists and written with no ``await`` in
        between, and the process is the slot's from then on: a reload that lands while the
        process starts is either in the spec or in a later line ``broadcast`` writes to it."""
        proc = await asyncio.create_subprocess_exec(
            *self.argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            env=self.env, limit=STATS_LINE_MAX, pass_fds=self.pass_fds,
        )  # fmt: skip
        assert proc.stdin is not None and proc.stdout is not None
        slot.proc = proc
        slot.started = slot.last_report = time.monotonic()
        slot.ready = asyncio.get_running_loop().create_future()
        reader = asyncio.create_task(self._read(slot, proc))
        slot.reader = reader
        self._readers.add(reader)
        reader.add_done_callback(self._readers.discard)
        try:
            line = self.spec_for(slot.index).to_json().encode() + b"\n"
        except BaseException:  # no spec: the process would wait for one for good
            proc.kill()
            raise
        try:
            proc.stdin.write(line)
            await proc.stdin.drain()  # stdin stays open: the worker exits when it closes
        except (ConnectionError, RuntimeError) as exc:  # it is gone already (uvloop: closed)
            _LOG.error("worker_spec_unsent", worker=slot.index, pid=proc.pid, error=repr(exc))

    async def _read(self, slot: _Slot, proc: asyncio.subprocess.Process) -> None:
        """Worker → supervisor lines: READY <port>, STATS <json>."""
        assert proc.stdout is not None
        ready = slot.ready
        warned = False  # of a report over STATS_LINE_MAX
        while True:
            try:
                line = await proc.stdout.readline()
            except ValueError:  # a line over STATS_LINE_MAX: dropped, the next one is read
                # The worker wrote a report, so it is not wedged: before, a worker whose every
                # report outgrew the bound (tens of thousands of mirrored pools) was killed as
                # hung every HANG_S.
                slot.last_report = time.monotonic()
                if not warned:
                    warned = True
                    _LOG.warning("worker_report_too_long", worker=slot.index, pid=proc.pid,
                                 limit_bytes=STATS_LINE_MAX)  # fmt: skip
                continue
            if not line:
                break
            text = line.decode(errors="replace").rstrip("\n")
            if text.startswith("READY") and ready is not None and not ready.done():
                ready.set_result(int(text.split()[1]))
            elif text.startswith("STATS "):
                slot.last_report = time.monotonic()
                with contextlib.suppress(ValueError):
                    slot.stats = json.loads(text[len("STATS ") :])
        if ready is not None and not ready.done():
            ready.set_exception(WorkerStartError(f"worker {slot.index} exited before READY"))

    async def _watch(self, slot: _Slot) -> None:
        delay = RESTART_INITIAL_S
        while True:
            proc = slot.proc
            assert proc is not None
            code = await proc.wait()
            await self._read_tail(slot)
            if self._stopping:
                return
            slot.exits += 1
            _add_counts(self._exited, _counters(slot.stats))
            _add_counts(slot.carried, _worker_counters(slot.stats))
            slot.stats = {}
            served = time.monotonic() - slot.started
            if served >= RESTART_RESET_S:
                delay = RESTART_INITIAL_S
            _LOG.error("worker_exited", worker=slot.index, pid=proc.pid, code=code,
                       served_s=round(served, 1), restart_in_s=delay)  # fmt: skip
            delay = await self._respawn(slot, delay)
            if self._stopping:
                return
            try:
                port = await asyncio.wait_for(self._ready(slot), self.start_timeout_s)
                _LOG.info("worker_restarted", worker=slot.index, pid=slot.proc.pid if slot.proc
                          else None, port=port, restarts=self.restarts)  # fmt: skip
            except (TimeoutError, WorkerStartError) as exc:
                _LOG.error("worker_restart_failed", worker=slot.index, error=repr(exc))
                if slot.proc is not None and slot.proc.returncode is None:
                    slot.proc.kill()

    async def _respawn(self, slot: _Slot, delay: float) -> float:
        """After ``delay``, start the slot's next worker; a start refused (fork or exec failing:
        ``EAGAIN`` at the pids limit, memory, the interpreter replaced by a deploy) is logged,
        counted and tried again with the same backoff. Before, it ended the slot's watcher: the
        slot was never restarted again and nothing said so. Returns the next delay."""
        while True:
            await asyncio.sleep(delay)
            if self._stopping:
                return delay
            delay = min(RESTART_MAX_S, delay * 2)
            self.restarts += 1
            if self.prepare is not None:
                try:
                    await self.prepare()
                except Exception as exc:  # a repair that fails: the restart is tried anyway
                    _LOG.error("worker_prepare_failed", worker=slot.index, error=repr(exc))
            try:
                await self._spawn(slot)
            except Exception as exc:  # OSError: fork or exec refused; anything else: no spec
                self.spawn_failures += 1
                _LOG.error("worker_restart_failed", worker=slot.index, error=repr(exc),
                           restart_in_s=delay)  # fmt: skip
                continue
            return delay

    async def _read_tail(self, slot: _Slot) -> None:
        """Wait (bounded) until the reader of an exited worker read its last lines: a final
        report still in the pipe, read after its counts were kept, was added again on top of
        them, and the sums fell back when the successor's first report replaced it."""
        if slot.reader is not None:
            await asyncio.wait((slot.reader,), timeout=READ_TAIL_S)

    def begin_stop(self) -> None:
        """No restart from now on, and SIGTERM to every worker, once: ``stop``'s first step, which
        a caller may take first to act between the workers' signal and their end."""
        if self._stopping:
            return
        self._stopping = True
        for t in self._watchers:
            t.cancel()
        for s in self._slots:
            if s.proc is not None and s.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    s.proc.terminate()

    async def stop(self, timeout_s: float) -> None:
        """SIGTERM every worker (``begin_stop``), wait up to ``timeout_s``, then SIGKILL what is
        left."""
        self.begin_stop()
        procs = [s.proc for s in self._slots if s.proc is not None and s.proc.returncode is None]
        if procs:
            _done, pending = await asyncio.wait(
                [asyncio.ensure_future(p.wait()) for p in procs], timeout=timeout_s
            )
            if pending:
                _LOG.error("workers_killed", count=len(pending))
                for p in procs:
                    if p.returncode is None:
                        with contextlib.suppress(ProcessLookupError):
                            p.kill()
                await asyncio.wait(pending, timeout=5.0)
        # their last reports (after their drains) are read while /metrics still serves
        tails = [s.reader for s in self._slots if s.reader is not None]
        if tails:
            await asyncio.wait(tails, timeout=READ_TAIL_S)
        for s in self._slots:
            if s.proc is not None and s.proc.stdin is not None:
                s.proc.stdin.close()

    # ------------------------------------------------------------------ reading
    @property
    def pids(self) -> list[int | None]:
        return [s.proc.pid if s.proc is not None else None for s in self._slots]

    @property
    def running(self) -> set[int]:
        """The indices of the workers whose process runs (serving or not yet)."""
        return {s.index for s in self._slots if s.proc is not None and s.proc.returncode is None}

    @property
    def alive(self) -> int:
        return sum(
            1 for s in self._slots
            if s.proc is not None and s.proc.returncode is None and s.ready is not None
            and s.ready.done() and not s.ready.exception()
        )  # fmt: skip

    def broadcast(self, line: str) -> int:
        """Write ``line`` to every running worker's stdin (new rules on a reload); a worker
        started later gets them in its spec. Returns how many workers it went to."""
        sent = 0
        for s in self._slots:
            proc = s.proc
            if proc is None or proc.returncode is not None or proc.stdin is None:
                continue
            with contextlib.suppress(ConnectionError, RuntimeError):
                proc.stdin.write(line.encode() + b"\n")
                sent += 1
        return sent

    def _counted(self) -> dict[str, Any]:
        """Every worker's counters (``COUNTED``) summed, exited workers' included."""
        out: dict[str, Any] = {}
        _add_counts(out, self._exited)
        for s in self._slots:
            _add_counts(out, _counters(s.stats))
        return out

    def authz_stats(self) -> tuple[dict[str, int], int]:
        """``KvEventRelayService.authz_stats`` summed over the workers (exited ones included)."""
        authz = self._counted().get("authz", {})
        return dict(authz.get("denials", {})), int(authz.get("revoked", 0))

    def _guard(self) -> dict[str, dict[str, int]]:
        """Guard counts summed: refusals, preempted, stalled, h2 (see ``guard_stats``)."""
        guard: dict[str, dict[str, int]] = self._counted().get("guard", {})
        return guard

    def guard_stats(
        self,
    ) -> tuple[dict[tuple[str, str], int], dict[str, int], dict[str, int]]:
        """``KvEventRelayService.guard_stats`` summed over the workers (exited ones included):
        the workers hold the public connections, so their budgets and shares count."""
        g = self._guard()
        return _unscoped(g.get("refusals", {})), g.get("stalled", {}), g.get("h2", {})

    def preemption_stats(self) -> dict[tuple[str, str], int]:
        """``KvEventRelayService.preemption_stats`` summed over the workers."""
        return _unscoped(self._guard().get("preempted", {}))

    def worker_stats(self) -> list[dict[str, Any]]:
        """The last STATS report of every worker, its own counters (``_worker_counters``)
        including those of the slot's earlier workers, so a restart never sends a series
        backwards ({} for a slot that never reported; only the carried counters while it
        restarts)."""
        out = []
        for s in self._slots:
            stats = dict(s.stats)
            if s.carried:
                counted = _worker_counters(stats)
                _add_counts(counted, s.carried)
                stats["reports_dropped"] = counted.get("reports_dropped", 0)
                stats["mirror"] = {**stats.get("mirror", {}), **counted.get("mirror", {})}
            out.append(stats)
        return out

    def stats(self) -> tuple[dict[str, tuple[int, int]], dict[str, int]]:
        """The router-facing service, summed over workers: (kind → (open, limit), errors).

        Same shape as ``KvEventRelayService.stats`` (limits apply per worker, so the limit
        shown is the sum of the workers' limits)."""
        streams: dict[str, list[int]] = {}
        for s in self._slots:  # gauges: the live workers' only
            for kind, (n, cap) in s.stats.get("service", {}).get("streams", {}).items():
                acc = streams.setdefault(kind, [0, 0])
                acc[0] += int(n)
                acc[1] += int(cap)
        errors: dict[str, int] = self._counted().get("errors", {})
        return {k: (v[0], v[1]) for k, v in streams.items()}, errors


#: The parts of a worker's STATS ``service`` report that are counters: summed over the workers,
#: and kept when a worker exits (its successor counts from 0). Each is a tree of counts.
COUNTED = ("errors", "authz", "guard")


#: The counters of a worker's own report (per worker, ``{worker="i"}``): its mirror's and its
#: dropped reports. Carried over a restart of its slot (``worker_stats``).
MIRROR_COUNTED = ("identity_changes", "pool_totals", "pools_evicted", "plane_ends",
                  "plane_violations", "catalog_invalid", "channel_resets", "channel_deaf",
                  "hold_failures", "hold_denied", "channel_left_draining")  # fmt: skip


def _worker_counters(stats: dict[str, Any]) -> dict[str, Any]:
    """The per-worker counters of one report: ``reports_dropped`` and ``MIRROR_COUNTED``, as
    a new tree (the report is never added into)."""
    mirror = stats.get("mirror", {})
    out: dict[str, Any] = {"mirror": {}}
    _add_counts(out["mirror"], {k: mirror[k] for k in MIRROR_COUNTED if k in mirror})
    if "reports_dropped" in stats:
        out["reports_dropped"] = int(stats["reports_dropped"])
    return out


def _counters(stats: dict[str, Any]) -> dict[str, Any]:
    """The ``COUNTED`` parts of one worker's report."""
    svc = stats.get("service", {})
    return {part: svc[part] for part in COUNTED if part in svc}


def _add_counts(acc: dict[str, Any], tree: dict[str, Any]) -> None:
    """Add every count of ``tree`` into ``acc`` at the same path (nested dicts of ints)."""
    for key, v in tree.items():
        if isinstance(v, dict):
            _add_counts(acc.setdefault(key, {}), v)
        else:
            acc[key] = acc.get(key, 0) + int(v)


def _unscoped(counts: dict[str, int]) -> dict[tuple[str, str], int]:
    """A worker's ``kind/scope`` keys back to ``(kind, scope)``."""
    out: dict[tuple[str, str], int] = {}
    for key, n in counts.items():
        kind, _, scope = key.partition("/")
        out[(kind, scope)] = out.get((kind, scope), 0) + n
    return out
