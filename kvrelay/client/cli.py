"""``kvrelay-client``: watch planes, inspect a pool stream, query cached prefix depth.

Mountable: ``add_subcommands(subparsers)`` adds ``watch``, ``subscribe`` and ``query`` to any
argparse subparsers object and ``run(args)`` executes the parsed result; ``main(argv)`` is the
standalone entry (``python -m kvrelay.client``). Tables for people, ``--json`` for scripts (one
JSON object per line). Exit codes: 0 ok, 1 runtime failure (violations, stream errors, no pool),
2 usage error, 130 ``query`` interrupted (Ctrl-C), 141 stdout's reader gone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import re
import signal
import ssl as _ssl
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from kvrelay._aio import cancel_and_wait, stop_all
from kvrelay._argparse import StrictSubcommand
from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.client import errors as E
from kvrelay.client import rpc
from kvrelay.client import stream_rules as rules
from kvrelay.client.client import RelayClient, role_name
from kvrelay.client.config import ClientConfig
from kvrelay.client.errors import ConsumerViolation
from kvrelay.client.replica import FrameInfo, PoolReplica, occupancy
from kvrelay.contract.errors import RelayError
from kvrelay.contract.producer import producer_key
from kvrelay.publication import cbi1

_KINDS = {1: "SNAPSHOT_CHUNK", 2: "DELTA", 3: "HEARTBEAT"}
#: What an empty catalog means, printed under it (people read "0 pool(s)" as "relay broken").
NO_POOL_HINT = (
    "  (a pool is listed once one of its engines is reachable and its KV event stream is live: "
    "with every engine unreachable the catalog is empty. Check the relay's engine_unreachable "
    "log lines and the kvrelay_engine_reachable metric)"
)
_STATES = {0: "UNKNOWN", 1: "UNAVAILABLE", 2: "READY"}
_FORMATS = {1: "STANDARD", 2: "EAGLE"}


#: kvrelay's own gRPC port on loopback: what ``--relay`` means when neither it nor the
#: ``KVRELAY_RELAY`` variable is given.
DEFAULT_RELAY = "127.0.0.1:50161"
RELAY_ENV = "KVRELAY_RELAY"


class UsageError(ValueError):
    """Bad command-line input (exit code 2)."""


class OutputClosed(Exception):
    """stdout's reader went away (``| head -1``). Not an ``OSError``: it must not pass for a
    relay connection's error, and it must stop every stream, not reopen one."""


#: stdout's reader went away: the status of a tool that SIGPIPE ended (128 + 13), quietly.
EXIT_BROKEN_PIPE = 141
#: Ctrl-C while ``query`` waits (its result is not printed): 128 + SIGINT.
EXIT_INTERRUPTED = 130


# ------------------------------------------------------------------------------- argparse


def _common() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--relay", action="append", default=None, metavar="HOST:PORT",
                   help=f"relay address (repeatable; default: ${RELAY_ENV}, comma-separated, "
                        f"else {DEFAULT_RELAY})")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument("--count", type=int, default=None, help="stop after N updates/frames")
    p.add_argument("--duration", type=float, default=None, help="stop after S seconds")
    p.add_argument("--tls", action="store_true", help="connect with TLS (system CAs)")
    p.add_argument("--ca", type=Path, default=None, help="CA bundle for --tls")
    p.add_argument("--cert", type=Path, default=None,
                   help="client certificate chain (PEM) for mutual TLS; implies --tls")
    p.add_argument("--key", type=Path, default=None, help="private key (PEM) of --cert")
    p.add_argument("--subscriber-id", default="kvrelay-cli", help="diagnostic label")
    return p


def add_subcommands(subparsers: Any) -> None:
    """Add ``watch``, ``subscribe`` and ``query`` to an ``add_subparsers()`` object."""
    common = _common()
    w = subparsers.add_parser("watch", parents=[common],
                              help="print catalog/readiness/load/serving-load")  # fmt: skip
    w.add_argument("plane", choices=["catalog", "readiness", "load", "serving-load"])
    w.set_defaults(client_command="watch", client_prog=w.prog)
    s = subparsers.add_parser("subscribe", parents=[common], help="inspect one pool's stream")
    s.add_argument("pool", help="namespace/component/endpoint (or a unique suffix)")
    s.add_argument("--verify", action="store_true",
                   help="enforce the consumer rules; report violations (exit 1 if any)")
    s.add_argument("--silence-s", type=float, default=ClientConfig().silence_s, metavar="S",
                   help="end the stream after S seconds without a frame, not even a heartbeat "
                        "(a stream problem: exit 1; default: the SDK's bound)")
    s.set_defaults(client_command="subscribe", client_prog=s.prog)
    q = subparsers.add_parser("query", parents=[common], help="cached prefix depth per pool")
    q.add_argument("--model", required=True, help="canonical model id, alias or LoRA id")
    src = q.add_mutually_exclusive_group(required=True)
    src.add_argument("--tokens", help="comma/space separated token ids")
    src.add_argument("--tokens-file", type=Path, help="file of token ids (list or JSON array)")
    q.add_argument("--lora", default=None, help="LoRA adapter on top of --model")
    q.add_argument("--cache-salt", default=None, help="request cache namespace (salt)")
    q.add_argument("--window", type=int, default=2,
                   help="deprecated, no effect: every block is probed (1..8 still checked)")
    q.add_argument("--wait", type=float, default=10.0, help="seconds to wait for replicas")
    q.add_argument("--all", action="store_true", help="include pools that are not routable")
    q.set_defaults(client_command="query", client_prog=q.prog)


