"""Connect mode: handshakes that fail or are refused, as hostile peers on 127.0.0.2 cause them.

Real ZMQ sockets: the bound SUB on 127.0.0.1 (``allow`` = 127.0.0.1), raw TCP peers from
127.0.0.2 that speak no ZMTP, the wrong mechanism, nothing at all, or ZMTP followed by a large
frame.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import structlog
import zmq.asyncio

from kvrelay.ingest.connect import SETTLE_S, ConnectSource, ConnectSpec
from kvrelay.ingest.topic_pattern import TopicPattern
from kvrelay.ingest.zmtp import GREETING
from kvrelay.ops.event_loop import GIL_SWITCH_INTERVAL_S
from tests.ingest.test_connect import Sink, ctx, pub  # noqa: F401 (fixture)
from tests.ingest.test_connect_trust import _PUB_HELLO
from tests.support.timing import scaled
from tests.support.vllm_publisher import until

HOSTILE = "127.0.0.2"
MIB = 1024 * 1024
#: A ZMTP 3.0 greeting that asks for CURVE (the socket is a plain NULL one).
_CURVE_GREETING = GREETING[:12] + b"CURVE".ljust(20, b"\x00") + GREETING[32:]


async def _source(ctx: zmq.asyncio.Context, handshake_s: float = 10.0) -> ConnectSource:  # noqa: F811
    spec = ConnectSpec(
        bind=("tcp://127.0.0.1:0",), pattern=TopicPattern("kv@{engine}@{model}"),
        kv_block_size=4, model="m", allow=("127.0.0.1",),
    )  # fmt: skip
    src = ConnectSource(spec, Sink(), context=ctx, handshake_s=handshake_s)
    await src.start()
    return src


async def _stranger(src: ConnectSource, first: bytes) -> asyncio.StreamWriter:
    host, port = src.endpoints[0].removeprefix("tcp://").rsplit(":", 1)
    _r, w = await asyncio.open_connection(host, int(port), local_addr=(HOSTILE, 0))
    if first:
        w.write(first)
        await w.drain()
    return w


def _failed(src: ConnectSource) -> dict[str, int]:
    c = src.counters
    return {r: getattr(c, f) for r, f in c.HANDSHAKE_FAILURES.items()}


async def test_handshakes_that_fail_before_the_allow_check_are_counted_by_reason(
    ctx: zmq.asyncio.Context,  # noqa: F811
) -> None:
    """libzmq closes these connections itself, before the relay's handler is asked: noise
    instead of a greeting, a CURVE greeting to a plain socket, a peer silent until the handshake
    time. They were closed uncounted and unlogged; each is now counted by reason (the monitor's
    handshake-failure events; noise has none, and is told by a stranger's connection closing
    unreported), logged once per reason and period. The relay's own refusal and an engine's
    handshake count nothing here."""
    src = await _source(ctx, handshake_s=scaled(0.5))
    writers = []
    try:
        with structlog.testing.capture_logs() as logs:
            real = await pub(ctx, src, b"kv@pod-a@m")  # admitted: its handshake succeeds
            for i in range(3):  # not ZMTP 3 (the first byte is no 0xff); one at a time, so
                # that no socket of this process takes a closed one's descriptor number before
                # the relay read the address on it
                writers.append(await _stranger(src, bytes([i]) * 64))
                await until(lambda n=i + 1: _failed(src)["not_zmtp3"] == n)  # type: ignore[misc]
            writers.append(await _stranger(src, _CURVE_GREETING))
            await until(lambda: _failed(src)["protocol"] == 1)
            writers.append(await _stranger(src, b""))  # says nothing
            await until(lambda: _failed(src)["unfinished"] == 1)
            writers.append(await _stranger(src, _PUB_HELLO))  # ZMTP, refused by ``allow``
            await until(lambda: src.counters.connections_refused == 1)
            await until(lambda: not src._strangers)  # each of them closed, none counted twice
        assert _failed(src) == {"protocol": 1, "auth": 0, "unfinished": 1, "not_zmtp3": 3}
        lines = [e for e in logs if e["event"] == "connect_handshake_failed"]
        assert [(e["reason"], e["failed"]) for e in lines] == [
            ("not_zmtp3", 1), ("protocol", 1), ("unfinished", 1)
        ]
        assert src.connections == 1
        real.sock.close(linger=0)
    finally:
        for w in writers:
            w.close()
        await src.stop()


#: ``n`` raw publishers from ``HOSTILE`` (a process of its own: argv host, port, n, size,
#: seconds), each its greeting, READY and one frame of ``size`` bytes streamed; prints the
#: relay's (its parent's) peak RSS growth, sampled each round, when the last was closed, and
#: what each wrote before the relay closed it.
_BIG_FRAMES = """
import os, socket, sys, time
statm = f"/proc/{os.getppid()}/statm"
page = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open(statm) as f:
        return int(f.read().split()[1]) * page
