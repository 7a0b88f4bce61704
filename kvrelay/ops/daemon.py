"""``kvrelay serve``: the daemon lifecycle around ``Relay`` + ``RelayServer`` (+ metrics).

Order matters for operators: kernels are compiled (or loaded from the numba cache) *before*
readiness, so the first real batch never pays a JIT pause. While that runs (seconds on a first
start, well under one with a warm cache) systemd hears a ``STATUS=`` line per step and every few
seconds, ``EXTEND_TIMEOUT_USEC=`` so ``TimeoutStartSec`` does not kill a first start that is
making progress, and ``WATCHDOG=1``; the log gets one ``kernels_progress`` line per step. systemd
hears ``READY=1`` only once the gRPC port is bound; on SIGTERM/SIGINT the daemon says
``STOPPING=1``, stops accepting, ends every stream with a clean EOF, stops the relay and exits 0 —
or 1 if that takes longer than ``relay.shutdown_timeout_s``. SIGHUP reloads the configuration
file (``ops/reload.py``). SIGUSR2 starts a hot upgrade (``ops/upgrade.py``): a new process of
the code now installed takes over the listeners and the exact state without an ingest gap.

The source is the relay, or a mirror of another relay (``[mirror]``: no numba kernels, so no
warm-up). With ``[relay] workers = N ≥ 2`` the source serves only an internal UNIX socket and N−1
fan-out workers (``ops/front.py``, ``ops/supervisor.py``; they import no kernels either) serve
the public port; READY=1 waits for all of them, SIGTERM drains them first.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import ssl
import sys
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any, NoReturn, TypeVar

from kvrelay import __version__, _oom
from kvrelay._aio import cancel_all
from kvrelay.logging import configure, get_logger
from kvrelay.ops import early_signals
from kvrelay.ops.config import DaemonConfig, MirrorFlags, format_bind
from kvrelay.ops.event_loop import loop_factory, loop_name, tune_thread_switching
from kvrelay.ops.reload import (
    ReloadResult,
    ReloadStats,
    keep_restart_only,
    read_config,
    remove_pid_file,
    restart_only_changes,
    stage_tls,
    stage_upstream_tls,
)
from kvrelay.ops.sdnotify import Notifier
from kvrelay.ops.upgrade import Handoff, UpgradeFailed, Upgrader, UpgradeStats

_LOG = get_logger("kvrelay.ops.daemon")

T = TypeVar("T")

#: Loop-lag sampling period: short enough to see a stall, long enough to cost nothing.
LOOP_LAG_PERIOD_S = 0.25
#: Seconds systemd is told to wait, past ``shutdown_timeout_s``, for a stop (``STOPPING=1``).
STOP_MARGIN_S = 5.0
#: While the kernels warm up: a STATUS/EXTEND_TIMEOUT/WATCHDOG tick this often, each extending
#: systemd's start timeout by WARM_EXTEND_S, for at most WARM_EXTEND_CAP_S in total (a warm-up
#: that hangs must still hit TimeoutStartSec eventually).
WARM_TICK_S = 5.0
WARM_EXTEND_S = 30.0
WARM_EXTEND_CAP_S = 600.0


def drain_grace_s(shutdown_timeout_s: float) -> float:
    """How long a stop waits for its clients to take their streams' ends and calls' answers
    (a subscriber that reads nothing, a call whose request never comes, hold it this long):
    half the stop's bound, so the relay's own stop and state save keep the other half.
    docs/operations.md states this rule (``tests/docs/test_shutdown_doc.py``)."""
    return max(0.1, shutdown_timeout_s / 2)


def _in_daemon_thread(fn: Callable[[], T], name: str = "kvrelay-warmup") -> asyncio.Future[T]:
    """Start ``fn`` in a daemon thread now; the future of its result. A daemon thread, because a
    SIGTERM during a long first-time JIT compile, or a reload's read of a file that never ends
    (a FIFO, a hung network mount), must not wait for it (the default executor would be joined
    at loop shutdown)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def deliver(result: T | None, exc: BaseException | None) -> None:
        if fut.done():
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)  # type: ignore[arg-type]

    def target() -> None:
        try:
            result, exc = fn(), None
        except BaseException as e:
            result, exc = None, e
        with contextlib.suppress(RuntimeError):  # loop already closed: nobody is waiting
            loop.call_soon_threadsafe(deliver, result, exc)

    threading.Thread(target=target, name=name, daemon=True).start()
    return fut


def configure_logging(cfg: DaemonConfig) -> None:
    json = {"auto": None, "json": True, "console": False}[cfg.logging.format]
    configure(level=cfg.logging.level.upper(), json=json)


