"""Reload on SIGHUP: re-read the configuration file and apply what the running process can.

The file is validated exactly as ``kvrelay check-config`` does; a file with errors is rejected
with the same messages and the running configuration stays. A valid file is split in two:

* applied live — pools and engines (see ``kvrelay/relay/reconfigure.py``), discovery, DNS and
  liveness intervals, logging, the shutdown timeout, ``[[authorization]]`` rules, and the TLS
  certificate, key and client CRL (the files are read again, so a rotated certificate takes
  effect for new connections, and a connection whose client certificate a new CRL revokes is
  ended); a mirror's upstream client files (``[mirror] tls_ca``, ``tls_cert``, ``tls_key``) are
  read again too, for its next upstream connection;
* kept until a restart — listener addresses, metrics settings, TLS on/off and ``client_ca``, the
  event loop, ``dc_name``, ``drt_instance_id`` and the limits; a mirror's other ``[mirror]`` keys,
  TLS to its upstream on/off, and its ``[relay]`` keys (it uses none live); a relay turned into
  a mirror or back. Each such difference is logged, and exported until a restart
  (``kvrelay_config_restart_pending``), where ``kvrelay reload`` reads it.

A mirror and a relay take the same path: one rule for what a reload applies, and the same
counting (``ReloadStats``). systemd hears ``RELOADING=1`` when a reload starts and ``READY=1``
when it ends, applied or not."""

from __future__ import annotations

import dataclasses
import os
import socket
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvrelay._text import is_decimal
from kvrelay.logging import get_logger
from kvrelay.ops.config import (
    ConfigProblem,
    DaemonConfig,
    MirrorFlags,
    check_file,
    format_bind,
    mirror_config,
)
from kvrelay.relay import safe_files

_LOG = get_logger("kvrelay.ops.reload")

#: DaemonConfig fields only a restart applies, by the path an operator knows them by.
RESTART_FIELDS: dict[str, Callable[[DaemonConfig], Any]] = {
    "relay.bind": lambda c: (c.bind_host, c.bind_port),
    "relay.event_loop": lambda c: c.event_loop,
    "metrics": lambda c: c.metrics,
    "tls (on/off)": lambda c: c.tls.enabled,
    "tls.client_ca": lambda c: c.tls.client_ca,
    "relay.limits": lambda c: c.relay.limits,
    "relay.workers": lambda c: c.workers,
    "relay.runtime_dir": lambda c: c.runtime_dir,
}

#: ``[mirror]`` keys a reload applies: the upstream client's TLS files, read again for the
#: mirror's next upstream connection (the one it holds keeps its handshake).
MIRROR_LIVE_KEYS = ("tls_ca", "tls_cert", "tls_key")


@dataclass(slots=True)
class ReloadStats:
    """Outcomes since start (``kvrelay_config_reloads_total`` and the last-reload gauges), and
    the settings the file changed that only a restart applies (``restart_pending``: as of the
    last applied reload, each compared with the value this process runs; empty after a
    restart), so ``kvrelay reload`` can say what did not take effect."""

    applied: int = 0
    rejected: int = 0
    failed: int = 0
    last_successful: bool = True
    last_success_unix: float = field(default_factory=time.time)
    restart_pending: tuple[str, ...] = ()

    def outcome(self, result: str) -> None:
        setattr(self, result, getattr(self, result) + 1)
        self.last_successful = result == "applied"
        if self.last_successful:
            self.last_success_unix = time.time()


@dataclass(frozen=True, slots=True)
class ReloadResult:
    result: str  # "applied" | "rejected" | "failed"
    problems: tuple[ConfigProblem, ...] = ()
    restart_required: tuple[str, ...] = ()
    summary: dict[str, object] = field(default_factory=dict)


def restart_only_changes(old: DaemonConfig, new: DaemonConfig) -> list[str]:
    changed = [path for path, get in RESTART_FIELDS.items() if get(old) != get(new)]
    return changed + _source_changes(old, new)


def _source_changes(old: DaemonConfig, new: DaemonConfig) -> list[str]:
    """What only a restart changes of the source: a relay turned into a mirror or back, a
    mirror's keys but its upstream TLS files (and TLS to its upstream on or off), and a
    mirror's ``[relay]`` keys. A relay's own are named by its reconfiguration plan."""
    if (old.mirror is None) != (new.mirror is None):
        return ["mirror"]
    if old.mirror is None or new.mirror is None:
        return []
    was, now = old.mirror, new.mirror
    changed = [f"mirror.{f.name}" for f in dataclasses.fields(was)
               if f.name not in MIRROR_LIVE_KEYS and getattr(was, f.name) != getattr(now, f.name)]
    if (was.tls_ca is None) != (now.tls_ca is None):
        changed.append("mirror.tls_ca (on/off)")
    changed += [f"relay.{f.name}" for f in dataclasses.fields(old.relay)
                if f.name != "limits" and getattr(old.relay, f.name) != getattr(new.relay, f.name)]
    return changed  # fmt: skip