def build_parser(prog: str = "kvrelay-client") -> argparse.ArgumentParser:
    from kvrelay import SUPPORTED_DYNAMO, __version__

    parser = argparse.ArgumentParser(
        prog=prog, description="Inspect a dynamo.kvrelay.v1 relay (kvrelay or Dynamo)."
    )
    parser.add_argument(
        "--version", action="version", version=f"{prog} {__version__} ({SUPPORTED_DYNAMO})"
    )
    add_subcommands(parser.add_subparsers(
        dest="client_subcommand", metavar="COMMAND", parser_class=StrictSubcommand
    ))  # fmt: skip
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "kvrelay-client") -> int:
    """Standalone entry. Invoked as a program (``argv`` None) it also sends kvrelay's logs to
    stderr at WARNING, so ``--json`` output on stdout stays parseable; callers passing ``argv``
    (tests, other CLIs) keep their own logging setup."""
    if argv is None:
        from kvrelay.logging import configure

        configure(level="WARNING", stream=sys.stderr)
    parser = build_parser(prog)
    try:
        args = parser.parse_args(list(argv) if argv is not None else None)
    except SystemExit as exc:  # argparse: 0 for --help and --version, 2 for usage errors
        return int(exc.code or 0)
    if getattr(args, "client_command", None) is None:
        parser.print_help(sys.stderr)
        return 2
    return run(args)


def run(args: argparse.Namespace) -> int:
    """Execute a parsed ``watch``/``subscribe``/``query`` command; returns the exit code.

    Ctrl-C ends ``watch`` and ``subscribe`` as ``--duration`` does (``--verify`` still prints
    its verdict); it interrupts ``query`` (130). A closed stdout ends any of them quietly (141).
    """
    out = Output(sys.stdout, args.json)
    try:
        relays = [rpc.RelayAddress.parse(r) for r in relay_addresses(args.relay)]
        if args.count is not None and args.count < 1:
            raise UsageError("--count must be >= 1")
        if args.duration is not None and not 0 < args.duration < math.inf:
            raise UsageError("--duration must be a number of seconds > 0")
        if getattr(args, "wait", None) is not None and not 0 <= args.wait < math.inf:
            raise UsageError("--wait must be a number of seconds >= 0")
        if getattr(args, "silence_s", None) is not None and not 0 < args.silence_s <= 3600:
            raise UsageError("--silence-s must be a number of seconds in (0, 3600]")
        ClientConfig(subscriber_id=args.subscriber_id)  # its rules, for every command (exit 2)
        ssl = _ssl_context(args)
        command = args.client_command
        if command == "watch":
            code = asyncio.run(_watch(args, relays, ssl, out))
        elif command == "subscribe":
            code = asyncio.run(_subscribe(args, relays, ssl, out))
        elif command == "query":
            tokens = _tokens(args)
            code = asyncio.run(_interruptible(_query(args, relays, ssl, out, tokens)))
        else:
            raise UsageError(f"unknown command {command!r}")
        if out.closed:  # a stream task met the closed pipe: its end is not the run's verdict
            raise OutputClosed
        return code
    except OutputClosed:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except (UsageError, ValueError, OSError) as exc:
        prog = getattr(args, "client_prog", "kvrelay-client")
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # query, or a second Ctrl-C
        print(file=sys.stderr)  # end the terminal's "^C" line
        return EXIT_INTERRUPTED


def _silence_stdout() -> None:
    """Point fd 1 at /dev/null once its reader is gone: the interpreter's last flush of what
    the pipe refused would otherwise print ``Exception ignored ... BrokenPipeError``."""
    with contextlib.suppress(OSError, ValueError):  # not a real file (captured output)
        fd = sys.stdout.fileno()
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)


def _stop_on_interrupt(limiter: Limiter) -> None:
    """Make Ctrl-C end the run as ``--duration`` does, so ``subscribe --verify`` still reports;
    a second Ctrl-C interrupts. Only where the program owns SIGINT (main thread, not ignored)."""
    if signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, signal.SIG_DFL, None):
        return
    loop = asyncio.get_running_loop()

    def stop() -> None:
        limiter.done.set()
        loop.remove_signal_handler(signal.SIGINT)  # back to KeyboardInterrupt

    with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):
        loop.add_signal_handler(signal.SIGINT, stop)


