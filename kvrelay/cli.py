"""Command-line entry point (``kvrelay`` and ``python -m kvrelay``).

Heavy modules (numba kernels, grpclib, numpy, the SDK) are imported inside the commands, and
``sim`` / ``watch`` / ``subscribe`` / ``query`` are handed to their own parsers by name: ``--help``
and ``--version`` import nothing but argparse, and ``NUMBA_CACHE_DIR`` can be set before numba is
first imported.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, TextIO

from kvrelay import SUPPORTED_DYNAMO, SUPPORTED_VLLM, __version__
from kvrelay._argparse import StrictSubcommand

if TYPE_CHECKING:
    from kvrelay.ops.config import ConfigProblem
    from kvrelay.ops.target import RelayProcess

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
#: Ctrl-C in a command that is not a daemon (``warm``, ``reload``, ``upgrade``): 128 + SIGINT.
EXIT_INTERRUPTED = 130
#: Seconds ``kvrelay upgrade`` waits for the relay to start its successor (it does so at once
#: when it takes the upgrade on) before it reports the upgrade refused (half ``--timeout`` if
#: less).
UPGRADE_SPAWN_S = 10.0
#: Commands for which SIGINT and SIGTERM mean "stop": ``serve``/``mirror`` exit 0 on them, even
#: before the daemon has installed its own handlers (operations.md: a signal during start-up
#: exits 0), and keep SIGHUP, SIGUSR1 and SIGUSR2 for the daemon from their first line on.
DAEMON_COMMANDS = frozenset({"serve", "mirror"})

#: Commands parsed by their own module (imported only when used).
SIM_COMMAND = "sim"
CLIENT_COMMANDS: dict[str, str] = {
    "watch": "print a relay's catalog, readiness or load",
    "subscribe": "inspect (--verify: check) one pool's stream",
    "query": "cached prefix depth of a prompt per pool",
}

EPILOG = """\
examples:
  kvrelay example-config > /etc/kvrelay/kvrelay.toml     # then edit it
  kvrelay check-config /etc/kvrelay/kvrelay.toml
  kvrelay systemd-unit > /etc/systemd/system/kvrelay.service
  kvrelay warm                      # compile/load the numba kernels once, with progress
  kvrelay serve --config /etc/kvrelay/kvrelay.toml
  kvrelay reload --config /etc/kvrelay/kvrelay.toml --pid-file /run/kvrelay.pid   # live
  KVRELAY_RELAY_WORKERS=2 kvrelay serve --config kvrelay.toml   # ingest + 1 fan-out worker
  kvrelay mirror --upstream relay.dc-a:50161 --bind 0.0.0.0:50161 --config mirror.toml
  KVRELAY_RELAY_BIND=127.0.0.1:6000 kvrelay serve --config kvrelay.toml
  kvrelay demo                      # relay + simulated fleet + live view, ~30 s
  kvrelay demo --headless --duration 10
  kvrelay sim --engines 2 --dp-size 2
  kvrelay watch catalog             # --relay defaults to $KVRELAY_RELAY, else 127.0.0.1:50161
  kvrelay subscribe dynamo/backend/generate --verify --count 20
  kvrelay query --model meta/llama --tokens 1,2,3,4 --relay 10.0.0.5:50161 --json

exit codes:
  0  success (serve: clean shutdown after SIGTERM/SIGINT)
  1  runtime failure (cannot bind, TLS files unusable, shutdown slower than the bound;
     reload: rejected, no outcome, a wedged relay; upgrade: no hand-over)
  2  usage or configuration error (every problem is printed with its key path; reload,
     upgrade: the pid is not a kvrelay daemon, reload: --config is not the relay's file)
  130  interrupted by Ctrl-C (warm, reload, upgrade, query)
  141  watch, subscribe, query, demo: stdout's reader went away (| head -1)

environment:
  KVRELAY_<SECTION>_<KEY>  override a scalar key of [relay], [relay.limits], [logging],
                           [metrics], [tls] or [mirror], e.g. KVRELAY_LOGGING_LEVEL=debug
  KVRELAY_CONFIG           default for serve --config and reload --config
  NOTIFY_SOCKET, WATCHDOG_USEC  systemd notification (READY/RELOADING/WATCHDOG/STOPPING)
  CACHE_DIRECTORY          numba kernel cache goes to $CACHE_DIRECTORY/numba (systemd)
  KVRELAY_RELAY            default --relay of watch/subscribe/query
  DYN_CLUSTER_ID, DYN_DC_ID  dc_name (first found) when neither the file nor
                           KVRELAY_RELAY_DC_NAME sets it (Dynamo 1.7's, then 1.6's)

docs: docs/operations.md, docs/vllm.md (connecting vLLM), docs/dynamo.md
"""


def _seconds(text: str) -> float:
    """``--timeout``: a finite number of seconds > 0. NaN or a negative value would otherwise
    make ``reload``/``upgrade`` signal the relay and then report a failure at once."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


class _Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=36, width=100)


