"""Subscriber process: opens ``--streams`` SubscribeKvPool streams to one relay and measures.

Per stream: ``subscribe → snapshot complete`` (wall seconds from sending the request to the last
snapshot chunk) and, for every DELTA, ``recv_wall_us - send_ts_us`` (the relay's own stamp taken
when it hands the frame to gRPC; both clocks are this machine's ``time.time()``). Stream 0 is the
*probe* stream: it keeps a replica table (CBI1 snapshot + deltas) and after each delta looks up the
next pending probe chains of ``--probe-file``; the wall time a probe's 8 hashes are first all
present is its receive time (joined later with the loadgen's publish time: end-to-end latency).

Frames are read with the grpclib client and a pass-through codec, parsed with the lenient mode
of the wire reader in ``kvrelay.client.wire`` (or betterproto2 with ``--decode betterproto2``),
payloads with ``cbi1``.
Prints ``SNAPSHOTS_DONE`` once every stream holds a full snapshot. On SIGTERM writes ``--out``
(JSON) and ``--out``.lat.npy (int64 µs of every delta of every stream).

Final-state check (``--check-file``, probe stream only): on SIGUSR1 the subscriber loads the
engine's working set (``present``/``absent`` canonical hashes written by the loadgen) and looks
it up in its replica every 10 ms until every present hash is found; it reports that wall time,
the present hashes still missing at the last look, and the removed chains whose 8 hashes are all
still in the filter (a stale replica; an exact one shows ~0). Stream ends are classified from the
outside the same way for every relay: the gRPC status and the ``kv-relay-error-reason`` trailer.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import time
from typing import Any

import numpy as np
from grpclib.client import Channel
from grpclib.const import Cardinality
from grpclib.exceptions import GRPCError, StreamTerminatedError

from benchmarks._common import (
    CATALOG_PATH,
    KIND_DELTA,
    KIND_HEARTBEAT,
    KIND_SNAPSHOT,
    MARKER,
    SUBSCRIBE_PATH,
)
from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.client.codec import RawCodec
from kvrelay.client.wire import parse_filter_update
from kvrelay.pool.ckf import contains
from kvrelay.publication import cbi1

PROBE_WINDOW = 256
CHECK_PERIOD_S = 0.01
REASON_KEY = "kv-relay-error-reason"


async def fetch_producer(ch: Channel, sid: str, timeout: float) -> pb.ProducerIdentity:
    """First pool's producer from the catalog (waits until a pool is listed)."""
    deadline = time.monotonic() + timeout
    async with ch.request(
        CATALOG_PATH, Cardinality.UNARY_STREAM, pb.WatchKvPoolCatalogRequest,
        pb.KvPoolCatalogUpdate,
    ) as st:
        await st.send_message(
            pb.WatchKvPoolCatalogRequest(subscriber_id=sid, contract_marker=MARKER), end=True
        )
        while time.monotonic() < deadline:
            data = await asyncio.wait_for(st.recv_message(), deadline - time.monotonic())
            if data is None:
                break
            upd = pb.KvPoolCatalogUpdate.parse(data)
            snap = upd.snapshot
            if snap is not None and snap.pools and snap.pools[0].producer is not None:
                await st.cancel()  # the catalog stream never ends; leave without its trailers
                return snap.pools[0].producer
    raise TimeoutError("no pool in the catalog")


class StreamStats:
    def __init__(self, idx: int) -> None:
        self.idx = idx
        self.t_request = 0.0
        self.snapshot_s: float | None = None
        self.snapshot_bytes = 0
        self.deltas = 0
        self.heartbeats = 0
        self.frames = 0
        self.bytes = 0
        self.seq_errors = 0
        self.late_snapshot_chunks = 0  # snapshot chunks after the first complete snapshot
        self.error: str | None = None
        self.status: str | None = None  # gRPC status name when the relay ended the stream
        self.reason: str | None = None  # the kv-relay-error-reason trailer, if any
        self.lat_us: list[int] = []
        self.seq_recv: list[tuple[int, int]] = []  # (sequence, receive µs), --seq-log only
        self.recv_us: list[int] | None = None  # with --detail: receive time of every delta
        self.channel = 0