def _stop_when_reader_goes(out: Output) -> None:
    """End the run once stdout's reader is gone (``| head -1``), as a failed write does, even
    while nothing is written: ``watch catalog`` of an unchanged catalog never wrote again, so
    it never noticed and never exited. Only for a pipe, whose write end reports an error
    (EPOLLERR, which wakes a reader callback) once its read end is closed, and never
    anything else (it is never readable)."""
    import select
    import stat

    try:
        fd = out.stream.fileno()
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return
    except (OSError, ValueError):  # not a real file (captured output)
        return
    loop = asyncio.get_running_loop()

    def gone() -> None:
        loop.remove_reader(fd)
        poller = select.poll()
        poller.register(fd, 0)
        if not any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0)):
            return
        if not out.closed:
            out.closed = True
            if out.on_closed is not None:
                out.on_closed()

    with contextlib.suppress(OSError, ValueError, RuntimeError, NotImplementedError):
        loop.add_reader(fd, gone)


async def _interruptible(work: Coroutine[Any, Any, int]) -> int:
    """Run ``work``; Ctrl-C ends it with ``KeyboardInterrupt`` (130). asyncio's own handler
    cancels the main task once, and a cancellation lost on the way (Python 3.11's ``wait_for``
    can swallow one that races with its inner future, as at a connection's start) left the
    command running until the relay's silence ended it. Here the work is cancelled until it is
    done. Only where the program owns SIGINT (main thread, not ignored)."""
    if signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, signal.SIG_DFL, None):
        return await work
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(work)
    interrupted: asyncio.Future[None] = loop.create_future()

    def on_sigint() -> None:
        if not interrupted.done():
            interrupted.set_result(None)

    try:
        loop.add_signal_handler(signal.SIGINT, on_sigint)
    except (ValueError, RuntimeError, NotImplementedError):
        return await task
    try:
        await asyncio.wait((task, interrupted), return_when=asyncio.FIRST_COMPLETED)
    finally:
        loop.remove_signal_handler(signal.SIGINT)
    if not interrupted.done():
        return task.result()
    with contextlib.suppress(Exception):  # (what it failed with meanwhile is not the verdict)
        await cancel_and_wait(task)
    raise KeyboardInterrupt


def relay_addresses(given: list[str] | None, env: dict[str, str] | None = None) -> list[str]:
    """``--relay`` values, else ``$KVRELAY_RELAY`` (comma-separated), else kvrelay's default."""
    if given:
        return given
    text = (os.environ if env is None else env).get(RELAY_ENV, "")
    return [a.strip() for a in text.split(",") if a.strip()] or [DEFAULT_RELAY]


def _ssl_context(args: argparse.Namespace) -> _ssl.SSLContext | None:
    if (args.cert is None) != (args.key is None):
        raise UsageError("--cert and --key go together (mutual TLS)")
    if not args.tls and args.cert is None:
        if args.ca is not None:
            raise UsageError("--ca needs --tls")
        return None
    try:
        ctx = _ssl.create_default_context(cafile=str(args.ca) if args.ca else None)
    except OSError as exc:  # ssl names no file in its errors
        raise UsageError(f"--ca {args.ca}: {exc}") from None
    ctx.set_alpn_protocols(["h2"])
    if args.cert is not None:
        try:
            ctx.load_cert_chain(str(args.cert), str(args.key))
        except OSError as exc:
            raise UsageError(f"--cert {args.cert} / --key {args.key}: {exc}") from None
    return ctx


def _tokens(args: argparse.Namespace) -> list[int]:
    text = args.tokens if args.tokens is not None else args.tokens_file.read_text()
    text = text.strip()
    try:
        values = json.loads(text) if text.startswith("[") else [
            int(t) for t in re.split(r"[,\s]+", text) if t
        ]  # fmt: skip
    except ValueError as exc:
        raise UsageError(f"token ids must be integers: {exc}") from None
    if not isinstance(values, list) or not all(
        isinstance(v, int) and 0 <= v <= 0xFFFFFFFF for v in values
    ):
        raise UsageError("token ids must be integers in the u32 range")
    return values


# ------------------------------------------------------------------------------- output


@dataclass
class Output:
    stream: TextIO
    json_mode: bool
    #: the reader of ``stream`` went away; nothing more is written
    closed: bool = False
    #: called once when it does (``watch``/``subscribe``: end the run)
    on_closed: Callable[[], None] | None = None

    def emit(self, obj: dict[str, Any], text: str) -> None:
        if self.closed:
            raise OutputClosed
        line = json.dumps(obj, sort_keys=True) if self.json_mode else text
        try:
            print(line, file=self.stream, flush=True)
        except BrokenPipeError:
            self.closed = True
            if self.on_closed is not None:
                self.on_closed()
            raise OutputClosed from None


def _table(rows: list[list[str]], indent: str = "  ") -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        indent + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in rows
    )


def _ep(e: pb.DynamoEndpointId | None) -> str:
    return "?" if e is None else f"{e.namespace}/{e.component}/{e.endpoint}"


def _incarnation(m: Any) -> int | None:
    return None if m.relay is None else int(m.relay.relay_incarnation)


