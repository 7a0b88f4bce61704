"""A fan-out worker of a ``workers = N`` daemon: a mirror of the ingest process, own process.

The supervisor (``ops/supervisor.py``) starts ``python -m kvrelay.ops.worker`` and writes one
line of JSON (:class:`WorkerSpec`) to its stdin. The worker mirrors the ingest process over its
UNIX socket, accepts router connections on the public listening socket it inherited (descriptor
``listen_fd``, shared by every worker and handed on by a hot upgrade), applies the
``[[authorization]]`` rules to the clients whose TLS it terminates (from the spec, then from
each ``AUTHZ`` line a reload writes to its stdin) and talks back on stdout, one line each:
``READY <port>`` once its mirror is synchronized and its listener is up, then ``STATS <json>``
every ``stats_interval_s``, and a last one after its drain when it stops (a graceful exit loses
no count).

Lines go out through ``ReportPipe`` (a writer thread): a supervisor that reads late never
blocks the worker's event loop; STATS reports it could not take are dropped and counted
(``reports_dropped`` in the next report that arrives).

It never talks to systemd (the supervisor owns ``NOTIFY_SOCKET``), ends every stream cleanly and
exits 0 on SIGTERM/SIGINT, and exits as well when its stdin closes: the supervisor is gone.
SIGHUP, SIGUSR1 and SIGUSR2 are the daemon's (reload, upgrade): a worker ignores them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from kvrelay._oom import WORKER, prefer_killing
from kvrelay.contract.limits import RelayLimits
from kvrelay.logging import configure, get_logger
from kvrelay.ops.event_loop import loop_factory, tune_thread_switching
from kvrelay.ops.gc_freeze import freeze_startup_objects
from kvrelay.ops.report_pipe import ReportPipe
from kvrelay.service.authz import AuthorizationRule, authorization_of

_LOG = get_logger("kvrelay.ops.worker")


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """Everything a worker needs, as plain JSON (the supervisor validated the config)."""

    index: int
    upstream: str  # unix:/path of the ingest process's internal listener
    host: str
    port: int
    #: The inherited public listener (shared by all workers); None: bind ``host:port`` itself.
    listen_fd: int | None = None
    limits: dict[str, Any] = field(default_factory=dict)
    #: the listener's TLS files (``ServerTlsFiles.as_json``); None: plaintext
    tls: dict[str, Any] | None = None
    log_level: str = "INFO"
    log_json: bool | None = None
    event_loop: str = "auto"
    shutdown_timeout_s: float = 10.0
    sync_timeout_s: float = 60.0
    stats_interval_s: float = 1.0
    #: ``[[authorization]]`` rules as JSON objects (None: no rules); later ones arrive on stdin
    authorization: list[dict[str, list[str]]] | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        raw = json.loads(text)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in known})

    def relay_limits(self) -> RelayLimits:
        return RelayLimits(**self.limits)


#: A line the supervisor writes on a worker's stdin after the spec: new ``[[authorization]]``
#: rules (a reload), ``AUTHZ <json list or null>``.
AUTHZ_LINE = "AUTHZ "
#: A reload's TLS files, read again for new handshakes:
#: ``TLS {"cert": path, "key": path, "client_ca": path or null, "client_crl": path or null}``;
#: the connections whose client certificate the new CRLs revoke are ended.
TLS_LINE = "TLS "
#: A reload's ``[logging]``: ``LOGGING {"level": "INFO", "json": true, false or null}``.
LOGGING_LINE = "LOGGING "


def rules_json(rules: tuple[AuthorizationRule, ...] | None) -> list[dict[str, Any]] | None:
    return None if rules is None else [
        {k: v if isinstance(v, bool) else list(v) for k, v in asdict(rule).items()}
        for rule in rules
    ]  # fmt: skip


def rules_from_json(raw: Any) -> tuple[AuthorizationRule, ...] | None:
    if raw is None:
        return None
    out = []
    for r in raw:
        values: dict[str, Any] = {k: v if isinstance(v, bool) else tuple(v) for k, v in r.items()}
        out.append(AuthorizationRule(**values))
    return tuple(out)


@dataclass(slots=True)
class WorkerControl:
    """What the supervisor changes in a running worker: its rules (applied to the server once
    it serves; until then kept for it), its TLS files and its logging."""

    rules: list[dict[str, list[str]]] | None = None
    server: Any = None
    tls: Any = None  # the listener's ReloadableServerContext, with [tls]

    def apply(self, rules: list[dict[str, list[str]]] | None) -> None:
        self.rules = rules
        if self.server is not None:
            self.server.service.set_authorization(authorization_of(rules_from_json(rules)))

    def line(self, text: str) -> None:
        """One line from the supervisor; one that cannot be applied keeps what the worker had,
        logged (the main process checked it first: this is a supervisor bug or a file changed
        in between)."""
        try:
            if text.startswith(AUTHZ_LINE):
                self.apply(json.loads(text[len(AUTHZ_LINE) :]))
            elif text.startswith(TLS_LINE):
                files = json.loads(text[len(TLS_LINE) :])
                if self.tls is not None:
                    from kvrelay.ops.tls import ServerTlsFiles

                    self.tls.reload(ServerTlsFiles(**files))
                    if self.server is not None:
                        ended = self.server.revoke(self.tls.is_revoked)
                        if ended:
                            _LOG.warning("tls_revoked_connections_closed", connections=ended)
            elif text.startswith(LOGGING_LINE):
                logging = json.loads(text[len(LOGGING_LINE) :])
                configure(level=str(logging["level"]).upper(), json=logging["json"])
        except Exception as exc:
            _LOG.error("worker_reload_unreadable", error=f"{type(exc).__name__}: {exc}")


async def run_worker(
    spec: WorkerSpec,
    stop: asyncio.Event,
    out: ReportPipe | None = None,
    control: WorkerControl | None = None,
) -> int:
    """Mirror, serve, report (on ``out``, else stdout); returns the exit code once ``stop`` is
    set. ``control`` carries rules that arrive later (stdin)."""
    if control is None:
        control = WorkerControl(spec.authorization)
    from kvrelay.mirror.mirror import Mirror, follow_session
    from kvrelay.mirror.settings import MirrorSettings, UpstreamAddress
    from kvrelay.service.server import RelayServer

    if out is None:
        sys.stdout.flush()
        report_pipe = ReportPipe(sys.stdout.fileno())
    else:
        report_pipe = out
    limits = spec.relay_limits()
    context = None
    if spec.tls is not None:
        from kvrelay.ops.tls import ReloadableServerContext, ServerTlsFiles

        control.tls = ReloadableServerContext(ServerTlsFiles(**spec.tls))
        context = control.tls.in_use
    mirror = Mirror(
        MirrorSettings(
            upstream=UpstreamAddress.parse(spec.upstream),
            limits=limits,
            subscriber_id=f"kvrelay-worker-{spec.index}",
            upstream_heartbeat_s=limits.pool_heartbeat_s,  # one config for both processes
            upstream_readiness_s=limits.readiness_heartbeat_s,
            # never released: the ingest process admits N × max_initialized_pool_hubs hubs for
            # its workers, whose joins it spaces itself; a worker keeps what it mirrors
            release_idle_s=0.0,
        )
    )
    mirror.start()
    server: RelayServer | None = None
    health: asyncio.Task[None] | None = None
    try:
        synced = asyncio.ensure_future(mirror.synced.wait())
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait((synced, stopping), timeout=spec.sync_timeout_s,
                           return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
        synced.cancel()
        stopping.cancel()
        if stop.is_set():
            return 0
        if not mirror.synced.is_set():
            _LOG.error("worker_sync_timeout", worker=spec.index, seconds=spec.sync_timeout_s)
            return 1
        server = RelayServer(mirror, limits)
        control.server = server
        control.apply(control.rules)  # before the listener: no client is served without them
        inherited = None if spec.listen_fd is None else socket.socket(fileno=spec.listen_fd)
        await server.start(spec.host, spec.port, ssl=context, sock=inherited)
        if control.tls is not None:  # each handshake's client checked against the CRLs
            server.revoke(control.tls.is_revoked)
        _LOG.info("worker_serving", worker=spec.index, port=server.port,
                  gil_switch_interval_s=sys.getswitchinterval())  # fmt: skip
        report_pipe.send(f"READY {server.port}", droppable=False)
        health = asyncio.ensure_future(follow_session(mirror, server.health.set_serving))
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), spec.stats_interval_s)
            if stop.is_set():  # the last report comes after the drain (below)
                return 0
            report_pipe.send(_report(server, mirror, report_pipe))
    finally:
        grace = max(0.1, spec.shutdown_timeout_s / 2)
        if health is not None:  # before the drain, which says NOT_SERVING for good
            health.cancel()
        try:
            if server is not None:
                await server.close(grace_s=grace)
                # What the worker counted since its last report, the drain's refusals included:
                # the supervisor keeps an exited worker's last report, so without this one those
                # counts never reached /metrics. A line that must arrive, so the writer's queue
                # never drops it.
                report_pipe.send(_report(server, mirror, report_pipe), droppable=False)
        finally:  # (whatever the report did: the upstream streams end)
            await mirror.stop()
            if out is None:
                report_pipe.close(timeout_s=0.5)


def _report(server: Any, mirror: Any, pipe: ReportPipe) -> str:
    """One ``STATS`` line: the service's and the mirror's counters, the dropped reports."""
    report = {"service": _service_stats(server), "mirror": mirror.stats(),
              "reports_dropped": pipe.dropped}  # fmt: skip
    return "STATS " + json.dumps(report, default=str)


def _service_stats(server: Any) -> dict[str, Any]:
    svc = server.service
    streams, errors = svc.stats()
    denials, revoked = svc.authz_stats()
    refusals, stalled, h2 = svc.guard_stats()
    return {"streams": {k: list(v) for k, v in streams.items()}, "errors": errors,
            "authz": {"denials": denials, "revoked": revoked},
            "guard": {"refusals": _scoped(refusals), "preempted": _scoped(svc.preemption_stats()),
                      "stalled": stalled, "h2": h2}}  # fmt: skip


def _scoped(counts: dict[tuple[str, str], int]) -> dict[str, int]:
    """``(kind, scope)`` counts as JSON keys ``kind/scope`` (the supervisor splits them)."""
    return {f"{kind}/{scope}": n for (kind, scope), n in counts.items()}


async def _main(spec: WorkerSpec) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    for sig in IGNORED_SIGNALS:
        loop.add_signal_handler(sig, _ignored, sig)
    control = WorkerControl(spec.authorization)
    watch = asyncio.ensure_future(_parent_gone(stop, control))
    try:
        return await run_worker(spec, stop, control=control)
    finally:
        watch.cancel()


async def _parent_gone(stop: asyncio.Event, control: WorkerControl) -> None:
    """Read the supervisor's later lines (new rules); stdin closes when the supervisor dies
    (even by SIGKILL): stop then."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 24)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        control.line(line.decode(errors="replace"))
    _LOG.warning("worker_supervisor_gone")
    stop.set()