class Prober:
    """Replica table + probe lookups for stream 0."""

    def __init__(self, probes: np.ndarray, start: int, seed: int, bucket_count: int) -> None:
        self.probes = probes  # (P, 8) uint64
        self.found_us = np.zeros(len(probes), dtype=np.int64)
        self.pending = list(range(start, len(probes)))
        self.seed = seed
        self.bc = bucket_count
        self.asm = cbi1.SnapshotAssembler()
        self.table: np.ndarray | None = None
        self.present: np.ndarray | None = None
        self.absent: np.ndarray | None = None
        self.check: dict[str, Any] = {}

    def start_check(self, path: str) -> None:
        z = np.load(path)
        self.present = np.ascontiguousarray(z["present"], dtype=np.uint64).ravel()
        self.absent = np.ascontiguousarray(z["absent"], dtype=np.uint64)
        self.check = {"started_us": int(time.time() * 1e6), "present_hashes": int(
            self.present.size), "absent_chains": len(self.absent), "complete_us": None,
            "missing_hashes": None, "stale_chains": None, "stale_hashes": None, "looks": 0}

    def look(self) -> bool:
        """One look at the replica; True once every present hash is in it."""
        if self.present is None or self.table is None:
            return False
        c = self.check
        hit = contains(self.table, self.seed, self.present)
        c["looks"] += 1
        c["missing_hashes"] = int(hit.size - int(hit.sum()))
        if self.absent is not None and len(self.absent):
            gone = contains(self.table, self.seed, self.absent.ravel()).reshape(self.absent.shape)
            c["stale_chains"] = int(gone.all(axis=1).sum())
            c["stale_hashes"] = int(gone.sum())
        if self.pending:  # probes never seen that are in the replica now (none, when exact)
            window = self.pending[:PROBE_WINDOW]
            hit = contains(self.table, self.seed, self.probes[window].ravel()).reshape(-1, 8)
            c["unseen_probes_present"] = int(hit.all(axis=1).sum())
        if c["missing_hashes"] == 0 and c["complete_us"] is None:
            c["complete_us"] = int(time.time() * 1e6)
        return c["complete_us"] is not None

    def snapshot(self, payload: memoryview) -> bool:
        chunk = cbi1.decode(payload, expected_seed=self.seed, expected_bucket_count=self.bc)
        assert isinstance(chunk, cbi1.SnapshotChunk)
        done = self.asm.feed(chunk)
        if done is not None:
            self.table = np.array(done.words, dtype=np.uint64, copy=True)
            return True
        return False

    def delta(self, payload: memoryview, now_us: int) -> None:
        d = cbi1.decode(payload, expected_seed=self.seed, expected_bucket_count=self.bc)
        assert isinstance(d, cbi1.Delta) and self.table is not None
        self.table[d.buckets.astype(np.int64)] = d.words
        if not self.pending:
            return
        window = self.pending[:PROBE_WINDOW]
        hit = contains(self.table, self.seed, self.probes[window].ravel()).reshape(-1, 8)
        ok = hit.all(axis=1)
        if ok.any():
            for j in np.flatnonzero(ok):
                self.found_us[window[j]] = now_us
            keep = set(np.asarray(window)[~ok].tolist())
            self.pending = [p for p in window if p in keep] + self.pending[PROBE_WINDOW:]