@dataclass
class Limiter:
    """Counts emitted items; ``done`` is set at ``--count`` or ``--duration``."""

    count: int | None
    duration: float | None
    n: int = 0
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def tick(self) -> bool:
        """Record one item; False if the limit was already reached (do not print it)."""
        if self.done.is_set():
            return False
        self.n += 1
        if self.count is not None and self.n >= self.count:
            self.done.set()
        return True

    async def run(self, tasks: list[asyncio.Task[Any]]) -> None:
        waiter = asyncio.ensure_future(self.done.wait())
        all_done = asyncio.ensure_future(asyncio.gather(*tasks, return_exceptions=True))
        await asyncio.wait({waiter, all_done}, timeout=self.duration,
                           return_when=asyncio.FIRST_COMPLETED)
        await stop_all((*tasks, waiter, all_done))


# ------------------------------------------------------------------------------- watch


def _catalog_item(addr: str, m: pb.KvPoolCatalogUpdate) -> tuple[dict[str, Any], str]:
    pools = m.snapshot.pools if m.snapshot is not None else []
    items = []
    rows = [["POOL", "MODELS", "BLOCK", "FORMAT", "BUCKETS", "GEN", "ROLES"]]
    for d in pools:
        p = d.producer
        fmt = p.ckf_format if p is not None and p.ckf_format is not None else None
        qs = d.query_semantics
        models = [r.canonical_model_id for r in d.registrations]
        aliases = [a for r in d.registrations for a in r.aliases]
        roles = [role_name(r) for r in d.pool_roles]
        item: dict[str, Any] = {
            "pool": _ep(d.serving_endpoint),
            "models": models,
            "aliases": aliases,
            "block_size": None if qs is None else int(qs.kv_block_size),
            "hash_format": None if qs is None else _FORMATS.get(int(qs.hash_format), "UNKNOWN"),
            "bucket_count": None if fmt is None else int(fmt.bucket_count),
            "layout_generation": None if p is None else int(p.layout_generation),
            "dc_id": None if p is None or p.pool_id is None else int(p.pool_id.dc_id),
            "roles": roles,
        }
        items.append(item)
        rows.append([
            _ep(d.serving_endpoint), ",".join(models), str(item["block_size"]),
            str(item["hash_format"]), str(item["bucket_count"]), str(item["layout_generation"]),
            ",".join(roles),
        ])  # fmt: skip
    obj = {"relay": addr, "plane": "catalog", "revision": int(m.revision),
           "relay_incarnation": _incarnation(m), "pools": items}  # fmt: skip
    text = f"[{addr}] catalog revision {m.revision}: {len(items)} pool(s)"
    if items:
        text += "\n" + _table(rows)
    else:
        text += "\n" + NO_POOL_HINT
    return obj, text


def _readiness_item(addr: str, m: pb.ServingReadinessUpdate) -> tuple[dict[str, Any], str]:
    items = []
    rows = [["NAMESPACE", "MODEL", "STATE", "PRESENT", "MISSING", "MEMBERS", "ADAPTERS"]]
    for e in m.entries:
        item = {
            "namespace": e.namespace,
            "model": e.canonical_model_id,
            "state": _STATES.get(int(e.state), "UNKNOWN"),
            "routable": int(e.state) == 2,
            "present_roles": [role_name(r) for r in e.present_roles],
            "missing_roles": [role_name(r) for r in e.missing_roles],
            "members": [_ep(x.endpoint) for x in e.members],
            "adapters": {a.canonical_model_id: _STATES.get(int(a.state), "UNKNOWN")
                         for a in e.adapters},
        }  # fmt: skip
        items.append(item)
        rows.append([
            e.namespace, e.canonical_model_id, item["state"], ",".join(item["present_roles"]),
            ",".join(item["missing_roles"]), ",".join(item["members"]),
            ",".join(f"{k}={v}" for k, v in item["adapters"].items()),
        ])  # fmt: skip
    obj = {"relay": addr, "plane": "readiness", "revision": int(m.revision),
           "relay_incarnation": _incarnation(m), "entries": items}  # fmt: skip
    text = f"[{addr}] readiness revision {m.revision}: {len(items)} entries"
    if items:
        text += "\n" + _table(rows)
    return obj, text


#: Pool names a load window refers to by producer: ``ns/component/endpoint`` from the catalog.
PoolNames = dict[Any, str]


def _pool_name(p: pb.ProducerIdentity | None, names: PoolNames) -> tuple[str, str]:
    """(``ns/component/endpoint`` or ``?`` while the catalog has not listed it, routing-scope
    digest prefix)."""
    dom = p.pool_id.indexer_domain if p is not None and p.pool_id is not None else None
    rs = dom.routing_scope.digest.hex()[:12] if dom and dom.routing_scope else "?"
    try:
        name = names.get(producer_key(p), "?")
    except RelayError:
        name = "?"
    return name, rs