base = peak = rss()
host, (port, n, size), limit = sys.argv[1], map(int, sys.argv[2:5]), float(sys.argv[5])
hello = bytes.fromhex(sys.stdin.read())
socks = []
for _ in range(n):
    s = socket.create_connection((host, port), source_address=("127.0.0.2", 0))
    s.setblocking(False)
    s.send(hello + b"\\x02" + size.to_bytes(8, "big"))
    socks.append(s)
started = time.monotonic()
sent, open_ = [0] * n, set(range(n))
chunk = bytes(1 << 20)
while open_ and time.monotonic() - started < limit:
    for i in list(open_):
        try:
            if socks[i].recv(65536) == b"":
                open_.discard(i)
                continue
        except BlockingIOError:
            pass
        except OSError:
            open_.discard(i)
            continue
        if sent[i] < size:
            try:
                sent[i] += socks[i].send(chunk[: size - sent[i]])
            except BlockingIOError:
                pass
            except OSError:
                open_.discard(i)
    peak = max(peak, rss())
    time.sleep(0.001)
print(peak - base, time.monotonic() - started, *sent)
"""


def _big_frames_stalling(
    endpoint: str, n: int, size: int, limit_s: float
) -> tuple[int, float, list[int]]:
    """Run ``_BIG_FRAMES`` while this thread spins on the CPU without yielding: the event loop
    is stalled (and holds the GIL but at each switch interval) until the strangers are done."""
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    proc = subprocess.Popen(
        [sys.executable, "-c", _BIG_FRAMES, host, port, str(n), str(size), str(limit_s)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(_PUB_HELLO.hex())
    proc.stdin.close()
    deadline = time.monotonic() + limit_s + scaled(10)
    while proc.poll() is None and time.monotonic() < deadline:
        pass  # the stall
    if proc.poll() is None:
        proc.kill()
    grown, took, *sent = proc.stdout.read().split()
    proc.wait()
    return int(grown), float(took), [int(x) for x in sent]


async def test_strangers_are_refused_while_the_event_loop_is_stalled(
    ctx: zmq.asyncio.Context,  # noqa: F811
) -> None:
    """libzmq goes on reading a connection while its handshake waits for the handler's answer,
    up to a whole frame (16 MiB here). The handler answered on the event loop: behind a stalled
    loop, each stranger's frame was taken in whole (200 such connections held 2 GiB). The
    handler now answers on a thread of its own, so strangers are refused, and closed, while the
    loop is still stalled, long before their frames are in."""
    src = await _source(ctx)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)  # as the relay runs
    try:
        grown, took, sent = _big_frames_stalling(src.endpoints[0], 8, 16 * MIB, scaled(10))
        refused_while_stalled = src.counters.connections_refused  # the loop has not run since
        assert refused_while_stalled == 8
        # before: every frame was taken in whole (70-75 MiB at the peak here); now 1-25 MiB
        assert grown < 48 * MIB, (
            f"the relay grew {grown / MIB:.0f} MiB; written (MiB): {[s // MIB for s in sent]}"
        )
        assert took < scaled(5)
        assert src.counters.messages == 0 and len(src) == 0
    finally:
        sys.setswitchinterval(interval)
        await src.stop()


async def _hello(
    src: ConnectSource, local: str
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw ZMTP publisher from ``local``: its greeting and READY sent, the relay's greeting
    read (the relay then asks the handler)."""
    host, port = src.endpoints[0].removeprefix("tcp://").rsplit(":", 1)
    r, w = await asyncio.open_connection(host, int(port), local_addr=(local, 0))
    w.write(_PUB_HELLO)
    await w.drain()
    await asyncio.wait_for(r.readexactly(len(GREETING)), scaled(5))
    return r, w