async def run_stream(
    ch: Channel, producer: pb.ProducerIdentity, st: StreamStats, sid: str,
    prober: Prober | None, done: asyncio.Event, chunk_count: int, use_bp2: bool,
    read_bps: float = 0.0,
    seq_log: bool = False,
) -> None:
    req = pb.SubscribeKvPoolRequest(
        subscriber_id=sid, expected_producer=producer, contract_marker=MARKER
    )
    chunks = 0
    last_seq = -1
    stream = None
    try:
        async with ch.request(
            SUBSCRIBE_PATH, Cardinality.UNARY_STREAM, pb.SubscribeKvPoolRequest, pb.FilterUpdate
        ) as stream:
            st.t_request = time.time()
            await stream.send_message(req, end=True)
            while True:
                data = await stream.recv_message()
                now = time.time()
                if data is None:
                    break
                if use_bp2:
                    fu = pb.FilterUpdate.parse(data)
                    kind, base, seq, ts = int(fu.kind), fu.base_sequence, fu.sequence, fu.send_ts_us
                    payload = memoryview(fu.payload)
                else:
                    kind, base, seq, ts, payload = parse_filter_update(data)
                st.frames += 1
                st.bytes += len(data)
                if kind == KIND_DELTA:
                    st.deltas += 1
                    st.lat_us.append(int(now * 1e6) - ts)
                    if seq_log:
                        st.seq_recv.append((seq, int(now * 1e6)))
                    if st.recv_us is not None:
                        st.recv_us.append(int(now * 1e6))
                    if base != last_seq:
                        st.seq_errors += 1
                    last_seq = seq
                    if prober is not None:
                        prober.delta(payload, int(now * 1e6))
                elif kind == KIND_SNAPSHOT and st.snapshot_s is not None:
                    st.late_snapshot_chunks += 1  # a consumer would have to rebuild its replica
                elif kind == KIND_SNAPSHOT:
                    chunks += 1
                    st.snapshot_bytes += len(data)
                    if read_bps > 0:  # a slow reader: at most read_bps on average so far
                        ahead = st.t_request + st.snapshot_bytes / read_bps - time.time()
                        if ahead > 0:
                            await asyncio.sleep(ahead)
                    complete = prober.snapshot(payload) if prober is not None else (
                        chunks == chunk_count
                    )
                    if complete:
                        st.snapshot_s = now - st.t_request
                        last_seq = seq
                        done.set()
                elif kind == KIND_HEARTBEAT:
                    st.heartbeats += 1
            st.error = f"EOF {stream.trailing_metadata!r}"
    except GRPCError as exc:
        st.error = f"{exc.status.name}: {exc.message}"
        st.status = exc.status.name
        trailers = dict(getattr(stream, "trailing_metadata", None) or {})
        st.reason = trailers.get(REASON_KEY)
    except (StreamTerminatedError, ConnectionError) as exc:
        st.error = f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # a frame this client cannot apply: record it, keep the others
        st.error = f"client {type(exc).__name__}: {exc}"
    finally:
        done.set()