class Daemon:
    """One relay process: start() brings everything up, stop() takes it down (idempotent)."""

    def __init__(
        self,
        cfg: DaemonConfig,
        notifier: Notifier | None = None,
        *,
        config_path: str | os.PathLike[str] | None = None,
        mirror_flags: MirrorFlags | None = None,
        handoff: Handoff | None = None,
        pid_file: str | None = None,
    ) -> None:
        self.cfg = cfg
        self.config_path = config_path
        #: ``kvrelay mirror``'s options: each reload applies them over the file again
        self.mirror_flags = mirror_flags
        #: Set when this process was started to take over from another (a hot upgrade).
        self.handoff = handoff
        self.pid_file = pid_file
        self.upgrades = UpgradeStats()
        #: Upgrader keyword arguments (deadlines; tests shorten them).
        self.upgrade_options: dict[str, Any] = {}
        #: Called once a successor serves: the process then stops (``serve`` sets it).
        self.on_handed_over: Callable[[], None] | None = None
        self.handed_over = False
        #: A successor (``handoff``) says so once it serves; until then the unit is another's.
        self.took_over = False
        #: Freeze the objects alive after the warm-up out of the collector's walks
        #: (``ops/gc_freeze.py``). ``serve`` sets it: the process is then this daemon's alone,
        #: where tests run many daemons in one process.
        self.freeze_gc = False
        self._upgrade_task: asyncio.Task[None] | None = None
        self.notifier = notifier if notifier is not None else Notifier()
        self.reloads = ReloadStats()
        self._reload_wanted = asyncio.Event()
        #: a reload was asked for (a SIGHUP, a ``reload`` call) since the running upgrade's
        #: successor was started, which read the file then (``_handed_over``)
        self._reloaded_during_upgrade = False
        self._successor_pid: int | None = None
        self._tls: Any = None  # ReloadableServerContext while [tls] is on
        self._upstream_tls: Any = None  # a mirror's ReloadableClientContext with mirror.tls_ca
        self._reload_task: asyncio.Task[None] | None = None
        self._health_task: asyncio.Task[None] | None = None  # a mirror: health on its session
        self.relay: Any = None
        self.mirror: Any = None
        self.server: Any = None
        self.front: Any = None  # workers = N >= 2: internal socket + supervised workers
        #: every listener up (its workers started, the metrics page bound): what a hot upgrade
        #: hands over exists (``request_upgrade``)
        self.serving = False
        self.metrics: Any = None
        self.grpc_port: int | None = None
        self.metrics_port: int | None = None
        self.loop_lag_max_s = 0.0
        self._tasks: list[asyncio.Task[None]] = []
        self._stopped = False

    def _ssl_context(self) -> Callable[[], ssl.SSLContext] | None:
        """What gives the listener's context; reloads hand each handshake the newest fully
        loaded one."""
        files = self.cfg.tls.files
        if files is None:
            return None
        from kvrelay.ops.tls import ReloadableServerContext

        self._tls = ReloadableServerContext(files)
        return self._tls.in_use  # type: ignore[no-any-return]

    def tls_certificates(self) -> tuple[Any, ...]:
        """The certificates the listener serves and trusts now, and the upstream CA and client
        certificate a mirror's next upstream connection uses (``LoadedCertificate``)."""
        served = tuple(self._tls.certificates) if self._tls is not None else ()
        upstream = self._upstream_tls
        return served + (tuple(upstream.certificates) if upstream is not None else ())

    async def _start_source(self) -> Any:
        """The relay (kernels warm first) or the mirror (synchronized first); its limits are
        sized for the workers when they are its only subscribers."""
        cfg = self.cfg
        limits = cfg.relay.limits
        if cfg.workers > 1:
            from kvrelay.ops.front import internal_limits

            limits = internal_limits(limits, cfg.workers)
        if cfg.mirror is not None:
            from kvrelay.mirror.mirror import Mirror
            from kvrelay.ops.front import mirror_settings
            from kvrelay.ops.mirror_metrics import MirrorMetrics

            source, m = None, cfg.mirror
            if m.tls_ca is not None:  # each upstream connection: the newest context
                from kvrelay.ops.tls import ReloadableClientContext

                self._upstream_tls = ReloadableClientContext(m.tls_ca, m.tls_cert, m.tls_key)
                source = self._upstream_tls.in_use
            self._freeze_startup_objects()  # after the imports
            self.mirror = Mirror(mirror_settings(cfg.mirror, limits, ssl=source))
            if cfg.metrics.enabled:
                self.metrics = MirrorMetrics(self.mirror)
                self.metrics.attach_reloads(self.reloads)
                self.metrics.attach_upgrades(self.upgrades)
            self.mirror.start()
            _LOG.info("mirror_synchronizing", upstream=cfg.mirror.upstream)
            await self.mirror.synced.wait()
            if self.handoff is not None:  # a mirror's cut is empty: the hand-over's pacing only
                await self.handoff.state_dir()
            return self.mirror
        from kvrelay.ops import kernelcache

        cache = kernelcache.chosen()
        if cache is not None and cache.persistent and not cache.unusable:
            _LOG.info("kernel_cache", dir=cache.path, source=cache.source, persistent=True)
        elif cache is not None:  # temporary, or a cache directory given that is not writable
            _LOG.warning("kernel_cache", dir=cache.path, source=cache.source,
                         persistent=cache.persistent, unusable=cache.unusable)  # fmt: skip
        warming = self._warm_kernels()  # the warm-up thread starts now ...
        try:
            # ... and the rest of the relay is imported meanwhile (a kernel load from the cache
            # spends about half its time in LLVM, without the GIL).
            import kvrelay.ops.tls
            import kvrelay.service.server  # noqa: F401 (start() serves both)
            from kvrelay.relay.relay import Relay

            if cfg.metrics.enabled:
                from kvrelay.ops.metrics import RelayMetrics
        except BaseException:
            warming.cancel()
            raise
        warm_s = await warming
        from kvrelay.ops.memory import release_after_warmup

        released = release_after_warmup()  # LLVM is not needed to run the kernels
        frozen = self._freeze_startup_objects()
        _LOG.info(
            "kernels_warm", seconds=round(warm_s, 3),
            compiler_pages_released_mib=released.compiler_pages >> 20,
            link_bitcode_released_mib=round(released.link_bitcode / 2**20, 1),
            gc_frozen_objects=frozen,
        )  # fmt: skip
        self.relay = Relay(replace(cfg.relay, limits=limits))
        if cfg.metrics.enabled:  # before the relay starts, so every delta is observed
            self.metrics = RelayMetrics(self.relay, per_member=cfg.metrics.per_member)
            self.metrics.attach_reloads(self.reloads)
            self.metrics.attach_upgrades(self.upgrades)
        if self.handoff is None:
            await self.relay.start()
            return self.relay
        from kvrelay.relay import takeover

        directory = await self.handoff.state_dir()
        try:
            restored = takeover.load(self.relay.pools, directory)
        except takeover.TakeoverRefused as exc:
            raise UpgradeFailed("successor_failed", f"{exc.kind}: {exc}") from None
        await self.relay.start(restored)
        await self._settled(restored)
        return self.relay

    def _freeze_startup_objects(self) -> int:
        """Before any pool or connection exists (``ops/gc_freeze.py``); 0 when not asked to."""
        if not self.freeze_gc:
            return 0
        from kvrelay.ops.gc_freeze import freeze_startup_objects

        return freeze_startup_objects()

    async def _settled(self, restored: dict[str, Any]) -> None:
        """Until every pool handed over is materialized and each member of its cut that the
        configuration still has is live again: vouched for and resumed from its cursor, or reset
        and rebuilt. Bounded: a member whose engine never answers is reset by the pool's own
        timer, and the old process serves until then."""
        from kvrelay.relay.handover import RESTORE_VOUCH_S

        def settled(p: Any) -> bool:
            cut = restored.get(p.name)
            if cut is None:
                return True
            if p.generation is None:
                return False
            for key in cut.members:
                sub = p.subscribers.get(key)
                if key.worker_id in p.by_worker and (sub is None or sub.state != "live"):
                    return False
            return True

        loop = asyncio.get_running_loop()
        deadline = loop.time() + RESTORE_VOUCH_S + 5.0
        while loop.time() < deadline and not all(settled(p) for p in self.relay.pools):
            await asyncio.sleep(0.01)

    async def start(self) -> None:
        if self.handoff is None:
            await self._start()
            return
        # until it takes over, this process is the one to lose under memory pressure: both hold
        # the state, and the old one serves on if this one goes
        oom_before = _oom.current()
        _oom.prefer_killing(_oom.SUCCESSOR)
        try:
            await self._start()
            self._write_pid_file()
            pools = [p.stats() for p in self.relay.pools] if self.relay is not None else []
            await self.handoff.send({"msg": "serving", "pid": os.getpid()})
        except BaseException as exc:
            await self.handoff.fail(f"{type(exc).__name__}: {exc}")
            raise
        self.handoff.close()
        self.took_over = True
        _oom.restore(oom_before)
        self.upgrades.outcome("taken_over")
        _LOG.info("upgrade_took_over", pid=os.getpid(),
                  members_resumed=sum(p.counters.get("members_resumed", 0) for p in pools),
                  members_reset=sum(sum(p.member_resets.values()) for p in pools))  # fmt: skip

    async def _start(self) -> None:
        cfg = self.cfg
        for w in cfg.warnings:
            _LOG.warning("config_warning", path=w.path, reason=w.reason)
        self._sweep_private_dirs()
        context = self._ssl_context()
        self._probe_listeners()  # before the warm-up: a port in use fails now, named
        self._claim_pid_file()
        view = await self._start_source()
        from kvrelay.ops.tls import is_loopback  # (imported while the kernels warmed up)
        from kvrelay.service.authz import authorization_of
        from kvrelay.service.server import RelayServer

        service: Any
        if cfg.workers > 1:
            from kvrelay.ops.front import WorkerFront

            inherited = None if self.handoff is None else self.handoff.listener("grpc")
            self.front = WorkerFront(cfg, view, listener=inherited)
            await self.front.start()
            self.grpc_port = self.front.port
            service = self.front.supervisor
            if self.metrics is not None:
                from kvrelay.ops.mirror_metrics import WorkersCollector

                self.metrics.registry.register(WorkersCollector(self.front.supervisor))
        else:
            self.server = RelayServer(view, cfg.relay.limits)
            self.server.service.set_authorization(authorization_of(cfg.authorization))
            inherited = None if self.handoff is None else self.handoff.listener("grpc")
            await self.server.start(cfg.bind_host, cfg.bind_port, ssl=context, sock=inherited)
            if self._tls is not None:  # each handshake's client checked against the CRLs
                self.server.revoke(self._tls.is_revoked)
            self.grpc_port = self.server.port
            if self.mirror is not None:  # health says whether the mirror has its upstream
                from kvrelay.mirror.mirror import follow_session

                self._health_task = asyncio.create_task(
                    follow_session(self.mirror, self.server.health.set_serving),
                    name="kvrelay-mirror-health",
                )
            service = self.server.service
        if context is None and not is_loopback(cfg.bind_host):
            _LOG.warning(
                "plaintext_grpc_on_network",
                bind=format_bind(cfg.bind_host, self.grpc_port),
                hint="configure [tls] cert/key (and client_ca for mTLS)",
            )
        if self.metrics is not None:
            self.metrics.attach_service(service)
            self.metrics.attach_tls(self.tls_certificates)
            server = self.server
            # liveness: a mirror's health follows its upstream session (``follow_session``),
            # but an upstream outage is no reason to restart the mirror: /healthz is its drain
            healthy = (lambda: server.serving) if server is not None and self.mirror is None else (
                lambda: not self._stopped
            )
            self.metrics_port = await self.metrics.start_http(
                cfg.metrics.host, cfg.metrics.port, healthy=healthy,
                sock=None if self.handoff is None else self.handoff.listener("metrics"),
            )
        self._tasks.append(asyncio.create_task(self._loop_lag(), name="kvrelay-loop-lag"))
        from kvrelay.ops.memory import keep_compiler_pages_released

        self._tasks.append(
            asyncio.create_task(keep_compiler_pages_released(), name="kvrelay-memory")
        )
        self._tasks.append(
            asyncio.create_task(self.notifier.watchdog_loop(), name="kvrelay-watchdog")
        )
        self._reload_task = asyncio.create_task(self._reload_loop(), name="kvrelay-reload")
        self.serving = True
        _LOG.info(
            "relay_serving",
            version=__version__,
            grpc=format_bind(cfg.bind_host, self.grpc_port),
            tls="mtls" if cfg.tls.client_ca else ("tls" if context else "off"),
            metrics=None
            if self.metrics_port is None
            else format_bind(cfg.metrics.host, self.metrics_port),
            pools=len(cfg.relay.pools),
            event_loop=loop_name(asyncio.get_running_loop()),
            gil_switch_interval_s=sys.getswitchinterval(),
            workers=cfg.workers,
            mirror_of=None if cfg.mirror is None else cfg.mirror.upstream,
        )
        what = (
            f"{len(cfg.relay.pools)} pool(s)" if cfg.mirror is None
            else f"mirror of {cfg.mirror.upstream}"
        )
        if cfg.workers > 1:
            what += f", {cfg.workers - 1} fan-out worker(s)"
        self.notifier.ready(
            f"serving gRPC on {format_bind(cfg.bind_host, self.grpc_port)}, {what}"
        )

    def _probe_listeners(self) -> None:
        from kvrelay.ops.listeners import Listener, probe

        cfg = self.cfg
        wanted = [Listener("relay.bind", "KVRELAY_RELAY_BIND", cfg.bind_host, cfg.bind_port)]
        if cfg.metrics.enabled:
            wanted.append(
                Listener("metrics.bind", "KVRELAY_METRICS_BIND", cfg.metrics.host, cfg.metrics.port)
            )
        if self.handoff is not None:  # a hot upgrade's inherited listeners are ours already
            handed = {"relay.bind": "grpc", "metrics.bind": "metrics"}
            wanted = [w for w in wanted if not self.handoff.has(handed[w.setting])]
        probe(wanted)

    def _warm_kernels(self) -> asyncio.Future[float]:
        """Start ``warm_kernels`` in a thread; progress goes to the log and to systemd (see
        above). The future's result is the seconds it took."""
        from kvrelay.ops.warmup import WarmEvent, warm_kernels

        loop = asyncio.get_running_loop()
        t0 = loop.time()
        steps: dict[str, str] = {}  # the latest report of each step, in the order they began

        def tell(extend: bool) -> None:
            elapsed = loop.time() - t0
            now = "; ".join(steps.values()) or "importing the kernel modules"
            self.notifier.status(f"warming up numba kernels ({elapsed:.0f} s): {now}")
            if extend and elapsed < WARM_EXTEND_CAP_S:
                self.notifier.extend_timeout(WARM_EXTEND_S)
            self.notifier.watchdog()

        def on_event(ev: WarmEvent) -> None:
            steps[ev.group] = ev.text
            _LOG.info(
                "kernels_progress", group=ev.group, state=ev.state, step=ev.text,
                **({"seconds": ev.seconds, "compiled": ev.compiled, "loaded": ev.loaded}
                   if ev.state == "done" else {}),
                **({"worker": ev.worker} if ev.worker else {}),
            )
            tell(extend=False)

        def progress(ev: WarmEvent) -> None:  # warm-up thread → event loop
            with contextlib.suppress(RuntimeError):  # loop closed: nobody is listening
                loop.call_soon_threadsafe(on_event, ev)

        tell(extend=False)
        warm = _in_daemon_thread(lambda: warm_kernels(progress))

        async def ticks() -> float:
            try:
                while True:
                    done, _ = await asyncio.wait({warm}, timeout=WARM_TICK_S)
                    if done:
                        return warm.result()
                    tell(extend=True)
            finally:
                warm.cancel()

        return asyncio.ensure_future(ticks())

    # ---- reload ----------------------------------------------------------------------------------

    def request_reload(self) -> None:
        """SIGHUP: reload once the daemon serves; signals during a reload coalesce into one more.
        After a hand-over, the successor's to apply (a ``kvrelay reload`` that read the pid file
        before the successor rewrote it)."""
        self._reloaded_during_upgrade = True
        if self.handed_over and self._successor_pid is not None:
            self._forward_reload("after the hand-over")
            return
        self._reload_wanted.set()

    def _forward_reload(self, why: str) -> None:
        """Signal the successor to reload: it applies the file as it is now."""
        pid = self._successor_pid
        assert pid is not None
        try:
            os.kill(pid, signal.SIGHUP)
        except OSError as exc:
            _LOG.error("upgrade_reload_forwarded", successor_pid=pid, why=why, error=str(exc))
            return
        _LOG.info("upgrade_reload_forwarded", successor_pid=pid, why=why)

    async def _reload_loop(self) -> None:
        while True:
            await self._reload_wanted.wait()
            self._reload_wanted.clear()
            if self.config_path is None:
                _LOG.warning("config_reload_unavailable", reason="started without a config file")
                continue
            await self.reload(self.config_path)

    async def reload(self, path: str | os.PathLike[str]) -> ReloadResult:
        """Re-read ``path`` and apply it live; the running configuration stays on any error."""
        self._reloaded_during_upgrade = True
        self.notifier.reloading()
        status = "reload applied"
        try:
            # off the loop: a read that blocks (a FIFO, a hung network mount) held every client,
            # the ingest and the stop (SIGTERM) until it returned
            new, problems = await _in_daemon_thread(
                lambda: read_config(path, self.mirror_flags), name="kvrelay-reload-read"
            )
            if new is None:
                status = "reload rejected: configuration invalid, running configuration kept"
                self.reloads.outcome("rejected")
                _LOG.error(
                    "config_reload_rejected", path=str(path), problems=[str(p) for p in problems]
                )
                return ReloadResult("rejected", tuple(problems))
            for w in new.warnings:
                _LOG.warning("config_warning", path=w.path, reason=w.reason)
            restart = restart_only_changes(self.cfg, new)
            effective = keep_restart_only(self.cfg, new)
            summary: dict[str, Any] = {}
            try:
                # loaded here first: files that do not load fail the reload before anything
                # changed; they are put in use (and each worker told to read them for its own
                # listener) only once the relay took the new pools
                use_tls = stage_tls(self._tls, effective)
                use_upstream_tls = stage_upstream_tls(self._upstream_tls, effective)
                if self.relay is not None:
                    # the running relay's limits (sized for the workers when they are its only
                    # subscribers) stay: limits are restart-only
                    plan = await self.relay.reconfigure(
                        dataclasses.replace(effective.relay, limits=self.relay.settings.limits)
                    )
                    restart += plan.restart_required
                    summary = plan.summary()
                use_tls()
                use_upstream_tls()  # a mirror's next upstream connection (the open one goes on)
                if self.front is not None:
                    self.front.reload_tls(effective.tls)
                elif self.server is not None and self._tls is not None:
                    self._end_revoked(self.server)
            except Exception as exc:
                status = "reload failed: see the log"
                self.reloads.outcome("failed")
                _LOG.exception("config_reload_failed", path=str(path), error=f"{exc}")
                return ReloadResult("failed")
            if effective.authorization != self.cfg.authorization:
                self._apply_rules(effective.authorization)
            restart = list(dict.fromkeys(restart))  # a setting named by both checks, once
            summary["restart_required"] = restart  # (the relay's plan names only its own)
            if restart:
                _LOG.warning("config_reload_restart_required", settings=restart)
            logging_changed = effective.logging != self.cfg.logging
            if self.relay is not None:
                running = dataclasses.replace(self.relay.settings, limits=self.cfg.relay.limits)
                effective = dataclasses.replace(effective, relay=running)
            self.cfg = effective
            if logging_changed:
                configure_logging(self.cfg)
                if self.front is not None:
                    self.front.set_logging(self.cfg.logging)
            # before the count: a scrape that sees this reload counted sees what it left pending
            self.reloads.restart_pending = tuple(restart)
            self.reloads.outcome("applied")
            _LOG.info("config_reloaded", path=str(path), **summary)
            return ReloadResult("applied", tuple(new.warnings), tuple(restart), summary)
        finally:
            self.notifier.ready(status)

    def _end_revoked(self, server: Any) -> None:
        """End the open connections whose client certificate the reloaded CRLs revoke."""
        ended = server.revoke(self._tls.is_revoked)
        if ended:
            _LOG.warning("tls_revoked_connections_closed", connections=ended)

    def _apply_rules(self, rules: Any) -> None:
        """New ``[[authorization]]`` rules to whatever serves the clients (the workers, each)."""
        from kvrelay.service.authz import authorization_of

        if self.front is not None:
            self.front.set_authorization(rules)
        elif self.server is not None:
            self.server.service.set_authorization(authorization_of(rules))
        _LOG.info("authorization_reloaded", rules=len(rules or ()))

    # ---- hot upgrade -----------------------------------------------------------------------------

    def request_upgrade(self) -> None:
        """SIGUSR2: start a hot upgrade (``ops/upgrade.py``), unless this process cannot hand over
        (refused: logged and counted; it goes on serving)."""
        why = None
        # (``front`` is set before its workers start, ``server`` before the metrics page binds:
        # an upgrade then would hand over no metrics listener, and the successor's own bind
        # would fail once this process took the port)
        source = self.relay is not None or self.mirror is not None
        if not self.serving or not source or self._stopped or self.handed_over:
            why = "not serving (starting, stopping or already handed over)"
        elif self._upgrade_task is not None and not self._upgrade_task.done():
            why = "an upgrade is already under way"
        if why is not None:
            self.upgrades.outcome("refused")
            _LOG.warning("upgrade_refused", reason=why)
            return
        self._upgrade_task = asyncio.create_task(self._upgrade(), name="kvrelay-upgrade")

    async def _upgrade(self) -> None:
        from kvrelay.relay import takeover

        front = self.front if self.front is not None else self.server
        listeners = {"grpc": front.listening_socket()}
        if self.metrics is not None and self.metrics.listening_socket() is not None:
            listeners["metrics"] = self.metrics.listening_socket()

        async def cut(directory: Any) -> dict[str, Any]:
            # a mirror holds no state of its own: its successor synchronizes from upstream
            pools = self.relay.pools if self.relay is not None else []
            c = await takeover.cut_aside(pools, directory)
            return {"pools": list(c.pools), "members": c.members, "bytes": c.bytes}

        self.notifier.status("hot upgrade: starting the successor")
        self._reloaded_during_upgrade = False
        try:
            await Upgrader(listeners, **self.upgrade_options).run(cut, self._handed_over)
        except Exception as exc:
            if isinstance(exc, UpgradeFailed):
                result, why, trace = exc.result, str(exc), False
            else:  # anything else (the successor is killed by then): told too, traceback and all
                result, why, trace = "successor_failed", f"{type(exc).__name__}: {exc}", True
            self.upgrades.outcome(result)
            _LOG.error("upgrade_failed", result=result, why=why, exc_info=trace)
            self._sweep_private_dirs()  # what a successor killed outright left behind
            self.notifier.status(f"hot upgrade failed ({result}); still serving")

    def _sweep_private_dirs(self) -> None:
        """Remove the private directories that kvrelay processes which died without cleaning up
        left in the runtime directories (``ops/private_dirs.py``): at start, and after a failed
        upgrade (a successor killed outright)."""
        from kvrelay.ops.private_dirs import sweep
        from kvrelay.ops.upgrade import handover_parent

        bases = [self.cfg.runtime_dir]
        with contextlib.suppress(OSError):  # no usable temporary directory: nothing made there
            bases.append(handover_parent())
        removed = sweep(bases)
        if removed:
            _LOG.info("private_dirs_swept", dirs=removed)

    def _claim_pid_file(self) -> None:
        """A first start writes ``--pid-file`` once both ports proved free (before the
        warm-up, so ``kvrelay reload --pid-file`` finds it meanwhile). Written earlier, a second
        ``serve`` of the same configuration, failing on the ports, replaced the running relay's
        file and then removed it as its own. A write that fails fails the start."""
        if self.pid_file is None or self.handoff is not None:  # a successor's: at take-over
            return
        from kvrelay.ops.reload import write_pid_file

        write_pid_file(self.pid_file)

    def _write_pid_file(self) -> None:
        """A successor takes the pid file over once it serves (``serve --pid-file`` leaves it to
        the process it replaces until then); a failure is logged, not fatal."""
        if self.pid_file is None:
            return
        from kvrelay.ops.reload import write_pid_file

        try:
            write_pid_file(self.pid_file)
        except Exception as exc:  # OSError, or a directory others may write to
            _LOG.error("pid_file_unwritable", path=self.pid_file, error=str(exc))

    def _handed_over(self, pid: int) -> None:
        """The successor serves (and names itself in the pid file): it becomes systemd's main
        PID; we stop."""
        self.handed_over = True
        self._successor_pid = pid
        self.upgrades.outcome("handed_over")
        self.notifier.notify(f"MAINPID={pid}\nSTATUS=handed over to pid {pid}")
        _LOG.info("upgrade_handed_over", successor_pid=pid)
        if self._reloaded_during_upgrade:
            # the successor read the file when it started: a reload applied here since (an
            # operator's edit) would be lost with this process
            self._forward_reload("reloaded during the upgrade")
        if self.on_handed_over is not None:
            self.on_handed_over()

    async def _loop_lag(self) -> None:
        """Sample scheduling lag: how late a timer fires is how late every stream is."""
        loop = asyncio.get_running_loop()
        while True:
            t0 = loop.time()
            await asyncio.sleep(LOOP_LAG_PERIOD_S)
            lag = max(0.0, loop.time() - t0 - LOOP_LAG_PERIOD_S)
            self.loop_lag_max_s = max(self.loop_lag_max_s, lag)
            if self.metrics is not None:
                self.metrics.observe_loop_lag(lag)

    async def stop(self) -> None:
        """Stop accepting, end streams cleanly, stop the relay, close sockets."""
        if self._stopped:
            return
        self._stopped = True
        # after a hand-over, STOPPING=1 would stop the successor's unit; before a takeover, the
        # predecessor's (systemd takes it from any process of the unit with NotifyAccess=all)
        if not self.handed_over and (self.handoff is None or self.took_over):
            # the stop's own bound, and a margin: a shutdown_timeout_s above the unit's
            # TimeoutStopSec= no longer has systemd kill the relay before it saved its state
            self.notifier.stopping(self.cfg.shutdown_timeout_s + STOP_MARGIN_S)
        _LOG.info("relay_stopping", handed_over=self.handed_over)
        if self._reload_task is not None:  # a reload half-way must not race the shutdown
            await cancel_all([self._reload_task])
        if self._upgrade_task is not None:  # an upgrade half-way kills its successor
            await cancel_all([self._upgrade_task])
        grace = drain_grace_s(self.cfg.shutdown_timeout_s)
        if self._health_task is not None:  # before the drain, which says NOT_SERVING for good
            await cancel_all([self._health_task])
        try:
            if self.front is not None:
                await self.front.stop(grace)
            if self.server is not None:
                await self.server.close(grace_s=grace)
            if self.mirror is not None:
                await self.mirror.stop()
            if self.relay is not None:
                await self.relay.stop(save_state=self._saves_state())
            if self.metrics is not None:
                await self.metrics.close()
        finally:
            await cancel_all(self._tasks)
            self._tasks.clear()
            self.notifier.close()

    def _saves_state(self) -> bool:
        """Whether the final stop saves state: not after handing it over (the successor's is
        newer), and not as a successor stopped before it took over while its predecessor lives
        (the predecessor gave up on it: it serves on, and its own checkpoints are newer). A
        successor whose predecessor died saves what it restored and vouched for."""
        if self.handed_over:
            return False
        if self.handoff is not None and not self.took_over and self.handoff.predecessor_lives():
            _LOG.info("state_not_saved", reason="the predecessor serves on and keeps its state")
            return False
        return True