def _spec_line() -> bytes:
    """The first stdin line, read unbuffered: a buffered read could swallow a rules line sent
    right after it, which the event loop's reader would then never see."""
    out = bytearray()
    while not out.endswith(b"\n"):
        byte = os.read(sys.stdin.fileno(), 1)
        if not byte:
            break
        out += byte
    return bytes(out)


#: Signals meant for the daemon (reload, hot upgrade) that also reach its workers when sent to
#: the whole unit or process group (``systemctl kill -s HUP``, a terminal's hangup): their
#: default action ended the worker at once, its routers' streams without a status. The
#: supervisor passes a reload on through stdin; an upgrade replaces the workers itself.
IGNORED_SIGNALS = (signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def _ignored(sig: signal.Signals) -> None:
    _LOG.info("worker_signal_ignored", signal=sig.name,
              hint="signal the daemon (its main pid), not its workers")  # fmt: skip


def main() -> int:
    for sig in IGNORED_SIGNALS:  # from the start: the loop's handlers come later
        signal.signal(sig, signal.SIG_IGN)
    spec = WorkerSpec.from_json(_spec_line().decode())
    configure(level=spec.log_level.upper(), json=spec.log_json)
    prefer_killing(WORKER)  # under memory pressure: restarted, where the ingest process is not
    tune_thread_switching()
    freeze_startup_objects()  # its imports, before its mirror exists (ops/gc_freeze.py)
    with asyncio.Runner(loop_factory=loop_factory(spec.event_loop)) as runner:
        return int(runner.run(_main(spec)))


if __name__ == "__main__":
    raise SystemExit(main())