async def amain(a: argparse.Namespace) -> dict[str, Any]:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    channels = [Channel(a.host, a.port, codec=RawCodec()) for _ in range(a.channels)]
    deadline = time.monotonic() + a.timeout
    while True:  # the relay may still be starting (side-by-side starts everything at once)
        try:
            producer = await fetch_producer(channels[0], f"{a.id}-catalog", a.timeout)
            break
        except (ConnectionError, OSError, StreamTerminatedError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)
    fmt = producer.ckf_format
    assert fmt is not None
    seed, bc = int(fmt.seed), int(fmt.bucket_count)
    prober = None
    if a.probe_file:
        with open(a.probe_file) as f:
            probes = np.array(json.load(f)["probes"], dtype=np.uint64).reshape(-1, 8)
        prober = Prober(probes, a.probe_start, seed, bc)
    if a.barrier:  # several processes "joining at once": start together, after the imports
        for ch in channels[1:]:
            await ch.__connect__()
        print("CONNECTED", flush=True)
        await loop.run_in_executor(None, sys.stdin.readline)
    stats = [StreamStats(i) for i in range(a.streams)]
    for st in stats:
        st.channel = st.idx % len(channels)
        if a.detail:
            st.recv_us = []
    dones = [asyncio.Event() for _ in stats]
    tasks = [
        asyncio.create_task(
            run_stream(
                channels[i % len(channels)], producer, st, f"{a.id}-{i}",
                prober if i == 0 else None, dones[i], cbi1.chunk_count_for(bc), a.decode == "bp2",
                a.read_mbps * 1e6,
                a.seq_log and i == 0,
            )
        )
        for i, st in enumerate(stats)
    ]
    await asyncio.wait_for(asyncio.gather(*(d.wait() for d in dones)), a.timeout)
    checker: asyncio.Task[None] | None = None
    if prober is not None and a.check_file:
        p0 = prober

        async def check_loop() -> None:
            p0.start_check(a.check_file)
            while not p0.look():
                await asyncio.sleep(CHECK_PERIOD_S)
            print(f"CHECK_COMPLETE {p0.check['complete_us']}", flush=True)

        def start_checking() -> None:
            nonlocal checker
            if checker is None:
                checker = asyncio.create_task(check_loop())

        loop.add_signal_handler(signal.SIGUSR1, start_checking)
    print("SNAPSHOTS_DONE", flush=True)
    if a.duration > 0:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), a.duration)
    else:
        await stop.wait()
    if checker is not None:
        checker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await checker
        if prober is not None and prober.check.get("complete_us") is None:
            prober.look()  # the state at the end, for the report
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await t
    for ch in channels:
        ch.close()
    lat = np.array([x for st in stats for x in st.lat_us], dtype=np.int64)
    np.save(a.out + ".lat.npy", lat)
    if a.seq_log:  # stream 0: when each sequence arrived (mirror hop: compare two subscribers)
        np.save(a.out + ".seq.npy", np.array(stats[0].seq_recv, dtype=np.int64).reshape(-1, 2))
    if a.detail:  # per stream: receive time and latency of every delta (diagnostics)
        np.savez(a.out + ".detail.npz", **{
            f"s{st.idx}": np.array([st.recv_us or [], st.lat_us], dtype=np.int64).reshape(2, -1)
            for st in stats})
    out: dict[str, Any] = {
        "streams": [
            {k: v for k, v in vars(st).items() if k not in ("lat_us", "seq_recv", "recv_us")}
            | {"lat_n": len(st.lat_us), "lat_p99_us": _p99(st.lat_us)}
            for st in stats
        ],
        "bucket_count": bc,
    }
    if prober is not None:
        found = np.flatnonzero(prober.found_us)
        out["probe_found"] = [[int(i), int(prober.found_us[i])] for i in found]
        out["check"] = prober.check
    return out


def _p99(values: list[int]) -> int | None:
    return int(np.percentile(np.asarray(values), 99)) if values else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--streams", type=int, default=1)
    p.add_argument("--channels", type=int, default=1, help="HTTP/2 connections to spread over")
    p.add_argument("--id", default="bench")
    p.add_argument("--probe-file", default="")
    p.add_argument("--probe-start", type=int, default=0)
    p.add_argument("--decode", choices=["wire", "bp2"], default="wire")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--duration", type=float, default=0.0, help="0 = until SIGTERM")
    p.add_argument("--out", required=True)
    p.add_argument("--barrier", action="store_true",
                   help="print CONNECTED, then open the streams when a line arrives on stdin")
    p.add_argument("--read-mbps", type=float, default=0.0,
                   help="throttle snapshot reading to this many MB/s (0 = full speed)")
    p.add_argument("--check-file", default="", help="loadgen working-set .npz, read on SIGUSR1")
    p.add_argument("--detail", action="store_true",
                   help="also write --out.detail.npz: receive time and latency of every delta")
    p.add_argument("--uvloop", action="store_true")
    p.add_argument("--seq-log", action="store_true", help="stream 0: save (sequence, recv µs)")
    a = p.parse_args()
    if a.uvloop:
        import uvloop

        uvloop.install()
    res = asyncio.run(amain(a))
    with open(a.out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