def _load_item(
    addr: str, m: pb.KvPoolLoadUpdate, names: PoolNames
) -> tuple[dict[str, Any], str]:
    items = []
    rows = [["POOL", "GEN", "USED", "TOTAL", "RANKS", "UTILIZATION"]]
    for e in m.pools:
        p = e.producer
        pool, rs = _pool_name(p, names)
        auth = (e.kv_expected_ranks > 0 and e.kv_observed_ranks == e.kv_expected_ranks
                and e.total_kv_blocks > 0)  # fmt: skip
        util = min(1.0, e.kv_used_blocks / e.total_kv_blocks) if auth else None
        item = {"pool": pool, "routing_scope": rs, "layout_generation": None if p is None
                else int(p.layout_generation), "kv_used_blocks": int(e.kv_used_blocks),
                "total_kv_blocks": int(e.total_kv_blocks),
                "observed_ranks": int(e.kv_observed_ranks),
                "expected_ranks": int(e.kv_expected_ranks), "authoritative": auth,
                "utilization": util}  # fmt: skip
        items.append(item)
        rows.append([pool, str(item["layout_generation"]), str(e.kv_used_blocks),
                     str(e.total_kv_blocks), f"{e.kv_observed_ranks}/{e.kv_expected_ranks}",
                     "unknown" if util is None else f"{util:.1%}"])  # fmt: skip
    obj = {"relay": addr, "plane": "load", "window_sequence": int(m.window_sequence),
           "observed_ms": int(m.observed_ms), "window_ms": int(m.window_ms),
           "relay_incarnation": _incarnation(m), "pools": items}  # fmt: skip
    text = f"[{addr}] load window {m.window_sequence}: {len(items)} pool(s)"
    if items:
        text += "\n" + _table(rows)
    return obj, text


_STATUS = {1: "COMPLETE", 2: "DEGRADED", 3: "UNAVAILABLE"}


def _n(v: int | None) -> str:
    return "-" if v is None else str(v)


def _serving_load_item(
    addr: str, m: pb.ServingLoadUpdate, names: PoolNames
) -> tuple[dict[str, Any], str]:
    """Unset figures print ``-`` (JSON: null): unknown, never zero."""
    pools, models = [], []
    prow = [["POOL", "GEN", "STATUS", "DECODE_BLOCKS", "PREFILL_TOKENS", "LIVE", "MAX_CONC"]]
    for e in m.pools:
        pool, rs = _pool_name(e.producer, names)
        load = e.load or pb.LoadView()
        tok, dep = load.tokens or pb.TokenLoadStats(), e.deployment or pb.PoolDeploymentStatus()
        item: dict[str, Any] = {
            "pool": pool, "routing_scope": rs,
            "layout_generation": None if e.producer is None else int(e.producer.layout_generation),
            "status": _STATUS.get(int(load.status), "UNSPECIFIED"),
            "active_decode_blocks": tok.active_decode_blocks,
            "active_prefill_tokens": tok.active_prefill_tokens,
            "live_workers": dep.live_workers, "max_concurrency": dep.max_concurrency,
            "source_observed_ms": int(load.source_observed_ms),
        }  # fmt: skip
        pools.append(item)
        prow.append([pool, str(item["layout_generation"]), item["status"],
                     _n(tok.active_decode_blocks), _n(tok.active_prefill_tokens),
                     _n(dep.live_workers), _n(dep.max_concurrency)])  # fmt: skip
    mrow = [["NAMESPACE", "MODEL", "STATUS", "STARTED", "DONE", "FAILED", "CANCELLED",
             "IN_TOKENS", "OUT_TOKENS", "FRONTENDS"]]  # fmt: skip
    for e in m.models:
        load = e.load or pb.LoadView()
        r, tok = load.requests or pb.RequestLifecycleStats(), load.tokens or pb.TokenLoadStats()
        d = e.deployment or pb.ModelDeploymentStatus()
        item = {
            "namespace": e.namespace, "model": e.canonical_model_id,
            "status": _STATUS.get(int(load.status), "UNSPECIFIED"),
            "requests_started_total": int(r.requests_started_total),
            "requests_completed_total": int(r.requests_completed_total),
            "requests_failed_total": int(r.requests_failed_total),
            "requests_cancelled_total": int(r.requests_cancelled_total),
            "requests_awaiting_first_token": r.requests_awaiting_first_token,
            "requests_generating": r.requests_generating,
            "input_tokens_total": tok.input_tokens_total,
            "output_tokens_total": tok.output_tokens_total,
            "inflight_input_tokens": tok.inflight_input_tokens,
            "awaiting_first_token_input_tokens": tok.awaiting_first_token_input_tokens,
            "expected_frontends": int(d.expected_frontends),
            "observed_frontends": int(d.observed_frontends),
            "ready_frontends": int(d.ready_frontends),
            "source_observed_ms": int(load.source_observed_ms),
        }  # fmt: skip
        models.append(item)
        mrow.append([e.namespace, e.canonical_model_id, item["status"],
                     str(r.requests_started_total), str(r.requests_completed_total),
                     str(r.requests_failed_total), str(r.requests_cancelled_total),
                     _n(tok.input_tokens_total), _n(tok.output_tokens_total),
                     f"{d.observed_frontends}/{d.expected_frontends} seen, "
                     f"{d.ready_frontends} ready"])  # fmt: skip
    obj = {"relay": addr, "plane": "serving-load", "window_sequence": int(m.window_sequence),
           "observed_ms": int(m.observed_ms), "window_ms": int(m.window_ms),
           "relay_incarnation": _incarnation(m), "pools": pools, "models": models}  # fmt: skip
    text = (f"[{addr}] serving-load window {m.window_sequence}: {len(pools)} pool(s), "
            f"{len(models)} model(s)")  # fmt: skip
    if pools:
        text += "\n" + _table(prow)
    if models:
        text += "\n" + _table(mrow)
    return obj, text