@pytest.mark.parametrize("reason", ["address", "connection_limit"])
async def test_a_refused_peer_that_hangs_up_is_counted_as_refused_only(
    ctx: zmq.asyncio.Context,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    reason: str,
) -> None:
    """The handler refuses a handshake (an address outside ``allow``, or one past the
    connection limit) and the peer hangs up before libzmq has read the answer: libzmq reports
    the handshake as failed (``unfinished``) as well, and the connection was counted twice, in
    ``connections_refused`` (or ``…_over_limit``) and in ``handshakes_failed``. (The audit's
    strangers hung up right after the relay's greeting: refused, and sometimes also unfinished.)
    Here the answer waits 50 ms after the handler counted it, and each peer hangs up meanwhile;
    each is now counted once, as refused, as is a peer that waits for the refusal. A handshake
    that fails on its own (a peer silent until the handshake time) is still counted as failed."""
    spec = ConnectSpec(
        bind=("tcp://127.0.0.1:0",), pattern=TopicPattern("kv@{engine}@{model}"),
        kv_block_size=4, model="m", allow=("127.0.0.1",),
        max_connections=0 if reason == "connection_limit" else None,
    )  # fmt: skip
    src = ConnectSource(spec, Sink(), context=ctx, handshake_s=scaled(0.5))
    decide = src._decide

    def slow(req: Any) -> Any:  # counted at once, answered after the peer hung up
        verdict = decide(req)
        time.sleep(0.05)
        return verdict

    monkeypatch.setattr(src, "_decide", slow)  # (the handler takes it at ``start``)
    await src.start()
    local = HOSTILE if reason == "address" else "127.0.0.1"

    def refused() -> int:
        c = src.counters
        return c.connections_refused if reason == "address" else c.connections_over_limit

    rounds = 12
    try:
        with structlog.testing.capture_logs() as logs:
            for i in range(rounds):  # one at a time: each hangs up while its answer waits
                _r, w = await _hello(src, local)
                await until(lambda n=i + 1: refused() == n)  # type: ignore[misc]
                w.close()
                await asyncio.sleep(0.1)  # answered: the next handshake is asked at once
            r, w = await _hello(src, local)  # one that waits for the refusal
            if reason == "address":
                await asyncio.wait_for(r.read(), scaled(5))  # b"": the relay closed it
            else:  # held until the handshake's time (the peer connects again later)
                await asyncio.sleep(0.2)
            w.close()
            silent = await _stranger(src, b"")  # fails on its own: the handshake's time ends it
            await until(lambda: _failed(src)["unfinished"] >= 1, timeout=10)
            await until(lambda: not src._unsettled, timeout=5 * SETTLE_S)  # all counted
            silent.close()
        assert refused() == rounds + 1
        assert _failed(src) == {"protocol": 0, "auth": 0, "unfinished": 1, "not_zmtp3": 0}
        failed = [e for e in logs if e["event"] == "connect_handshake_failed"]
        assert [(e["reason"], e["failed"]) for e in failed] == [("unfinished", 1)]
    finally:
        await src.stop()


#: Raw publishers from ``HOSTILE``, one at a time (argv host, port, n, wait): each sends its
#: greeting and READY and then neither sends nor closes; prints how many the relay had not
#: closed within ``wait`` seconds, and the longest it took for the others.
_ONE_BY_ONE = """
import socket, sys, time
host, port, n, wait = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
hello = bytes.fromhex(sys.stdin.read())
kept, longest = 0, 0.0
for _ in range(n):
    s = socket.create_connection((host, port), source_address=("127.0.0.2", 0))
    s.sendall(hello)
    s.settimeout(wait)
    started = time.monotonic()
    try:
        while s.recv(65536):
            pass
        longest = max(longest, time.monotonic() - started)
    except socket.timeout:
        kept += 1
    s.close()
print(kept, longest)
"""


async def test_a_refused_connection_libzmq_keeps_is_closed_by_the_relay(
    ctx: zmq.asyncio.Context,  # noqa: F811
) -> None:
    """libzmq reports the relay's refusal and closes the connection in one step, unless its I/O
    thread read the answer in the step that asked (the handler's thread answered while the I/O
    thread was descheduled between the two): then it reports the refusal and keeps the
    connection, reading it, until the peer sends more or the handshake's time ends it (10 s).
    That was 3 of 300 stranger connections here on an idle host, 37-53 of 300 with the other
    core busy. The relay now ends such a connection itself, and it is counted once, as refused.
    (A peer in another process: with the loop idle, the handler answers at once. This
    process's threads share one CPU meanwhile, so that the handler's thread, woken by the
    request, often runs before the I/O thread reads: 12-25 of 200 were kept.)"""
    src = await _source(ctx)
    n = 200
    try:
        with _one_cpu():
            kept, longest = await _one_by_one(src, n)
        assert kept == 0, f"{kept} of {n} refused connections were kept open"
        assert longest < scaled(1.0)  # (the others: closed within this long)
        assert src.counters.connections_refused == n
        await until(lambda: not src._strangers and not src._unsettled, timeout=5 * SETTLE_S)
        assert _failed(src) == {"protocol": 0, "auth": 0, "unfinished": 0, "not_zmtp3": 0}
    finally:
        await src.stop()


@contextlib.contextmanager
def _one_cpu() -> Iterator[None]:
    """Every thread of this process on one CPU (the first it may use) until the block ends."""
    tasks = [int(t) for t in os.listdir("/proc/self/task")]
    before = {t: os.sched_getaffinity(t) for t in tasks}
    for t in tasks:
        with contextlib.suppress(OSError):  # (a thread that ended meanwhile)
            os.sched_setaffinity(t, {min(before[t])})
    try:
        yield
    finally:
        for t, cpus in before.items():
            with contextlib.suppress(OSError):
                os.sched_setaffinity(t, cpus)


async def _one_by_one(src: ConnectSource, n: int) -> tuple[int, float]:
    host, port = src.endpoints[0].removeprefix("tcp://").rsplit(":", 1)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _ONE_BY_ONE, host, port, str(n), str(scaled(1.0)),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(_PUB_HELLO.hex().encode()), 120)
    kept, longest = out.split()
    return int(kept), float(longest)