def build_parser(env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """``env``: where ``KVRELAY_CONFIG`` (the default ``--config``) is read (this process's
    environment; ``kvrelay reload``/``upgrade`` parse a relay's command line with its own)."""
    env = os.environ if env is None else env
    parser = argparse.ArgumentParser(
        prog="kvrelay",
        description=(
            "kvrelay: Dynamo's dynamo.kvrelay.v1.KvEventRelay for vLLM fleets.\n"
            "Ingests vLLM KV-cache events over ZMQ, keeps exact per-engine block ownership and\n"
            "serves cuckoo-filter streams, readiness and load to Dynamo routers over gRPC."
        ),
        epilog=EPILOG,
        formatter_class=_Formatter,
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"kvrelay {__version__} (vLLM {SUPPORTED_VLLM}; {SUPPORTED_DYNAMO})",
    )
    sub = parser.add_subparsers(
        dest="command", metavar="COMMAND", title="commands", parser_class=StrictSubcommand
    )

    serve = sub.add_parser(
        "serve",
        help="run the relay daemon",
        description=(
            "Run the relay: discover engines, ingest their KV events, serve gRPC until\n"
            "SIGTERM/SIGINT. Refuses to start on an invalid configuration (exit 2)."
        ),
        epilog="example:\n  kvrelay serve --config /etc/kvrelay/kvrelay.toml",
        formatter_class=_Formatter,
    )
    serve.add_argument(
        "--config",
        "-c",
        metavar="FILE",
        default=env.get("KVRELAY_CONFIG"),
        help="TOML configuration file (default: $KVRELAY_CONFIG)",
    )

    serve.add_argument(
        "--pid-file",
        metavar="FILE",
        default=None,
        help="write the daemon's PID here (for 'kvrelay reload --pid-file'); removed on exit",
    )

    reload = sub.add_parser(
        "reload",
        help="validate the configuration, then make the running relay reload it (SIGHUP)",
        description=(
            "Validate FILE like check-config (nothing is signalled when it has errors), send\n"
            "SIGHUP to the running relay, and wait for the outcome on its metrics endpoint.\n"
            "Pools and engines change live; unchanged pools keep their generation, so routers\n"
            "do not re-snapshot. FILE must be the file the relay reads (its --config), and the\n"
            "pid a kvrelay daemon: otherwise nothing is signalled. Exit 0 when applied (or sent,\n"
            "when the file's metrics endpoint is off or refuses: the outcome is in its log), 1\n"
            "when the relay rejected or failed it (see its log), gave no outcome, or its metrics\n"
            "endpoint accepts but does not answer (wedged or stopped: not signalled), 2 on an\n"
            "invalid file, another file than the relay's, a pid that is not kvrelay, or a usage\n"
            "error."
        ),
        epilog=(
            "examples:\n  kvrelay reload --config /etc/kvrelay/kvrelay.toml --pid-file "
            "/run/kvrelay.pid\n  systemctl reload kvrelay   # ExecReload= runs kvrelay reload"
        ),
        formatter_class=_Formatter,
    )
    reload.add_argument(
        "--config",
        "-c",
        metavar="FILE",
        default=env.get("KVRELAY_CONFIG"),
        help="the relay's TOML configuration file (default: $KVRELAY_CONFIG)",
    )
    who = reload.add_mutually_exclusive_group(required=True)
    who.add_argument("--pid", type=int, metavar="PID", help="the relay's process id")
    who.add_argument("--pid-file", metavar="FILE", help="file written by 'serve --pid-file'")
    reload.add_argument(
        "--timeout",
        type=_seconds,
        default=30.0,
        metavar="SECONDS",
        help="how long to wait for the outcome (default: 30)",
    )

    upgrade = sub.add_parser(
        "upgrade",
        help="hot-upgrade the running relay (SIGUSR2): a new process takes over, no ingest gap",
        description=(
            "Send SIGUSR2 to the running relay: it starts its own command line again (the code\n"
            "and configuration now installed), hands the new process its listeners and its\n"
            "exact state, and exits once the new process serves. Waits for that. Exit 0 when\n"
            "the old process is gone and a new one took over (the pid file names it; its\n"
            "metrics endpoint, if any, answers), 1 when the old one still serves after --timeout\n"
            "(a failed upgrade: see its log, upgrade_failed) or exited without a hand-over, 2\n"
            "on a usage error or a pid that is not a kvrelay daemon (nothing is signalled)."
        ),
        epilog=(
            "examples:\n  kvrelay upgrade --pid-file /run/kvrelay.pid\n"
            "  systemctl kill --kill-who=main --signal=SIGUSR2 kvrelay   # under systemd"
        ),
        formatter_class=_Formatter,
    )
    whom = upgrade.add_mutually_exclusive_group(required=True)
    whom.add_argument("--pid", type=int, metavar="PID", help="the relay's process id")
    whom.add_argument("--pid-file", metavar="FILE", help="file written by 'serve --pid-file'")
    upgrade.add_argument(
        "--timeout",
        type=_seconds,
        default=120.0,
        metavar="SECONDS",
        help="how long to wait for the old process to hand over (default: 120)",
    )

    mirror = sub.add_parser(
        "mirror",
        help="serve another relay's contract (kvrelay's or Dynamo's) from a mirror of it",
        description=(
            "Mirror an upstream KvEventRelay and re-serve it: same identities, sequences and\n"
            "CBI1 bytes, with this process's own limits for its own subscribers. Options\n"
            "override the [mirror] upstream, [relay] bind and workers, and [metrics] bind of\n"
            "--config and their KVRELAY_* variables (TLS both ways, limits and logging come\n"
            "from the file)."
        ),
        epilog=(
            "examples:\n  kvrelay mirror --upstream 10.0.0.5:50161 --bind 127.0.0.1:50171\n"
            "  kvrelay mirror --config /etc/kvrelay/mirror.toml"
        ),
        formatter_class=_Formatter,
    )
    mirror.add_argument("--upstream", metavar="HOST:PORT", help="upstream relay (or unix:/path)")
    mirror.add_argument("--bind", metavar="HOST:PORT", help="gRPC address of the mirror")
    mirror.add_argument(
        "--metrics-bind", metavar="HOST:PORT|off", help="Prometheus endpoint (or off)"
    )
    mirror.add_argument("--workers", metavar="N", type=int, help="processes serving gRPC")
    mirror.add_argument("--config", "-c", metavar="FILE", help="TOML file with a [mirror] section")

    check = sub.add_parser(
        "check-config",
        help="validate a configuration file and print every problem",
        description=(
            "Validate FILE (with KVRELAY_* overrides applied) without starting anything.\n"
            "Prints every problem as 'error|warning: key.path: reason'; exit 2 on errors,\n"
            "0 with a one-line summary when the file is valid."
        ),
        epilog="example:\n  kvrelay check-config deploy/kvrelay.example.toml",
        formatter_class=_Formatter,
    )
    check.add_argument("file", metavar="FILE", help="TOML configuration file")

    sub.add_parser(
        "example-config",
        help="print the commented example configuration",
        description="Print the commented example TOML, e.g. to start /etc/kvrelay/kvrelay.toml.",
        epilog="example:\n  kvrelay example-config > /etc/kvrelay/kvrelay.toml",
        formatter_class=_Formatter,
    )
    unit = sub.add_parser(
        "systemd-unit",
        help="print the systemd unit (--template: kvrelay@.service)",
        description=(
            "Print kvrelay.service (one relay per host) or, with --template, kvrelay@.service\n"
            "(one relay per shard, config /etc/kvrelay/<shard>.toml). Both expect kvrelay in\n"
            "/opt/kvrelay/venv; see deploy/README.md."
        ),
        epilog=(
            "examples:\n  kvrelay systemd-unit > /etc/systemd/system/kvrelay.service\n"
            "  kvrelay systemd-unit --template > /etc/systemd/system/kvrelay@.service"
        ),
        formatter_class=_Formatter,
    )
    unit.add_argument("--template", action="store_true", help="the kvrelay@.service template")
    sub.add_parser(
        "warm",
        help="compile or load every numba kernel, with progress",
        description=(
            "Compile every numba kernel the relay uses, or load it from the kernel cache\n"
            "(NUMBA_CACHE_DIR, else $CACHE_DIRECTORY/numba under systemd, else next to the\n"
            "modules). The first run after an install takes about 22 s on 2 quiet cores\n"
            "(23-45 s measured on 2 busy ones); 'serve' then starts in seconds. Exit 0\n"
            "when every kernel is ready."
        ),
        epilog="example:\n  NUMBA_CACHE_DIR=/var/cache/kvrelay/numba kvrelay warm",
        formatter_class=_Formatter,
    )
    sub.add_parser(
        SIM_COMMAND,
        help="run simulated vLLM engines (see 'kvrelay sim --help')",
        add_help=False,
        description="Simulated vLLM engines emitting KV events; 'kvrelay sim --help' for options.",
    )

    demo = sub.add_parser(
        "demo",
        help="relay + simulated fleet + consumer with a live terminal view",
        description=(
            "Start an embedded fleet on loopback (an aggregated pool of 2 engines x 2 DP ranks,\n"
            "a prefill/decode pair, a LoRA adapter), the relay and its gRPC server, drive\n"
            "traffic and subscribe a consumer to every pool. Shows a live view refreshed each\n"
            "second, then a summary."
        ),
        epilog="examples:\n  kvrelay demo\n  kvrelay demo --headless --duration 5",
        formatter_class=_Formatter,
    )
    demo.add_argument(
        "--headless", action="store_true", help="no live view; print one JSON summary line"
    )
    demo.add_argument(
        "--bind",
        metavar="HOST:PORT",
        default="127.0.0.1:0",
        help="gRPC address of the relay (default: 127.0.0.1 with an ephemeral port)",
    )
    demo.add_argument(
        "--workers",
        metavar="N",
        type=int,
        default=1,
        help="processes serving gRPC: the relay plus N-1 fan-out workers (default: 1)",
    )
    demo.add_argument(
        "--duration",
        metavar="SECONDS",
        type=float,
        default=30.0,
        help="run time before the summary (default: 30; Ctrl-C ends earlier)",
    )

    for name, text in CLIENT_COMMANDS.items():  # the SDK's inspection commands (own parser)
        sub.add_parser(name, help=text, add_help=False)
    return parser


#: syslog priorities of the lines below when they go to systemd's journal (sd-daemon(3)).
_ERR, _WARNING = 3, 4


def _journal_prefix(out: TextIO, priority: int) -> str:
    """``<N>`` when ``out`` is systemd's journal stream, as the daemon's log lines have: journald
    stores the line at that priority, so ``journalctl -p err`` shows why a start was refused (an
    unprefixed line is stored as info). Empty otherwise."""
    from kvrelay.logging import writes_to_journal

    return f"<{priority}>" if writes_to_journal(out) else ""


def _fail(text: str, out: TextIO | None = None) -> None:
    """One line saying why a command failed, at error priority in the journal."""
    out = sys.stderr if out is None else out
    print(_journal_prefix(out, _ERR) + text, file=out)


def print_problems(problems: Sequence[ConfigProblem], out: TextIO) -> None:
    if not problems:
        return
    err, warn = _journal_prefix(out, _ERR), _journal_prefix(out, _WARNING)
    for p in problems:
        print((err if p.severity == "error" else warn) + str(p), file=out)


def _numba_cache_from_systemd() -> None:
    """Pick numba's kernel cache directory before numba is imported (``ops/kernelcache.py``):
    ``NUMBA_CACHE_DIR``, else systemd's ``CacheDirectory=``, else numba's default if writable."""
    from kvrelay.ops import kernelcache

    kernelcache.configure()


def _check_config(path: str) -> int:
    from kvrelay.ops.config import check_file

    cfg, problems = check_file(path)
    print_problems(problems, sys.stdout)
    if cfg is None:
        n = sum(1 for p in problems if p.severity == "error")
        _fail(f"{path}: {n} error(s); the relay would refuse to start", sys.stdout)
        return EXIT_USAGE
    print(f"{path}: ok: {cfg.summary()}", file=sys.stdout)
    return EXIT_OK


def _print_asset(name: str) -> int:
    from kvrelay.ops.files import asset_text

    sys.stdout.write(asset_text(name))
    return EXIT_OK


def _warm() -> int:
    from kvrelay.ops import kernelcache

    cache = kernelcache.chosen() or kernelcache.configure()
    note = "" if cache.persistent else " (temporary: set NUMBA_CACHE_DIR to keep it)"
    if cache.unusable:
        note += f" ({cache.unusable} is not writable)"
    print(f"kvrelay warm: numba kernel cache: {cache.path} ({cache.source}){note}", flush=True)
    print("kvrelay warm: compiling or loading kernels (first run after an install: ~22 s on 2 "
          "quiet cores, up to ~75 s on busy ones)", flush=True)
    from kvrelay.ops.warmup import warm_kernels

    try:
        seconds = warm_kernels(progress=lambda ev: print(f"  {ev}", flush=True))
    except Exception as exc:
        _fail(f"kvrelay warm: failed: {type(exc).__name__}: {exc}")
        return EXIT_FAILURE
    print(f"kvrelay warm: every kernel ready in {seconds:.1f} s", flush=True)
    return EXIT_OK


def _relay_target(verb: str, pid: int) -> tuple[RelayProcess | None, int]:
    """The kvrelay daemon ``pid`` runs, checked before anything is signalled: a stale pid file
    names whatever the system gave that pid to since (SIGHUP and SIGUSR2 end most processes),
    and was then reported as reloaded or handed over. (None, exit code) when it is not one."""
    from kvrelay.ops.target import NotARelay, relay_process

    try:
        return relay_process(pid), EXIT_OK
    except ProcessLookupError:
        _fail(f"kvrelay {verb}: no process {pid} (a stale pid file?); nothing was signalled")
        return None, EXIT_FAILURE
    except NotARelay as exc:
        _fail(f"kvrelay {verb}: {exc}; refusing to signal it (a stale pid file, or the "
              "wrong --pid?)")  # fmt: skip
        return None, EXIT_USAGE


def _daemon_options(proc: RelayProcess) -> argparse.Namespace | None:
    """The target's own options, parsed as it parsed them (``--config`` defaults to its own
    ``KVRELAY_CONFIG``); None when they do not parse here (another kvrelay version's)."""
    parser = build_parser(env=proc.environ or {})
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            return parser.parse_args(list(proc.args))
        except SystemExit:
            return None


def _other_config(proc: RelayProcess, path: str) -> tuple[str, int] | None:
    """Why ``path`` is not the file a SIGHUP makes ``proc`` read again (it reads its own
    ``--config``, whatever ``kvrelay reload --config`` checked), with the exit code; None when
    it is that file."""
    opts = _daemon_options(proc)
    theirs = None if opts is None else opts.config
    if not theirs:
        # a mirror's --config has no default; a relay's is its KVRELAY_CONFIG, if readable
        if opts is not None and (proc.command == "mirror" or proc.environ is not None):
            return (f"process {proc.pid} was started without a configuration file: a SIGHUP "
                    "has no file to read again (config_reload_unavailable); restart it "
                    "instead", EXIT_USAGE)  # fmt: skip
        return (f"cannot tell which configuration file process {proc.pid} reads (its "
                "command line or environment is not readable)", EXIT_FAILURE)  # fmt: skip
    where = proc.resolve(theirs)
    if where is None:
        return (f"cannot tell which file process {proc.pid} reads: its --config {theirs!r} is "
                "relative and its working directory is not readable", EXIT_FAILURE)  # fmt: skip
    try:
        same = os.path.samefile(path, where)
    except OSError:
        same = False
    if same:
        return None
    shown = proc.absolute(theirs) or theirs
    return (f"{path} is not the file process {proc.pid} reads ({shown}): a SIGHUP makes it "
            f"read its own file again, so checking {path} says nothing of what it applies. "
            f"Edit that file and run kvrelay reload --config {shown}", EXIT_USAGE)  # fmt: skip


def _reload(args: argparse.Namespace) -> int:
    import signal
    import time

    from kvrelay.ops.config import check_file, format_bind
    from kvrelay.ops.reload import (
        EndpointSilent,
        metrics_page,
        parse_reload_report,
        read_pid_file,
        reload_report,
    )

    path = args.config
    if not path:
        _fail("kvrelay reload: --config FILE is required (or set KVRELAY_CONFIG)")
        return EXIT_USAGE
    cfg, problems = check_file(path)
    print_problems(problems, sys.stderr)
    if cfg is None:
        _fail(f"kvrelay reload: {path} is invalid; the relay was not signalled")
        return EXIT_USAGE
    try:
        pid = args.pid if args.pid is not None else read_pid_file(args.pid_file)
    except (OSError, ValueError) as exc:
        _fail(f"kvrelay reload: {exc}")
        return EXIT_USAGE
    proc, code = _relay_target("reload", pid)
    if proc is None:
        return code
    other = _other_config(proc, path)
    if other is not None:
        _fail(f"kvrelay reload: {other[0]}; it was not signalled")
        return other[1]
    metrics = cfg.metrics
    where = format_bind(metrics.host, metrics.port) if metrics.enabled else "disabled"
    before = None
    if metrics.enabled:
        try:
            page = metrics_page(metrics.host, metrics.port, args.timeout)
        except EndpointSilent:
            _fail(f"kvrelay reload: the relay's metrics endpoint ({where}) accepted the "
                  f"connection but did not answer within {args.timeout:g} s: the relay is "
                  f"wedged or stopped (SIGSTOP?); process {pid} was not signalled")  # fmt: skip
            return EXIT_FAILURE
        before = None if page is None else parse_reload_report(page)
    try:
        os.kill(pid, signal.SIGHUP)
    except OSError as exc:
        _fail(f"kvrelay reload: cannot signal process {pid}: {exc}")
        return EXIT_FAILURE
    if before is None:
        print(f"kvrelay reload: SIGHUP sent to {pid}; the file's metrics endpoint ({where}) is "
              "not readable (a changed [metrics] bind takes effect at the next restart), so the "
              "outcome is in its log (config_reloaded / config_reload_rejected)")
        return EXIT_OK
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        time.sleep(0.1)
        report = reload_report(metrics.host, metrics.port)
        if report is None:
            continue
        for result in ("applied", "rejected", "failed"):
            if report.counts.get(result, 0) > before.counts.get(result, 0):
                if result == "applied":  # all it could: what waits for a restart is named
                    pending = ", ".join(report.restart_pending)
                    print("kvrelay reload: applied" + (
                        f"; these settings take effect at the next restart: {pending}"
                        if pending else ""))  # fmt: skip
                    return EXIT_OK
                _fail(f"kvrelay reload: {result}; see the relay's log")
                return EXIT_FAILURE
    _fail(f"kvrelay reload: no outcome after {args.timeout:g} s; see the relay's log")
    return EXIT_FAILURE


#: After the old process exited, how long ``kvrelay upgrade`` gives the new one's metrics
#: endpoint to answer (it serves before the old one exits: this covers a busy loop).
UPGRADE_CONFIRM_S = 10.0


def _metrics_endpoint(
    proc: RelayProcess, opts: argparse.Namespace | None
) -> tuple[str, int] | None:
    """The metrics endpoint ``proc`` serves (a hot upgrade's new process inherits its
    listener): its configuration file and options read as it read them, with its environment's
    ``KVRELAY_*`` when readable. None when disabled or not known."""
    from kvrelay.ops.config import MirrorFlags, check_file, mirror_config

    if opts is None:
        return None
    path = None if not opts.config else proc.resolve(opts.config)
    env = os.environ if proc.environ is None else proc.environ
    with contextlib.suppress(OSError, ValueError):
        if proc.command == "mirror":
            flags = MirrorFlags(opts.upstream, opts.bind, opts.workers, opts.metrics_bind)
            cfg, _ = mirror_config(path, flags, env=env)
        elif path is not None:
            cfg, _ = check_file(path, env=env)
        else:
            return None
        if cfg is not None and cfg.metrics.enabled:
            return cfg.metrics.host, cfg.metrics.port
    return None


def _upgrade(args: argparse.Namespace) -> int:
    import signal
    import time

    from kvrelay.ops.reload import read_pid_file
    from kvrelay.ops.target import NotARelay, alive, children, relay_process

    try:
        pid = args.pid if args.pid is not None else read_pid_file(args.pid_file)
    except (OSError, ValueError) as exc:
        _fail(f"kvrelay upgrade: {exc}")
        return EXIT_USAGE
    proc, code = _relay_target("upgrade", pid)
    if proc is None:
        return code
    opts = _daemon_options(proc)
    pid_file = args.pid_file
    own = None if opts is None else getattr(opts, "pid_file", None)
    if pid_file is None and own:  # the file its successor rewrites, as the relay names it
        pid_file = proc.absolute(own)
    endpoint = _metrics_endpoint(proc, opts)
    try:
        os.kill(pid, signal.SIGUSR2)
    except OSError as exc:
        _fail(f"kvrelay upgrade: cannot signal process {pid}: {exc}")
        return EXIT_FAILURE
    started = time.monotonic()
    deadline = started + args.timeout
    spawn_s = min(UPGRADE_SPAWN_S, args.timeout / 2)
    spawned: set[int] = set()  # kvrelay daemons it started: its successor among them
    looked: set[int] = set()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        if alive(pid):
            for child in children(pid) - looked:
                looked.add(child)
                with contextlib.suppress(OSError, NotARelay):  # a worker, a fork's child
                    spawned.add(relay_process(child).pid)
            if not spawned and time.monotonic() - started > spawn_s:
                # an upgrade it takes on starts its successor at once: none came
                _fail(f"kvrelay upgrade: process {pid} started no successor within "
                      f"{spawn_s:g} s: it refused the upgrade (still starting or stopping, or "
                      "one already under way) or failed before one (see its log: "
                      "upgrade_refused, upgrade_failed)")  # fmt: skip
                return EXIT_FAILURE
            continue
        return _upgrade_outcome(pid, pid_file, spawned, endpoint)
    _fail(f"kvrelay upgrade: process {pid} still serves after {args.timeout:g} s; the upgrade "
          "failed or is still warming up (see its log: upgrade_failed)")
    return EXIT_FAILURE


def _upgrade_outcome(
    old: int, pid_file: str | None, spawned: set[int], endpoint: tuple[str, int] | None
) -> int:
    """The old process ``old`` exited: exit 0 only if a new kvrelay process took over and
    serves. The old one leaves when its successor serves, but also when it is killed
    mid-upgrade (SIGKILL, the OOM killer), and a successor that has not taken over then gives
    up: "handed over" was printed for that too, with the dead pid the pid file still named."""
    import time

    from kvrelay.ops.config import format_bind
    from kvrelay.ops.reload import EndpointSilent, metrics_page, read_pid_file, upgrades_taken_over
    from kvrelay.ops.target import NotARelay, relay_process

    until = time.monotonic() + UPGRADE_CONFIRM_S
    gone = f"kvrelay upgrade: the relay exited without a hand-over: process {old} is gone"
    if pid_file is not None:
        try:
            new: int | None = read_pid_file(pid_file)
        except (OSError, ValueError):
            new = None
        if new is None or new == old:
            named = "no process" if new is None else "the old process still"
            _fail(f"{gone} and its pid file {pid_file} names {named}: no new process took over "
                  "(see its log: upgrade_failed, or how it ended)")  # fmt: skip
            return EXIT_FAILURE
        try:
            relay_process(new)
        except (ProcessLookupError, NotARelay):
            _fail(f"{gone} and pid {new}, which its pid file {pid_file} names, is not a running "
                  "kvrelay (see the log: upgrade_took_over, upgrade_failed)")  # fmt: skip
            return EXIT_FAILURE
        if endpoint is not None:  # refused: the file's bind moved (the listener is inherited)
            try:
                metrics_page(*endpoint, max(0.1, until - time.monotonic()))
            except EndpointSilent:
                _fail(f"kvrelay upgrade: process {new} took over (pid file {pid_file}) but its "
                      f"metrics endpoint ({format_bind(*endpoint)}) accepted the connection "
                      f"and did not answer within {UPGRADE_CONFIRM_S:g} s: it is wedged or "
                      "stopped")  # fmt: skip
                return EXIT_FAILURE
        print(f"kvrelay upgrade: handed over to pid {new}")
        return EXIT_OK
    if endpoint is None:
        _fail(f"kvrelay upgrade: process {old} exited; with no pid file and no metrics endpoint "
              "nothing tells whether a new process took over (its log does: "
              "upgrade_took_over). Start the relay with --pid-file")  # fmt: skip
        return EXIT_FAILURE
    while True:  # the new process's page, on the inherited listener, says it took over
        page = None
        with contextlib.suppress(EndpointSilent):
            page = metrics_page(*endpoint, max(0.1, min(2.0, until - time.monotonic())))
        if page is not None and upgrades_taken_over(page) > 0:
            living = [p for p in spawned if _is_relay(p)]
            print("kvrelay upgrade: handed over" + (
                f" to pid {living[0]}" if len(living) == 1 else ""))  # fmt: skip
            return EXIT_OK
        if time.monotonic() >= until:
            _fail(f"{gone} and no process that took over answers on its metrics endpoint "
                  f"({format_bind(*endpoint)}) (see its log: upgrade_failed, or how it ended)")
            return EXIT_FAILURE
        time.sleep(0.1)


def _is_relay(pid: int) -> bool:
    from kvrelay.ops.target import NotARelay, relay_process

    try:
        relay_process(pid)
    except (ProcessLookupError, NotARelay):
        return False
    return True


def _serve(path: str | None, pid_file: str | None = None) -> int:
    if not path:
        _fail("kvrelay serve: --config FILE is required (or set KVRELAY_CONFIG)")
        return EXIT_USAGE
    from kvrelay.ops.config import check_file

    cfg, problems = check_file(path)
    if cfg is None:
        print_problems(problems, sys.stderr)
        _fail(f"kvrelay serve: refusing to start: invalid configuration {path}")
        return EXIT_USAGE
    from kvrelay.ops.daemon import run

    if pid_file is None:
        return run(cfg, config_path=path)
    from kvrelay.ops.reload import check_pid_file, remove_pid_file
    from kvrelay.ops.upgrade import ENV as TAKEOVER_ENV
    from kvrelay.relay.safe_files import UnsafeDirectory

    if not os.environ.get(TAKEOVER_ENV):  # written once the ports proved free (Daemon._start)
        try:
            check_pid_file(pid_file)
        except (OSError, UnsafeDirectory) as exc:
            _fail(f"kvrelay serve: cannot write --pid-file {pid_file}: {exc}")
            return EXIT_USAGE
    try:
        return run(cfg, config_path=path, pid_file=pid_file)
    finally:
        remove_pid_file(pid_file)


def _mirror(args: argparse.Namespace) -> int:
    from kvrelay.ops.config import MirrorFlags, mirror_config

    flags = MirrorFlags(args.upstream, args.bind, args.workers, args.metrics_bind)
    cfg, problems = mirror_config(args.config or None, flags)
    if cfg is None:
        print_problems(problems, sys.stderr)
        _fail("kvrelay mirror: refusing to start: invalid configuration")
        return EXIT_USAGE
    from kvrelay.ops.daemon import run

    if not args.config:  # flags alone: no file a reload could read
        return run(cfg)
    return run(cfg, config_path=args.config, mirror_flags=flags)


def _demo(args: argparse.Namespace) -> int:
    from kvrelay.ops.config import parse_bind

    try:
        host, port = parse_bind(args.bind)
    except ValueError as exc:
        print(f"kvrelay demo: --bind: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if not 0 < args.duration <= 24 * 3600:
        print("kvrelay demo: --duration must be in (0, 86400]", file=sys.stderr)
        return EXIT_USAGE
    if not 1 <= args.workers <= 64:
        print("kvrelay demo: --workers must be in 1..64", file=sys.stderr)
        return EXIT_USAGE
    from kvrelay.demo import run_demo

    return run_demo(
        host=host, port=port, duration=args.duration, headless=args.headless,
        workers=args.workers,
    )  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in DAEMON_COMMANDS:  # first, before the imports (ops/early_signals.py)
        from kvrelay.ops import early_signals

        early_signals.hold()
    if argv and argv[0] == SIM_COMMAND:
        from kvrelay.sim.cli import main as sim_main

        return sim_main(argv[1:])
    if argv and argv[0] in CLIENT_COMMANDS:
        from kvrelay.client.cli import main as client_main
        from kvrelay.logging import configure

        configure(level="WARNING", stream=sys.stderr)  # keep stdout (tables, --json) clean
        return client_main(argv, prog="kvrelay")
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: 0 for --help/--version, 2 for usage errors
        return int(exc.code or 0)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return _dispatch(parser, args)
    except KeyboardInterrupt:  # Ctrl-C before a daemon's handlers, or in a waiting command
        print(file=sys.stderr)  # end the terminal's "^C" line; no traceback
        return EXIT_OK if args.command in DAEMON_COMMANDS else EXIT_INTERRUPTED


#: Commands that never import a kernel: no kernel cache to choose.
_NO_KERNELS = ("example-config", "systemd-unit")


def _dispatch(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.command not in _NO_KERNELS:
        # every other command may import kernels (``check-config`` and ``reload`` read the
        # configuration through modules that hold some): numba refuses to import one without
        # a writable cache directory (a read-only root), with a traceback
        from kvrelay.ops.kernelcache import NoKernelCache

        try:
            _numba_cache_from_systemd()
        except NoKernelCache as exc:
            _fail(f"kvrelay {args.command}: {exc}")
            return EXIT_FAILURE
    if args.command == "check-config":
        return _check_config(args.file)
    if args.command == "serve":
        return _serve(args.config, args.pid_file)
    if args.command == "reload":
        return _reload(args)
    if args.command == "upgrade":
        return _upgrade(args)
    if args.command == "demo":
        return _demo(args)
    if args.command == "example-config":
        return _print_asset("kvrelay.example.toml")
    if args.command == "systemd-unit":
        return _print_asset("kvrelay@.service" if args.template else "kvrelay.service")
    if args.command == "warm":
        return _warm()
    if args.command == "mirror":
        return _mirror(args)
    parser.error(f"unknown command {args.command!r}")  # pragma: no cover - argparse rejects first
    return EXIT_USAGE  # pragma: no cover - parser.error exits


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