_PLANES: dict[str, tuple[str, Callable[[str], Any], type, Callable[..., Any]]] = {
    "catalog": ("WatchKvPoolCatalog", rpc.catalog_request, pb.KvPoolCatalogUpdate, _catalog_item),
    "readiness": ("SubscribeServingReadiness", rpc.readiness_request, pb.ServingReadinessUpdate,
                  _readiness_item),
    "load": ("SubscribeKvPoolLoad", rpc.load_request, pb.KvPoolLoadUpdate, _load_item),
    "serving-load": ("SubscribeServingLoad", rpc.serving_load_request, pb.ServingLoadUpdate,
                     _serving_load_item),
}  # fmt: skip
#: Planes whose windows name pools by producer: ``watch`` reads the catalog beside them.
_BY_PRODUCER = frozenset({"load", "serving-load"})


async def _watch(
    args: argparse.Namespace, relays: list[rpc.RelayAddress], ssl: _ssl.SSLContext | None,
    out: Output,
) -> int:  # fmt: skip
    method, make_request, reply, render = _PLANES[args.plane]
    by_producer = args.plane in _BY_PRODUCER
    limiter = Limiter(args.count, args.duration)
    out.on_closed = limiter.done.set
    _stop_on_interrupt(limiter)
    _stop_when_reader_goes(out)
    failures = 0

    async def one(addr: rpc.RelayAddress) -> None:
        nonlocal failures
        channel = rpc.open_channel(addr, ssl)
        names: PoolNames = {}
        catalog: asyncio.Task[Any] | None = None
        try:
            def on(msg: Any) -> None:
                if limiter.tick():
                    obj, text = render(str(addr), msg, names) if by_producer else render(
                        str(addr), msg)
                    out.emit(obj, text)

            if by_producer:
                first = asyncio.Event()
                catalog = asyncio.create_task(
                    _catalog_names(channel, args.subscriber_id, names, first)
                )
                with contextlib.suppress(TimeoutError):  # names first, so rows are named
                    await asyncio.wait_for(first.wait(), 2.0)
            end = await rpc.run_stream(channel, method, make_request(args.subscriber_id),
                                       reply, on)  # fmt: skip
            if not limiter.done.is_set():
                failures += 1
                print(f"[{addr}] stream ended: {end.reason} {end.message}".rstrip(),
                      file=sys.stderr)  # fmt: skip
        finally:
            if catalog is not None:
                await stop_all((catalog,))
            channel.close()

    await limiter.run([asyncio.create_task(one(a)) for a in relays])
    return 1 if failures else 0


async def _catalog_names(
    channel: Any, subscriber_id: str, names: PoolNames, first: asyncio.Event
) -> None:
    """Keep ``names`` (producer key → ``ns/component/endpoint``) current from the catalog."""
    def on(m: pb.KvPoolCatalogUpdate) -> None:
        fresh: PoolNames = {}
        for d in m.snapshot.pools if m.snapshot is not None else []:
            with contextlib.suppress(RelayError):
                fresh[producer_key(d.producer)] = _ep(d.serving_endpoint)
        names.clear()
        names.update(fresh)
        first.set()

    while True:
        await rpc.run_stream(channel, "WatchKvPoolCatalog", rpc.catalog_request(subscriber_id),
                             pb.KvPoolCatalogUpdate, on)  # fmt: skip
        first.set()
        await asyncio.sleep(1.0)


# ------------------------------------------------------------------------------- subscribe


class Inspector:
    """Lenient frame decoder for ``subscribe`` without ``--verify``: shows what arrives, applies
    what decodes, enforces no sequencing rule."""

    def __init__(self, producer: pb.ProducerIdentity) -> None:
        key = producer_key(producer)  # a catalog entry no replica can use: ``RelayError``
        self.seed, self.bucket_count = key.seed, key.bucket_count
        self.table = np.zeros(self.bucket_count, dtype=np.uint64)
        self.assembler = cbi1.SnapshotAssembler()

    def feed(self, fu: pb.FilterUpdate) -> FrameInfo:
        kind = {1: "snapshot_chunk", 2: "delta", 3: "heartbeat"}.get(int(fu.kind), "unknown")
        info = FrameInfo(kind, int(fu.base_sequence), int(fu.sequence), len(fu.payload))
        if not fu.payload:
            return info
        info.checksum = int.from_bytes(fu.payload[44:48], "little") if len(fu.payload) >= 48 \
            else None
        frame = rules.decode(fu.payload, self.seed, self.bucket_count)
        if isinstance(frame, cbi1.SnapshotChunk):
            info.chunk = (frame.chunk_index, frame.chunk_count)
            done = rules.assemble(self.assembler, frame)
            if done is not None:
                self.table = np.array(done.words, dtype=np.uint64, copy=True)
                info.installed = True
        else:
            info.images = int(frame.buckets.size)
            self.table[frame.buckets.astype(np.intp)] = frame.words
        return info

    def occupancy(self) -> int:
        return occupancy(self.table)