async def serve(
    cfg: DaemonConfig,
    notifier: Notifier | None = None,
    *,
    config_path: str | os.PathLike[str] | None = None,
    mirror_flags: MirrorFlags | None = None,
    pid_file: str | None = None,
) -> int:
    """Run until SIGTERM/SIGINT (SIGHUP reloads ``config_path``, with ``mirror_flags`` over it,
    SIGUSR2 hot-upgrades), or until a successor took over; the process exit code (0 clean, 1
    failure or slow shutdown)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals_seen: list[int] = []

    def on_signal(signum: int) -> None:
        signals_seen.append(signum)
        if len(signals_seen) > 1:  # second signal: the operator insists
            _forced_exit(signum, pid_file)
        _LOG.info("signal_received", signal=signal.Signals(signum).name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        handoff = Handoff.from_env()
    except ValueError as exc:
        _LOG.error("start_failed", error=str(exc))
        return 1
    daemon = Daemon(cfg, notifier, config_path=config_path, mirror_flags=mirror_flags,
                    handoff=handoff, pid_file=pid_file)  # fmt: skip
    daemon.on_handed_over = stop.set
    daemon.freeze_gc = True
    loop.add_signal_handler(signal.SIGHUP, daemon.request_reload)
    loop.add_signal_handler(signal.SIGUSR2, daemon.request_upgrade)
    loop.add_signal_handler(signal.SIGUSR1, _ignore_signal, signal.SIGUSR1)
    for sig in early_signals.take():  # came before these handlers (``ops/early_signals.py``)
        if sig == signal.SIGHUP:
            daemon.request_reload()  # applied once it serves, as any during the start-up
        elif sig == signal.SIGUSR2:
            daemon.request_upgrade()  # refused: not serving yet
        else:
            _ignore_signal(sig)
    code = 0
    try:
        starting = asyncio.create_task(daemon.start())
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait((starting, stopping), return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():  # signal during start-up (e.g. a long first JIT compile)
            starting.cancel()
        try:
            await starting
        except asyncio.CancelledError:
            pass
        except Exception as exc:
            _LOG.error("start_failed", error=f"{type(exc).__name__}: {exc}")
            code = 1
        else:
            await stop.wait()
        stopping.cancel()
        limit = daemon.cfg.shutdown_timeout_s  # as reloaded: it applies at once
        try:
            await asyncio.wait_for(daemon.stop(), limit)
        except TimeoutError:
            _LOG.error("shutdown_timeout", seconds=limit)
            return 1
        except Exception as exc:
            _LOG.error("shutdown_failed", error=f"{type(exc).__name__}: {exc}")
            return 1
        _LOG.info("relay_stopped", exit_code=code)
        return code
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
            loop.remove_signal_handler(sig)
        early_signals.hold(stop_on_term=False)  # one now (a late reload) must not kill the exit


def _forced_exit(signum: int, pid_file: str | None) -> NoReturn:
    """Exit 1 at once, skipping the stop. The pid file goes too, if it still names this
    process: left behind, it names a pid the system may give to another process, which
    ``kvrelay reload`` or ``upgrade`` would then signal (SIGHUP or SIGUSR2, whose default
    action ends it; ``upgrade`` then even reports a hand-over)."""
    _LOG.error("forced_exit", signal=signal.Signals(signum).name)
    if pid_file is not None:
        remove_pid_file(pid_file)
    os._exit(1)


def _ignore_signal(sig: signal.Signals) -> None:
    """SIGUSR1 means nothing to the daemon; its default action would kill it (and with it
    every stream, unsaved), as it did when ``systemctl kill -s USR1`` reached the unit."""
    _LOG.info("signal_ignored", signal=sig.name,
              hint="SIGHUP reloads, SIGUSR2 hot-upgrades, SIGTERM stops")  # fmt: skip


def _raise_fd_limit(cfg: DaemonConfig) -> None:
    """The open-file soft limit up to what ``max_connections`` needs (``ops/fd_limit.py``)."""
    from kvrelay.ops.fd_limit import raise_soft_limit

    got = raise_soft_limit(cfg.relay.limits.max_connections)
    if got.short:
        _LOG.warning("fd_limit_low", soft=got.after, hard=got.hard, wanted=got.wanted,
                     hint="raise the hard RLIMIT_NOFILE (LimitNOFILE=, ulimit -n, the "
                          "container runtime's default): connections past it are refused")
    elif got.after != got.before:
        _LOG.info("fd_limit_raised", before=got.before, soft=got.after, hard=got.hard)


def run(
    cfg: DaemonConfig,
    main: Callable[..., Any] = serve,
    *,
    config_path: str | os.PathLike[str] | None = None,
    mirror_flags: MirrorFlags | None = None,
    pid_file: str | None = None,
) -> int:
    """Configure logging, pick the event loop (``ops/event_loop.py``) and run ``main(cfg)`` (with
    ``config_path=`` when given: the file SIGHUP reloads; ``mirror_flags=``: the options
    ``kvrelay mirror`` applies over it; ``pid_file=``: the file a hot upgrade rewrites)."""
    configure_logging(cfg)
    from kvrelay.ops.memory import tune_malloc

    tune_malloc()  # before the relay allocates anything large
    tune_thread_switching()
    _raise_fd_limit(cfg)
    try:
        factory = loop_factory(cfg.event_loop)
    except ImportError:
        _LOG.error("uvloop_unavailable", hint="install uvloop or set relay.event_loop")
        return 1
    with asyncio.Runner(loop_factory=factory) as runner:
        kwargs: dict[str, Any] = {}
        if config_path is not None:
            kwargs["config_path"] = config_path
        if mirror_flags is not None:
            kwargs["mirror_flags"] = mirror_flags
        if pid_file is not None:
            kwargs["pid_file"] = pid_file
        coro = main(cfg, **kwargs)
        return int(runner.run(coro))
