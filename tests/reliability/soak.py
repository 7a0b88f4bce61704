"""Bounded soak: a simulated fleet at a steady rate, 64 gRPC pool subscribers, flat memory.

Runs everything in one process on one event loop (engines, relay, server, subscribers) so the
number it reports is the whole system's resident set. It fails (exit 1) when

* the resident set grows: mean RSS of the last third > ``rss_tolerance`` above the middle third;
* any subscriber stream ends (a lag termination or anything else) or sees a sequence gap;
* delivery latency drifts: the last third's typical p50/p99 (the median over its one-second
  windows of each window's percentile) above ``latency_factor`` × the middle third's, plus a
  small absolute slack for timer noise (stretched by ``tests.support.timing`` on a busy
  machine). A second or two of a neighbour's load moves a window or two; a drift moves them all;
* subscriber 0's assembled filter differs from the producer table after traffic stops.

``python -m tests.reliability.soak --seconds 600`` (``make soak``; ``SOAK_SECONDS`` overrides)
writes ``benchmarks/results/soak.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from grpclib.client import Channel
from grpclib.const import Cardinality
from grpclib.exceptions import GRPCError, StreamTerminatedError

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.publication import cbi1
from kvrelay.relay.relay import Relay
from kvrelay.relay.settings import EngineSpec, PoolSpec, RelaySettings
from kvrelay.service.server import RelayServer
from kvrelay.sim.config import SimConfig
from kvrelay.sim.engine import SimEngine
from tests.support.timing import scaled, slowdown

MARKER = 0x4B565231
_SUBSCRIBE = "/dynamo.kvrelay.v1.KvEventRelay/SubscribeKvPool"
_PAGE = os.sysconf("SC_PAGE_SIZE")
STREAMS_PER_CHANNEL = 16


def rss_bytes() -> int:
    """Current resident set size (``/proc/self/statm``; peak RSS where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass
class SoakResult:
    seconds: float
    rate: float
    subscribers: int
    rss_mb: list[float] = field(default_factory=list)
    rss_middle_mb: float = 0.0
    rss_last_mb: float = 0.0
    latency_ms: dict[str, dict[str, float]] = field(default_factory=dict)
    deltas_received: int = 0
    deltas_published: int = 0
    lag_terminations: int = 0
    streams_ended: int = 0
    sequence_errors: int = 0
    latency_samples_dropped: int = 0
    replica_matches: bool = False
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


class _Samples:
    """Every delivery latency (µs) of the run in one array, allocated and written through before
    the traffic starts, so that recording them does not grow the resident set the soak judges:
    kept as Python ints they grew it by ~24 KB/s at 64 subscribers, about all the growth a
    10-minute soak used to report. Samples past ``capacity`` are counted, not kept."""

    def __init__(self, capacity: int) -> None:
        self.buf = np.full(capacity, -1, dtype=np.int64)  # a write to every page: resident now
        self.n = 0
        self.dropped = 0

    def add(self, values: list[int]) -> None:
        k = min(len(values), self.buf.shape[0] - self.n)
        if k:
            self.buf[self.n : self.n + k] = values[:k]
            self.n += k
        self.dropped += len(values) - k


class _Follower:
    """One SubscribeKvPool stream: checks sequence continuity, records delivery latency; the
    first follower also assembles the filter table (CBI1) to compare with the producer."""

    def __init__(self, channel: Channel, producer: pb.ProducerIdentity, index: int) -> None:
        self.channel = channel
        self.producer = producer
        self.index = index
        self.keep_table = index == 0
        fmt = producer.ckf_format
        assert fmt is not None
        self.seed, self.bucket_count = int(fmt.seed), int(fmt.bucket_count)
        self.assembler = cbi1.SnapshotAssembler()
        self.table: npt.NDArray[np.uint64] | None = None
        self.sequence: int | None = None
        self.deltas = 0
        self.sequence_errors = 0
        self.latencies_us: list[int] = []
        self.ended: str | None = None
        self.ready = asyncio.Event()

    async def run(self) -> None:
        req = pb.SubscribeKvPoolRequest(
            subscriber_id=f"soak-{self.index}", expected_producer=self.producer,
            contract_marker=MARKER,
        )  # fmt: skip
        try:
            async with self.channel.request(
                _SUBSCRIBE, Cardinality.UNARY_STREAM, pb.SubscribeKvPoolRequest, pb.FilterUpdate
            ) as st:
                await st.send_message(req, end=True)
                while True:
                    fu = await st.recv_message()
                    if fu is None:
                        self.ended = "eof"
                        return
                    self._on(fu)
        except GRPCError as exc:
            self.ended = f"{exc.status.name}: {exc.message}"
        except StreamTerminatedError as exc:
            self.ended = f"terminated: {exc}"

    def _on(self, fu: pb.FilterUpdate) -> None:
        kind = fu.kind
        if kind == pb.FilterUpdateKind.SNAPSHOT_CHUNK:
            if self.keep_table:
                chunk = cbi1.decode(
                    fu.payload, expected_seed=self.seed, expected_bucket_count=self.bucket_count
                )
                assert isinstance(chunk, cbi1.SnapshotChunk)
                done = self.assembler.feed(chunk)
                if done is not None:
                    self.table = np.array(done.words, dtype=np.uint64, copy=True)
                    self.sequence = done.epoch
                    self.ready.set()
            else:
                self.sequence = int(fu.sequence)  # single-chunk lanes; continuity checked below
                self.ready.set()
        elif kind == pb.FilterUpdateKind.DELTA:
            if self.sequence is None or fu.base_sequence != self.sequence:
                self.sequence_errors += 1
            self.sequence = int(fu.sequence)
            self.deltas += 1
            self.latencies_us.append(time.time_ns() // 1000 - int(fu.send_ts_us))
            if self.keep_table and self.table is not None:
                delta = cbi1.decode(
                    fu.payload, expected_seed=self.seed, expected_bucket_count=self.bucket_count
                )
                assert isinstance(delta, cbi1.Delta)
                self.table[delta.buckets.astype(np.int64)] = delta.words


async def _stop_relay(relay: Relay) -> None:
    """``relay.stop()``, bounded: a shutdown that hangs fails the soak instead of stalling it."""
    await asyncio.wait_for(relay.stop(), scaled(30))


def _percentiles(samples: Sequence[int] | npt.NDArray[np.int64]) -> dict[str, float]:
    if not len(samples):
        return {"n": 0, "p50": 0.0, "p99": 0.0}
    a = np.asarray(samples, dtype=np.float64) / 1000.0
    p50, p99 = (float(np.percentile(a, q)) for q in (50, 99))
    return {"n": len(samples), "p50": p50, "p99": p99}


def _joined(windows: Sequence[Sequence[int] | npt.NDArray[np.int64]]) -> npt.NDArray[np.int64]:
    parts = [np.asarray(w, dtype=np.int64) for w in windows]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _typical(windows: Sequence[Sequence[int] | npt.NDArray[np.int64]]) -> dict[str, float]:
    """Per percentile, the median over ``windows`` of each window's own value (ms)."""
    per = [_percentiles(w) for w in windows if len(w)]
    if not per:
        return {"p50": 0.0, "p99": 0.0}
    return {q: float(np.median([p[q] for p in per])) for q in ("p50", "p99")}


async def _catalog_producer(channel: Channel, timeout: float = 30.0) -> pb.ProducerIdentity:
    stub = pb.KvEventRelayStub(channel)
    async with asyncio.timeout(scaled(timeout)):
        async for upd in stub.watch_kv_pool_catalog(
            pb.WatchKvPoolCatalogRequest(subscriber_id="soak-catalog", contract_marker=MARKER)
        ):
            if upd.snapshot is not None and upd.snapshot.pools:
                producer = upd.snapshot.pools[0].producer
                if producer is not None:
                    return producer
    raise TimeoutError("pool never appeared in the catalog")


async def run_soak(
    seconds: float,
    *,
    rate: float = 10.0,
    subscribers: int = 64,
    engines: int = 1,
    dp_size: int = 2,
    sample_s: float = 1.0,
    rss_tolerance: float = 0.10,
    latency_factor: float = 2.0,
    latency_slack_ms: float = 25.0,
    log: bool = True,
) -> SoakResult:
    """Run the soak for ``seconds`` of traffic at ``rate`` scheduler steps/s per engine."""
    res = SoakResult(seconds=seconds, rate=rate, subscribers=subscribers)
    sims = [
        SimEngine(
            SimConfig(
                name=f"soak-{i}", seed=100 + i, dp_size=dp_size, capacity_blocks=512,
                buffer_steps=256,  # the simulator's replay history must not grow: RSS is judged
            )
        )
        for i in range(engines)
    ]
    for e in sims:
        await e.start()
    settings = RelaySettings(
        dc_name="dc-soak",
        pools=(
            PoolSpec(
                namespace="soak", component="backend", endpoint="generate",
                engines=tuple(EngineSpec(name=e.cfg.name, grpc_port=e.grpc_port) for e in sims),
                expected_blocks=16_384,
            ),
        ),
        discovery_interval_s=1.0,
    )  # fmt: skip
    relay = Relay(settings)
    await relay.start()
    server = RelayServer(relay, settings.limits)
    await server.start("127.0.0.1", 0)
    n_channels = max(1, -(-subscribers // STREAMS_PER_CHANNEL))
    channels = [Channel("127.0.0.1", server.port) for _ in range(n_channels)]
    tasks: list[asyncio.Task[None]] = []
    try:
        producer = await _catalog_producer(channels[0])
        followers = [
            _Follower(channels[i % n_channels], producer, i) for i in range(subscribers)
        ]
        tasks = [asyncio.create_task(f.run()) for f in followers]
        async with asyncio.timeout(scaled(60)):
            await asyncio.gather(*(f.ready.wait() for f in followers))
        for e in sims:
            e.run(rate)
        # each follower gets about one delta per engine message: room for twice that
        samples = _Samples(int(seconds * rate * engines * dp_size * subscribers * 2) + 65_536)
        bounds: list[tuple[int, int]] = []  # each window's samples: samples.buf[a:b]
        start = time.monotonic()
        next_sample = start + sample_s
        while time.monotonic() - start < seconds:
            await asyncio.sleep(max(0.0, next_sample - time.monotonic()))
            next_sample += sample_s
            res.rss_mb.append(rss_bytes() / 1e6)
            first = samples.n
            for f in followers:
                samples.add(f.latencies_us)
                f.latencies_us.clear()  # keeps its capacity: the next window reuses it
            bounds.append((first, samples.n))
            if log and len(bounds) % max(1, int(10 / sample_s)) == 0:
                lat = _percentiles(samples.buf[first : samples.n])
                print(
                    f"soak t={time.monotonic() - start:6.1f}s rss={res.rss_mb[-1]:7.1f} MB "
                    f"deltas/s={lat['n'] / sample_s / max(1, subscribers):6.1f} "
                    f"p50={lat['p50']:.2f} ms p99={lat['p99']:.2f} ms",
                    flush=True,
                )
        for e in sims:
            await e.stop_running()
        gen = relay.pools[0].generation
        if gen is None:
            res.failures.append("pool withdrawn during the soak")
        else:
            gen.flush()
            deadline = time.monotonic() + scaled(10)
            while followers[0].sequence != gen.sequence and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            res.deltas_published = gen.batches_published
            table = followers[0].table
            res.replica_matches = table is not None and bool(np.array_equal(table, gen.pool.table))
            hub = gen.hub()
            res.lag_terminations = hub.lagged
        res.deltas_received = sum(f.deltas for f in followers)
        res.sequence_errors = sum(f.sequence_errors for f in followers)
        res.streams_ended = sum(1 for f in followers if f.ended is not None)
        res.latency_samples_dropped = samples.dropped
        windows = [samples.buf[a:b] for a, b in bounds]
        _judge(res, windows, rss_tolerance, latency_factor, latency_slack_ms * slowdown())
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        for ch in channels:
            ch.close()
        await server.close(grace_s=1.0)
        await _stop_relay(relay)
        for e in sims:
            await e.stop()
    return res


def _judge(
    res: SoakResult,
    windows: Sequence[Sequence[int] | npt.NDArray[np.int64]],
    rss_tolerance: float,
    latency_factor: float,
    slack_ms: float,
) -> None:
    n = len(res.rss_mb)
    if n < 3:
        res.failures.append(f"too few samples ({n}) to judge")
        return
    third = n // 3
    mid, last = slice(third, 2 * third), slice(2 * third, n)
    res.rss_middle_mb = float(np.mean(res.rss_mb[mid]))
    res.rss_last_mb = float(np.mean(res.rss_mb[last]))
    if res.rss_last_mb > res.rss_middle_mb * (1 + rss_tolerance):
        res.failures.append(
            f"RSS grew: last third {res.rss_last_mb:.1f} MB > middle {res.rss_middle_mb:.1f} MB "
            f"+ {rss_tolerance:.0%}"
        )
    lat_mid = _percentiles(_joined(windows[mid]))
    lat_last = _percentiles(_joined(windows[last]))
    typ_mid, typ_last = _typical(windows[mid]), _typical(windows[last])
    res.latency_ms = {
        "middle": {**lat_mid, **{f"window_{q}": v for q, v in typ_mid.items()}},
        "last": {**lat_last, **{f"window_{q}": v for q, v in typ_last.items()}},
    }
    for q in ("p50", "p99"):
        if typ_last[q] > typ_mid[q] * latency_factor + slack_ms:
            res.failures.append(
                f"latency {q} drifted: last third's windows {typ_last[q]:.2f} ms > "
                f"{latency_factor} × {typ_mid[q]:.2f} ms + {slack_ms:.0f} ms"
            )
    if lat_mid["n"] == 0 or lat_last["n"] == 0:
        res.failures.append("no deltas delivered in a third of the run")
    if res.latency_samples_dropped:
        res.failures.append(f"{res.latency_samples_dropped} latency samples past the recorder's "
                            "capacity: the latency judgement would be incomplete")
    if res.lag_terminations:
        res.failures.append(f"{res.lag_terminations} lag terminations")
    if res.streams_ended:
        res.failures.append(f"{res.streams_ended} subscriber streams ended")
    if res.sequence_errors:
        res.failures.append(f"{res.sequence_errors} delta sequence errors")
    if not res.replica_matches:
        res.failures.append("subscriber 0's filter differs from the producer table")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.reliability.soak", description=__doc__)
    ap.add_argument("--seconds", type=float, default=float(os.environ.get("SOAK_SECONDS", 600)))
    ap.add_argument("--rate", type=float, default=float(os.environ.get("SOAK_RATE", 10)))
    ap.add_argument("--subscribers", type=int, default=64)
    ap.add_argument("--engines", type=int, default=1)
    ap.add_argument("--dp-size", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/soak.json"))
    args = ap.parse_args(argv)
    res = asyncio.run(
        run_soak(
            args.seconds, rate=args.rate, subscribers=args.subscribers, engines=args.engines,
            dp_size=args.dp_size,
        )
    )  # fmt: skip
    out: dict[str, Any] = asdict(res)
    out["ok"] = res.ok
    from benchmarks._common import machine  # the commit and machine, like every result file

    out["machine"] = machine()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "rss_mb"}, indent=2))
    print(f"soak {'PASSED' if res.ok else 'FAILED'}; results in {args.out}")
    return 0 if res.ok else 1


if __name__ == "__main__":
    sys.exit(main())