def keep_restart_only(old: DaemonConfig, new: DaemonConfig) -> DaemonConfig:
    """``new`` with the fields a restart applies left as they run now."""
    tls = dataclasses.replace(new.tls, client_ca=old.tls.client_ca)
    if new.tls.client_ca != old.tls.client_ca:  # the CRLs are the CA's: they follow it
        tls = dataclasses.replace(tls, client_crl=old.tls.client_crl)
    if old.tls.enabled != new.tls.enabled:
        tls = old.tls
    relay = dataclasses.replace(new.relay, limits=old.relay.limits)
    mirror = old.mirror
    if old.mirror is not None or new.mirror is not None:
        relay = old.relay  # a mirror applies none of it; a relay turned mirror keeps its pools
    if (
        old.mirror is not None and new.mirror is not None
        and (old.mirror.tls_ca is None) == (new.mirror.tls_ca is None)
    ):  # fmt: skip
        live = {key: getattr(new.mirror, key) for key in MIRROR_LIVE_KEYS}
        mirror = dataclasses.replace(old.mirror, **live)
    return dataclasses.replace(
        new, bind_host=old.bind_host, bind_port=old.bind_port, event_loop=old.event_loop,
        metrics=old.metrics, tls=tls, workers=old.workers, mirror=mirror,
        runtime_dir=old.runtime_dir, relay=relay,
    )  # fmt: skip


def stage_tls(context: Any, cfg: DaemonConfig) -> Callable[[], None]:
    """Load the certificate, key and client CRLs once into a new context
    (``ReloadableServerContext.stage``) and return what hands it to new handshakes; files that
    do not load raise here, before the reload has changed anything, and leave the live context
    untouched."""
    files = cfg.tls.files
    if context is None or files is None:
        return lambda: None
    use: Callable[[], None] = context.stage(files)
    return use


def stage_upstream_tls(context: Any, cfg: DaemonConfig) -> Callable[[], None]:
    """As ``stage_tls``, for a mirror's upstream client files (``ReloadableClientContext``):
    loaded now, and once put in use read by the mirror's next upstream connection."""
    m = cfg.mirror
    if context is None or m is None or m.tls_ca is None:
        return lambda: None
    use: Callable[[], None] = context.stage(m.tls_ca, m.tls_cert, m.tls_key)
    return use


def read_config(
    path: str | os.PathLike[str], flags: MirrorFlags | None = None
) -> tuple[DaemonConfig | None, list[ConfigProblem]]:
    """The file as ``check-config`` sees it (environment overrides included), or, for
    ``kvrelay mirror``, with its command-line ``flags`` applied again over it as at its start."""
    return check_file(path) if flags is None else mirror_config(path, flags)


# ---- the ``kvrelay reload`` side ---------------------------------------------------------------

#: Series ``kvrelay reload`` watches to learn a reload's outcome, and what waits for a restart.
_RELOADS_SERIES = "kvrelay_config_reloads_total"
_PENDING_SERIES = "kvrelay_config_restart_pending_setting_info"
#: What ``kvrelay upgrade`` reads on the new process's page: it took a hand-over over.
_UPGRADES_SERIES = "kvrelay_upgrades_total"


@dataclass(frozen=True, slots=True)
class ReloadReport:
    """What the relay's ``/metrics`` says of its reloads: outcomes since start, and the settings
    that wait for a restart (``ReloadStats``), read from one page so the two agree."""

    counts: dict[str, int]
    restart_pending: tuple[str, ...]


class EndpointSilent(OSError):
    """The metrics endpoint accepted the connection but sent no whole answer in time: the
    relay's event loop is wedged, or its process is stopped (SIGSTOP). Not a relay whose
    endpoint is off or elsewhere, which refuses the connection."""


#: The most bytes of a ``/metrics`` page read (a relay with many pools serves megabytes).
_PAGE_MAX = 256 << 20