async def _find_pool(
    channel: Any, name: str, subscriber_id: str, first_message_s: float
) -> tuple[pb.KvPoolDescriptor | None, pb.RelayIdentity | None, str]:
    """The pool ``name`` names in the relay's catalog; the catalog's first message must come
    within ``first_message_s`` (a relay that never answers ends as ``silent``, never a hang)."""
    found: list[pb.KvPoolCatalogUpdate] = []

    def on(m: pb.KvPoolCatalogUpdate) -> None:
        found.append(m)
        raise _Stop()

    try:
        end = await rpc.run_stream(
            channel, "WatchKvPoolCatalog", rpc.catalog_request(subscriber_id),
            pb.KvPoolCatalogUpdate, on, first_message_s=first_message_s,
        )  # fmt: skip
    except _Stop:
        end = None
    if not found:
        if end is None:
            return None, None, ""
        why = f"catalog stream ended: {end.reason}"
        if end.message:
            why += f" ({end.message})"
        if end.reason == "connection":
            why += "; is a relay listening there? (--relay HOST:PORT, or $KVRELAY_RELAY)"
        return None, None, why
    m = found[0]
    pools = m.snapshot.pools if m.snapshot is not None else []
    exact = [d for d in pools if _ep(d.serving_endpoint) == name]
    match = exact or [d for d in pools if _ep(d.serving_endpoint).endswith(name)]
    if len(match) != 1:
        names = ", ".join(_ep(d.serving_endpoint) for d in pools) or "none"
        why = "ambiguous" if match else "not in the catalog"
        return None, m.relay, f"pool {name!r} {why} (catalog: {names})"
    return match[0], m.relay, ""


class _Stop(Exception):
    pass


def _frame_obj(addr: str, pool: str, info: FrameInfo, occ: int) -> tuple[dict[str, Any], str]:
    obj = {"relay": addr, "pool": pool, "kind": info.kind.upper(),
           "base_sequence": info.base_sequence, "sequence": info.sequence,
           "bytes": info.payload_bytes, "checksum": info.checksum, "chunk": info.chunk,
           "images": info.images, "installed": info.installed, "occupancy": occ}  # fmt: skip
    seqtxt = (f"{info.base_sequence}->{info.sequence}" if info.kind == "delta"
              else f"{info.sequence}")  # fmt: skip
    parts = [f"[{addr}] {info.kind.upper():<14} seq {seqtxt:<12} {info.payload_bytes:>8} B"]
    if info.checksum is not None:
        parts.append(f"csum {info.checksum:#010x}")
    if info.chunk is not None:
        parts.append(f"chunk {info.chunk[0] + 1}/{info.chunk[1]}")
    if info.images is not None:
        parts.append(f"images {info.images}")
    parts.append(f"occupancy {occ}")
    if info.installed:
        parts.append("[installed]")
    return obj, "  ".join(parts)


async def _subscribe(
    args: argparse.Namespace, relays: list[rpc.RelayAddress], ssl: _ssl.SSLContext | None,
    out: Output,
) -> int:  # fmt: skip
    limiter = Limiter(args.count, args.duration)
    out.on_closed = limiter.done.set
    _stop_on_interrupt(limiter)
    _stop_when_reader_goes(out)
    config = ClientConfig(subscriber_id=args.subscriber_id)
    problems = 0
    violations = 0
    checked = 0

    async def one(addr: rpc.RelayAddress) -> None:
        nonlocal problems, violations
        channel = rpc.open_channel(addr, ssl)
        attempt = 0
        try:
            while not limiter.done.is_set():
                desc, relay, why = await _find_pool(
                    channel, args.pool, args.subscriber_id, args.silence_s
                )
                if desc is None or desc.producer is None:
                    problems += 1
                    print(f"[{addr}] {why}", file=sys.stderr)
                    return
                try:
                    state: PoolReplica | Inspector = (
                        PoolReplica(desc.producer, relay) if args.verify
                        else Inspector(desc.producer)
                    )  # fmt: skip
                except RelayError as exc:
                    # a catalog entry no replica can be built from (no CKF format, generation 0)
                    violations += 1
                    detail = exc.message
                    out.emit({"relay": str(addr), "pool": _ep(desc.serving_endpoint),
                              "violation": "catalog_entry", "detail": detail},
                             f"[{addr}] VIOLATION catalog_entry: {detail}")  # fmt: skip
                    return
                pool = _ep(desc.serving_endpoint)

                def on(fu: pb.FilterUpdate, state: PoolReplica | Inspector = state,
                       pool: str = pool) -> None:  # fmt: skip
                    nonlocal checked
                    info = state.feed(fu)
                    checked += 1
                    if limiter.tick():
                        obj, text = _frame_obj(str(addr), pool, info, state.occupancy())
                        out.emit(obj, text)

                try:
                    # the SDK's silence rule: a relay owes a heartbeat within its period, and a
                    # stream that sends nothing past the bound is not vouched for (nor verified)
                    end = await rpc.run_stream(
                        channel, "SubscribeKvPool",
                        rpc.pool_request(args.subscriber_id, desc.producer), pb.FilterUpdate, on,
                        silence_s=args.silence_s,
                    )  # fmt: skip
                    reason, detail = end.reason, end.message
                except ConsumerViolation as v:
                    violations += 1
                    reason, detail = v.reason, v.detail
                    out.emit({"relay": str(addr), "pool": pool, "violation": v.reason,
                              "detail": v.detail}, f"[{addr}] VIOLATION {v.reason}: {v.detail}")
                if limiter.done.is_set():
                    return
                if reason == E.SILENT or (
                    not args.verify and reason not in ("eof",) and not reason.startswith("cbi1")
                ):
                    problems += 1
                out.emit({"relay": str(addr), "pool": pool, "stream_end": reason,
                          "detail": detail},
                         f"[{addr}] stream ended: {reason} {detail}".rstrip())  # fmt: skip
                await asyncio.sleep(config.backoff(attempt))
                attempt += 1
        finally:
            channel.close()

    await limiter.run([asyncio.create_task(one(a)) for a in relays])
    if args.verify:
        ok = not problems and not violations and checked > 0
        verdict = "PASS" if ok else "FAIL"
        why = f"{checked} frame(s) checked against every consumer rule, {violations} violation(s)"
        if problems:
            why += f", {problems} stream problem(s)"
        if not checked and not violations:
            why += ": nothing was checked"
        out.emit({"verdict": verdict.lower(), "frames": checked, "violations": violations,
                  "problems": problems}, f"verify: {verdict} ({why})")  # fmt: skip
        return 0 if ok else 1  # FAIL is exit 1, "nothing was checked" included
    return 1 if problems or violations else 0


