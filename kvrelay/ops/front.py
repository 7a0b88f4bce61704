"""The daemon's public front with ``workers = N ≥ 2``: an internal socket and N−1 workers.

The source (the relay, or a mirror) is served on a UNIX socket in a private directory (mode
0700, under ``[relay] runtime_dir``: by default ``$RUNTIME_DIRECTORY`` when systemd gives one,
else ``$XDG_RUNTIME_DIR``, else the temp directory); its only subscribers are the
workers, one stream per pool and plane each, so its limits are sized for them
(:func:`internal_limits`) while the configured ``[relay.limits]`` apply in every worker to its
router streams. Limits are per worker: each process bounds what it holds (queues, hubs, streams),
so ``N−1`` workers admit up to ``N−1`` times each stream limit (``docs/scaling.md``).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import tempfile
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

from kvrelay.contract.limits import RelayLimits
from kvrelay.logging import get_logger
from kvrelay.ops.config import DaemonConfig, LoggingConfig, MirrorConfig, TlsConfig
from kvrelay.ops.private_dirs import INTERNAL_SOCKET, PrivateDir, socket_path_problem
from kvrelay.ops.supervisor import Supervisor, shared_socket
from kvrelay.ops.worker import AUTHZ_LINE, LOGGING_LINE, TLS_LINE, WorkerSpec, rules_json
from kvrelay.service.authz import AuthorizationRule

_LOG = get_logger("kvrelay.ops.front")

MiB = 1024 * 1024
#: A worker must never lag its ingest process: room for ~1.5 s of deltas at 600/s, or 64 MiB.
INTERNAL_QUEUE_FRAMES = 1024
INTERNAL_QUEUE_BYTES = 64 * MiB


def internal_limits(limits: RelayLimits, workers: int) -> RelayLimits:
    """Limits of the source when only its ``workers - 1`` fan-out workers subscribe to it."""
    w = max(1, workers - 1)
    return replace(
        limits,
        publication_queue_capacity=max(limits.publication_queue_capacity, INTERNAL_QUEUE_FRAMES),
        publication_queue_bytes=max(limits.publication_queue_bytes, INTERNAL_QUEUE_BYTES),
        # one stream per mirrored pool, plus the per-key probes a worker's routers can cause
        max_pool_streams_total=max(
            limits.max_pool_streams_total,
            w * (limits.max_initialized_pool_hubs + limits.max_pool_streams_total),
        ),
        # each worker mirrors at most max_initialized_pool_hubs pools, and one it evicts may
        # hold its upstream hub a moment longer than the pool that replaces it: the slack
        max_initialized_pool_hubs=(w + 1) * limits.max_initialized_pool_hubs,
        max_subscribers_per_pool=max(limits.max_subscribers_per_pool, 2 * w),
        max_catalog_subscribers=max(limits.max_catalog_subscribers, 2 * w),
        max_readiness_subscribers=max(limits.max_readiness_subscribers, 2 * w),
        max_load_subscribers=max(limits.max_load_subscribers, 2 * w),
    )


def mirror_settings(
    m: MirrorConfig, limits: RelayLimits, ssl: Callable[[], Any] | None = None
) -> Any:
    """``MirrorSettings`` for a ``[mirror]`` section (TLS to the upstream when ``tls_ca``):
    ``ssl`` is what gives the upstream context (the daemon's reloadable one, ``in_use``), else
    one is loaded from the section's files now."""
    from kvrelay.mirror.settings import MirrorSettings, UpstreamAddress

    context: Any = ssl
    if context is None and m.tls_ca is not None:
        from kvrelay.ops.tls import client_ssl_context

        context = client_ssl_context(m.tls_ca, m.tls_cert, m.tls_key)
    return MirrorSettings(
        upstream=UpstreamAddress.parse(m.upstream),
        limits=limits,
        ssl=context,
        subscriber_id=m.subscriber_id,
        sync_wait_s=m.sync_wait_s,
        upstream_heartbeat_s=m.upstream_heartbeat_s,
        release_idle_s=m.release_idle_s,
    )


def private_runtime_dir(base: str | None) -> PrivateDir:
    """A new directory for the internal socket that only this user can enter (0700), swept
    at a later start if this process dies without removing it (``ops/private_dirs.py``); the
    internal listener also checks each peer's credentials (``service/peercred.py``)."""
    return PrivateDir(base)


class WorkerFront:
    """Internal listener + the shared public listener + supervised workers. ``listener``: a hot
    upgrade's inherited one (already listening); otherwise it is bound on ``bind`` and listens
    from the first worker's start on (``shared_socket``)."""

    def __init__(
        self,
        cfg: DaemonConfig,
        view: Any,
        *,
        start_timeout_s: float = 120.0,
        listener: socket.socket | None = None,
    ) -> None:
        self.cfg = cfg
        self.view = view
        self.start_timeout_s = start_timeout_s
        self._dir: PrivateDir | None = None
        self.path: str | None = None
        self.internal: Any = None
        self.supervisor: Supervisor | None = None
        self._listener = listener
        self.port = 0
        #: (device, inode) of the internal socket this process listens on
        self._socket_id: tuple[int, int] | None = None
        #: internal servers (and their directories) replaced after their path was lost: each
        #: serves the running workers started on it, and is closed once none is left
        self._replaced: list[tuple[Any, PrivateDir]] = []
        #: the internal socket path each worker (by index) was last started with
        self._upstreams: dict[int, str] = {}
        self._closing: set[asyncio.Task[None]] = set()
        self.internal_rebinds = 0
        self.internal_closed = 0  # replaced internal servers closed

    async def start(self) -> None:
        from kvrelay.service.server import RelayServer

        cfg = self.cfg
        base = cfg.runtime_dir
        too_long = socket_path_problem(base, INTERNAL_SOCKET)
        if too_long is not None:
            raise RuntimeError(
                f"workers = {cfg.workers} puts its internal socket under "
                f"{base or tempfile.gettempdir()!r}; {too_long}. Set [relay] runtime_dir "
                "(KVRELAY_RELAY_RUNTIME_DIR) to a shorter directory"
            )
        try:
            self._dir = private_runtime_dir(base)
        except OSError as exc:
            raise RuntimeError(
                f"workers = {cfg.workers} needs a writable runtime directory for its internal "
                f"socket; {base or tempfile.gettempdir()!r}: {exc.strerror}. Set [relay] "
                "runtime_dir (KVRELAY_RELAY_RUNTIME_DIR) to a writable directory, e.g. an "
                "emptyDir on Kubernetes"
            ) from None
        self.path = os.path.join(self._dir.path, INTERNAL_SOCKET)
        self.internal = RelayServer(self.view, internal_limits(cfg.relay.limits, cfg.workers))
        await self.internal.start_unix(self.path)
        self._socket_id = _socket_id(self.path)
        if self._listener is None:  # bound; the first worker that serves makes it listen
            self._listener = shared_socket(cfg.bind_host, cfg.bind_port)
        self.port = int(self._listener.getsockname()[1])
        self.supervisor = Supervisor(self._spec, cfg.workers - 1,
                                     start_timeout_s=self.start_timeout_s,
                                     pass_fds=(self._listener.fileno(),),
                                     prepare=self.ensure_internal)  # fmt: skip
        await self.supervisor.start()

    def internal_intact(self) -> bool:
        """Whether a new worker can reach the internal socket: its path is still the socket
        this process listens on, and this user may enter its directory and connect."""
        if self.path is None or self._socket_id is None:
            return False
        return (_socket_id(self.path) == self._socket_id
                and os.access(os.path.dirname(self.path), os.X_OK)
                and os.access(self.path, os.R_OK | os.W_OK))  # fmt: skip

    async def ensure_internal(self) -> None:
        """Before a worker starts: when the internal socket's path was removed (a cleaner of
        ``runtime_dir``, an operator) or its directory made inaccessible, listen on a new one
        in a new private directory, so the new worker can mirror the ingest process; before,
        every restarted worker waited for a socket that was gone, and once the last one went no
        process accepted on the public port while ``/healthz`` said ok. Workers still running
        keep their connections to the old listener; once none of those started on it runs, it
        is closed (``_close_unused``)."""
        from kvrelay.service.server import RelayServer

        self._close_unused()
        if self.internal_intact():
            return
        cfg = self.cfg
        lost = self.path
        try:
            new_dir = private_runtime_dir(cfg.runtime_dir)
        except OSError as exc:
            where = cfg.runtime_dir or tempfile.gettempdir()
            _LOG.error("internal_socket_lost", path=lost, rebound=False,
                       error=f"{where!r}: {exc.strerror}")  # fmt: skip
            return
        path = os.path.join(new_dir.path, INTERNAL_SOCKET)
        server = RelayServer(self.view, internal_limits(cfg.relay.limits, cfg.workers))
        try:
            await server.start_unix(path)
        except BaseException:
            new_dir.remove()
            raise
        assert self._dir is not None
        self._replaced.append((self.internal, self._dir))
        self.internal, self._dir, self.path = server, new_dir, path
        self._socket_id = _socket_id(path)
        self.internal_rebinds += 1
        _LOG.error("internal_socket_lost", path=lost, rebound=True, new_path=path)
        self._close_unused()

    def _close_unused(self) -> None:
        """Close each replaced internal server that no running worker was started on: its path
        is gone, so no worker can connect to it again. Kept until ``stop``, every loss of the
        path left a listener, a server and a directory lock behind in the ingest process.
        Closed in the background (a drain: what is still open on it ends with a status), so
        the restart it comes before is not delayed."""
        running = set() if self.supervisor is None else self.supervisor.running
        used = {self._upstreams.get(i) for i in running}
        kept = []
        for server, directory in self._replaced:
            if os.path.join(directory.path, INTERNAL_SOCKET) in used:
                kept.append((server, directory))
                continue
            task = asyncio.ensure_future(self._close_replaced(server, directory))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        self._replaced = kept

    async def _close_replaced(self, server: Any, directory: PrivateDir) -> None:
        try:
            await server.close(grace_s=max(0.1, self.cfg.shutdown_timeout_s / 2))
        finally:
            directory.remove()
            self.internal_closed += 1
            _LOG.info("internal_socket_closed", path=os.path.join(directory.path, INTERNAL_SOCKET))

    def listening_socket(self) -> socket.socket:
        """The shared public listener (a hot upgrade hands its descriptor to the successor)."""
        if self._listener is None:
            raise RuntimeError("workers not started")
        return self._listener

    def _spec(self, index: int) -> WorkerSpec:
        cfg = self.cfg
        assert self.path is not None
        json_logs = _json_logs(cfg.logging)
        self._upstreams[index] = self.path
        return WorkerSpec(
            index=index,
            upstream=f"unix:{self.path}",
            host=cfg.bind_host,
            port=self.port,
            listen_fd=None if self._listener is None else self._listener.fileno(),
            limits=asdict(cfg.relay.limits),
            tls=None if (files := cfg.tls.files) is None else files.as_json(),
            log_level=cfg.logging.level.upper(),
            log_json=json_logs,
            event_loop=cfg.event_loop,
            # a worker drains in a quarter of the daemon's bound, the supervisor waits half
            shutdown_timeout_s=cfg.shutdown_timeout_s / 2,
            sync_timeout_s=self.start_timeout_s,
            authorization=rules_json(cfg.authorization),
        )

    def set_authorization(self, rules: tuple[AuthorizationRule, ...] | None) -> None:
        """A reload's rules: to every running worker now, and in the spec of any started later."""
        self.cfg = replace(self.cfg, authorization=rules)
        if self.supervisor is not None:
            self.supervisor.broadcast(AUTHZ_LINE + json.dumps(rules_json(rules)))

    def reload_tls(self, tls: TlsConfig) -> None:
        """A reload's certificate files (already loaded once by the caller): every running
        worker reads them again for its new handshakes (and ends its connections whose client
        certificate a new CRL revokes), and a worker started later reads them."""
        self.cfg = replace(self.cfg, tls=tls)
        files = tls.files
        if self.supervisor is not None and files is not None:
            self.supervisor.broadcast(TLS_LINE + json.dumps(files.as_json()))

    def set_logging(self, logging: LoggingConfig) -> None:
        """A reload's ``[logging]``: to every running worker now, and to any started later."""
        self.cfg = replace(self.cfg, logging=logging)
        if self.supervisor is not None:
            line = {"level": logging.level.upper(), "json": _json_logs(logging)}
            self.supervisor.broadcast(LOGGING_LINE + json.dumps(line))

    async def stop(self, grace_s: float) -> None:
        """Workers first (their router streams end with a clean EOF), then the internal socket.

        This process's copy of the public listener is closed as the workers' drains begin: each
        worker closes its own at its drain's start, and the port then refuses new connections,
        as a single-process relay's does. Held here until the end, it kept the socket listening
        with nobody accepting: a router connecting during the drain was left hanging in the
        backlog, then reset when the drain ended, instead of being refused at once."""
        if self.supervisor is not None:
            self.supervisor.begin_stop()  # no restart from now on (none needs the listener)
            self._close_listener()
            await self.supervisor.stop(grace_s)
        if self.internal is not None:
            await self.internal.close(grace_s=grace_s)
        for server, directory in self._replaced:
            await server.close(grace_s=grace_s)
            directory.remove()
        self._replaced.clear()
        if self._closing:
            await asyncio.wait(tuple(self._closing))
        self._close_listener()
        if self._dir is not None:
            self._dir.remove()
            self._dir = None

    def _close_listener(self) -> None:
        """This process's copy of the public listener (after a hand-over the successor's workers
        hold it on)."""
        if self._listener is not None:
            self._listener.close()
            self._listener = None


def _socket_id(path: str) -> tuple[int, int] | None:
    """(device, inode) of the socket at ``path``; None if there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISSOCK(st.st_mode) else None


def _json_logs(logging: LoggingConfig) -> bool | None:
    """A worker's ``configure(json=...)`` for a ``[logging] format``."""
    return {"auto": None, "json": True, "console": False}[logging.format]