def metrics_page(host: str, port: int, timeout: float) -> str | None:
    """The relay's ``/metrics`` page, or None when nothing accepts a connection there (refused,
    unreachable) or it answers with something else; ``EndpointSilent`` when the connection is
    accepted but the page has not come whole within ``timeout``. Asked directly, over a plain
    socket: an operator's ``http_proxy`` would otherwise take the request to a proxy that cannot
    reach the relay's (loopback) endpoint, and a proxy's failure cannot be told from the
    relay's silence."""
    deadline = time.monotonic() + timeout
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError:
        return None
    chunks: list[bytes] = []
    size = 0
    with sock:
        try:
            sock.sendall(f"GET /metrics HTTP/1.1\r\nHost: {format_bind(host, port)}\r\n"
                         "Connection: close\r\n\r\n".encode())  # fmt: skip
            while size <= _PAGE_MAX:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                sock.settimeout(left)
                data = sock.recv(1 << 16)
                if not data:
                    break
                chunks.append(data)
                size += len(data)
        except TimeoutError:
            raise EndpointSilent(
                f"{format_bind(host, port)} accepted the connection but did not answer within "
                f"{timeout:g} s"
            ) from None
        except OSError:  # reset or closed under us: not an answer, nor a silence
            return None
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    status = head.split(b"\r\n", 1)[0].split()
    if len(status) < 2 or not status[0].startswith(b"HTTP/1.") or status[1] != b"200":
        return None
    return body.decode("utf-8", "replace")


def reload_report(host: str, port: int, timeout: float = 2.0) -> ReloadReport | None:
    """The relay's reload report (None when its ``/metrics`` cannot be read in time)."""
    try:
        page = metrics_page(host, port, timeout)
    except EndpointSilent:
        return None
    return None if page is None else parse_reload_report(page)


def parse_reload_report(text: str) -> ReloadReport | None:
    """The reload report a ``/metrics`` page holds (None: it holds none)."""
    counts: dict[str, int] = {}
    pending: list[str] = []
    for line in text.splitlines():
        if line.startswith(_PENDING_SERIES + "{"):
            pending.append(line.partition('setting="')[2].partition('"')[0])
        if not line.startswith(_RELOADS_SERIES + "{"):
            continue
        labels, _, value = line.rpartition(" ")
        result = labels.partition('result="')[2].partition('"')[0]
        try:
            counts[result] = int(float(value))
        except ValueError:
            continue
    return ReloadReport(counts, tuple(pending)) if counts else None


def upgrades_taken_over(text: str) -> int:
    """``kvrelay_upgrades_total{result="taken_over"}`` on a ``/metrics`` page (0 if absent): at
    least 1 on the page of a process that took a hot upgrade over and serves."""
    for line in text.splitlines():
        if line.startswith(_UPGRADES_SERIES + "{") and 'result="taken_over"' in line:
            try:
                return int(float(line.rpartition(" ")[2]))
            except ValueError:
                return 0
    return 0


#: A pid file holds one decimal PID and a newline; anything longer is not one.
_PID_FILE_MAX = 32


def read_pid_file(path: str | os.PathLike[str]) -> int:
    """The PID ``kvrelay serve --pid-file`` wrote; ValueError when the file is not one (a
    symbolic link is not followed, and at most a few bytes are read)."""
    fd = os.open(path, safe_files.READ_FLAGS)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{os.fspath(path)}: not a regular file")
        raw = os.read(fd, _PID_FILE_MAX + 1)
    finally:
        os.close(fd)
    text = raw.decode("ascii", "replace").strip()
    if len(raw) > _PID_FILE_MAX or not is_decimal(text) or int(text) <= 1:
        raise ValueError(f"{os.fspath(path)}: not a process id: {text[:32]!r}")
    return int(text)


def check_pid_file(path: str | os.PathLike[str]) -> None:
    """Raise what ``write_pid_file`` would for ``path``'s directory (others may write to it,
    it is not one, this user cannot write to it), writing nothing: ``serve`` refuses such a
    ``--pid-file`` before it starts, and writes the file only once its ports proved free."""
    parent = Path(path).parent
    safe_files.check_private_dir(parent, owner=False)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(f"{os.fspath(parent)}: not writable by this user")


def write_pid_file(path: str | os.PathLike[str]) -> None:
    """Write this process's PID atomically (a reader never sees a partial file) through an
    ``O_EXCL|O_NOFOLLOW`` temporary file, in a directory others cannot write to (a sticky one,
    such as ``/tmp``, is allowed: nobody else can rename over the file there)."""
    target = Path(path)
    safe_files.check_private_dir(target.parent, owner=False)
    fd, tmp = safe_files.create_temp(target.parent, target.name, 0o644)
    try:
        safe_files.write_all(fd, f"{os.getpid()}\n".encode())
    except BaseException:
        safe_files.abandon(fd, tmp)
        raise
    safe_files.commit(fd, tmp, target)


def remove_pid_file(path: str | os.PathLike[str]) -> bool:
    """Remove the pid file if it still names this process (another process, e.g. the relay that
    took over in a hot upgrade, may have written its own); a file that cannot be read is left
    alone. True when removed."""
    try:
        if read_pid_file(path) != os.getpid():
            return False
        os.unlink(path)
    except (OSError, ValueError):
        return False
    return True