# ------------------------------------------------------------------------------- query


async def _query(
    args: argparse.Namespace, relays: list[rpc.RelayAddress], ssl: _ssl.SSLContext | None,
    out: Output, tokens: list[int],
) -> int:  # fmt: skip
    config = ClientConfig(subscriber_id=args.subscriber_id, verification_window=args.window,
                          watch_load=False, watch_serving_load=False)  # fmt: skip
    client = RelayClient(relays, ssl=ssl, config=config)
    await client.start()
    try:
        started = time.monotonic()
        # Ready, or every relay without a catalog has told why (a refused connection is known
        # at once: there is nothing to wait for).
        await client.wait_for(
            lambda: all(
                c.catalog_error is not None if c.catalog_revision is None
                else all(s.installed is not None or s.quarantined for s in c.slots.values())
                for c in client.connections
            ),
            args.wait,
        )
        failed = [(c.name, c.catalog_error or "no catalog within --wait")
                  for c in client.connections if c.catalog_revision is None]  # fmt: skip
        # readiness arrives on its own stream: give it the rest of the wait
        await client.wait_for(
            lambda: all(
                c.readiness is not None for c in client.connections
                if c.catalog_revision is not None
            ),
            max(0.0, args.wait - (time.monotonic() - started)),
        )
        everything = client.overlap(tokens, args.model, args.lora, args.cache_salt,
                                    routable_only=False)  # fmt: skip
        routable = client.overlap(tokens, args.model, args.lora, args.cache_salt)
        descs = client.pools()
        served = sorted({
            name for c in client.connections for s in c.slots.values()
            for r in s.descriptor.registrations for name in (r.canonical_model_id, *r.aliases)
        })  # fmt: skip
    finally:
        await client.close()
    for name, error in failed:
        print(f"[{name}] catalog stream ended: {error}", file=sys.stderr)
    if failed and len(failed) == len(relays):
        return 1
    shown = everything if args.all else routable
    rows = [["POOL", "DEPTH_BLOCKS", "DEPTH_TOKENS", "BLOCK", "ROUTABLE"]]
    pools = []
    for key in sorted(shown):
        qs = descs[key].query_semantics
        bs = 0 if qs is None else int(qs.kv_block_size)
        pools.append({"pool": str(key), "depth_blocks": shown[key],
                      "depth_tokens": shown[key] * bs, "block_size": bs,
                      "routable": key in routable})  # fmt: skip
        rows.append([str(key), str(shown[key]), str(shown[key] * bs), str(bs),
                     "yes" if key in routable else "no"])  # fmt: skip
    obj = {"model": args.model, "lora": args.lora, "tokens": len(tokens),
           "overlap": {p["pool"]: p["depth_blocks"] for p in pools}, "pools": pools,
           "not_routable": sorted(str(k) for k in everything if k not in routable)}  # fmt: skip
    text = f"model {args.model}: {len(tokens)} tokens, {len(pools)} pool(s)"
    if pools:
        text += "\n" + _table(rows)
    hidden = len(everything) - len(routable)
    if hidden and not args.all:
        text += f"\n  ({hidden} pool(s) serving the model are not routable; --all shows them)"
    if not everything:
        known = ", ".join(served) if served else "none"
        what = repr(args.model)
        if args.lora and args.model in served:  # the base is served, the adapter is not
            what = f"LoRA {args.lora!r} on {args.model!r}"
        text += f"\n  (no pool serves {what}; the catalog's models: {known})"
        obj["catalog_models"] = served
    out.emit(obj, text)
    return 0 if everything else 1
