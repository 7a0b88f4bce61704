"""A worker's reports never block its event loop, whatever its supervisor's reading does.

Real pipes (``os.pipe``, shrunk to one page so a stalled reader fills it at once) and a real
worker (``run_worker``: a mirror of an in-memory relay over a UNIX socket, serving gRPC). The
oracle for "not blocked" is the worker itself: while nobody reads its pipe it keeps answering
``GetRelayInfo`` and keeps producing reports (dropped and counted); a blocking write would stop
its loop at the first full pipe.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest
from grpclib.client import Channel
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from kvrelay.contract.limits import RelayLimits
from kvrelay.ops.report_pipe import ReportPipe
from kvrelay.ops.worker import WorkerSpec, run_worker
from kvrelay.service.server import RelayServer
from tests.support.mem_relay import MemRelayView
from tests.support.mirror_rig import QUIET_WINDOW_MS
from tests.support.rig import eventually, relay_info

F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)


@contextlib.contextmanager
def small_pipe() -> Iterator[tuple[int, int]]:
    r, w = os.pipe()
    with contextlib.suppress(OSError):
        fcntl.fcntl(w, F_SETPIPE_SZ, 4096)
    try:
        yield r, w
    finally:
        for fd in (r, w):
            with contextlib.suppress(OSError):
                os.close(fd)


def read_available(fd: int) -> bytes:
    os.set_blocking(fd, False)
    out = b""
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(fd, 1 << 16):
            out += chunk
    return out


async def test_a_stalled_reader_costs_dropped_reports_never_a_blocked_sender() -> None:
    with small_pipe() as (r, w):
        pipe = ReportPipe(w, capacity=2)
        line = "STATS " + json.dumps({"pad": "x" * 2000})
        for i in range(200):  # ~400 KiB into a 4 KiB pipe nobody reads
            pipe.send(line if i != 100 else "READY 1", droppable=i != 100)
        assert pipe.dropped > 0 and pipe.pending <= 3
        await eventually(lambda: pipe.pending <= 2, what="writer blocked on the pipe")
        got = b""
        while len(got.splitlines()) < pipe.written or pipe.pending:
            got += read_available(r)
            await asyncio.sleep(0.01)
        assert pipe.close(timeout_s=5)
        got += read_available(r)
        lines = got.decode().splitlines()
        assert "READY 1" in lines, "a line that must arrive is never dropped"
        assert all(x == line for x in lines if x != "READY 1"), "lines arrive whole"
        assert len(lines) == pipe.written and pipe.written + pipe.dropped == 200


async def test_a_reader_gone_stops_the_writer() -> None:
    r, w = os.pipe()
    os.close(r)
    pipe = ReportPipe(w)
    pipe.send("STATS {}")
    await eventually(lambda: pipe.broken, what="EPIPE noticed")
    assert not pipe.send("STATS {}") and pipe.close(timeout_s=5)
    os.close(w)


async def test_a_worker_whose_stdout_is_not_read_keeps_serving() -> None:
    view = MemRelayView(RelayLimits(), window_ms=QUIET_WINDOW_MS)
    view.add_pool("p0", 1024)
    upstream = RelayServer(view)
    folder = tempfile.mkdtemp(prefix="kvrelay-test-")
    path = os.path.join(folder, "ingest.sock")
    await upstream.start_unix(path)
    stop = asyncio.Event()
    try:
        with small_pipe() as (r, w):
            pipe = ReportPipe(w)
            spec = WorkerSpec(index=1, upstream=f"unix:{path}", host="127.0.0.1", port=0,
                              stats_interval_s=0.01, sync_timeout_s=30)  # fmt: skip
            worker = asyncio.ensure_future(run_worker(spec, stop, out=pipe))
            await eventually(lambda: pipe.written >= 1, what="READY written", timeout=30)
            first = read_available(r).decode().splitlines()[0]
            assert first.startswith("READY ")
            port = int(first.split()[1])
            # nobody reads any more: the pipe fills, the writer thread blocks
            await eventually(lambda: pipe.dropped >= 20, what="reports dropped", timeout=30)
            stalled_written = pipe.written
            async with Channel("127.0.0.1", port) as ch:
                for _ in range(3):  # the worker's loop runs: it serves and reports on
                    info = await asyncio.wait_for(relay_info(ch), 10)
                    assert info.relay is not None
                    before = pipe.dropped
                    await eventually(lambda b=before: pipe.dropped > b, what="loop alive")
            assert pipe.written == stalled_written, "the reader really was stalled"
            # the reader catches up: reports flow again and say how many were dropped
            got = b""
            for _ in range(500):
                got += read_available(r)
                reports = [json.loads(x[6:]) for x in got.decode().splitlines()
                           if x.startswith("STATS ") and x.endswith("}")]  # fmt: skip
                if any(rep["reports_dropped"] > 0 for rep in reports):
                    break
                await asyncio.sleep(0.02)
            assert any(rep["reports_dropped"] > 0 for rep in reports)
            stop.set()
            assert await asyncio.wait_for(worker, 20) == 0
            pipe.close(timeout_s=1)
    finally:
        stop.set()
        await upstream.close(grace_s=1.0)
        shutil.rmtree(folder, ignore_errors=True)


async def test_a_stopping_worker_reports_what_its_drain_counted() -> None:
    """A call that still waits for its request when the worker's drain runs out is refused
    (``PUBLICATION_UNAVAILABLE``, counted): the worker's last report, after its drain, carries
    that count. Before, the last report was written before the drain, and the supervisor, which
    keeps an exited worker's last report, never counted the refusal."""
    from grpclib.const import Cardinality

    from kvrelay._proto.dynamo.kvrelay import v1 as pb
    from kvrelay.ops.worker import WorkerControl

    view = MemRelayView(RelayLimits(), window_ms=QUIET_WINDOW_MS)
    view.add_pool("p0", 1024)
    upstream = RelayServer(view)
    folder = tempfile.mkdtemp(prefix="kvrelay-test-")
    path = os.path.join(folder, "ingest.sock")
    await upstream.start_unix(path)
    stop = asyncio.Event()
    control = WorkerControl()
    try:
        r, w = os.pipe()
        pipe = ReportPipe(w)
        # no periodic report: only what the worker writes when it stops
        spec = WorkerSpec(index=1, upstream=f"unix:{path}", host="127.0.0.1", port=0,
                          stats_interval_s=3600, sync_timeout_s=30,
                          shutdown_timeout_s=0.4)  # fmt: skip
        worker = asyncio.ensure_future(run_worker(spec, stop, out=pipe, control=control))
        await eventually(lambda: pipe.written >= 1, what="READY written", timeout=30)
        port = int(read_available(r).decode().split()[1])
        async with Channel("127.0.0.1", port) as ch:
            with pytest.raises(GRPCError) as refused:
                async with ch.request(
                    "/dynamo.kvrelay.v1.KvEventRelay/WatchKvPoolCatalog",
                    Cardinality.UNARY_STREAM, pb.WatchKvPoolCatalogRequest,
                    pb.KvPoolCatalogUpdate,
                ) as held:  # fmt: skip
                    await held.send_request()  # headers only: the handler waits for it
                    await eventually(lambda: bool(control.server.service._active),
                                     what="the call is handled")  # fmt: skip
                    stop.set()
                    assert await asyncio.wait_for(worker, 20) == 0
                    await held.recv_initial_metadata()
            assert refused.value.status is Status.UNAVAILABLE
        assert pipe.close(timeout_s=5)
        lines = read_available(r).decode().splitlines()
        os.close(r)
        os.close(w)
        assert lines and lines[-1].startswith("STATS "), lines
        errors = json.loads(lines[-1][len("STATS ") :])["service"]["errors"]
        assert errors == {"RELAY_ERROR_REASON_PUBLICATION_UNAVAILABLE": 1}, lines[-1][:500]
    finally:
        stop.set()
        await upstream.close(grace_s=1.0)
        shutil.rmtree(folder, ignore_errors=True)
