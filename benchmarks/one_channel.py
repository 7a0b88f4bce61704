"""Many lanes joined at once on one HTTP/2 connection under traffic: ``python -m
benchmarks.one_channel [--lanes 32] [--mib 4] [--deltas-per-s 200] [--window-kib 1024]
[--smoke]`` (``--smoke``: 4 lanes of 1 MiB, to ``.work/smoke``).

The SDK and every mirror subscribe all pools of a relay on one connection, and the relay writes
their snapshots one stream after another. This subscribes ``--lanes`` lanes of ``--mib`` MiB each
at once on one grpclib channel while every lane publishes ``--deltas-per-s`` deltas (8 buckets
each), and reports how many complete (snapshot, then caught up with the lane's sequence), how
long they take, and the snapshot payload bytes received over the snapshot bytes (1.0: every
snapshot sent once; a stream that fails after its turn sends its chunks for nothing). Relay and
client share this process and its event loop (real gRPC over loopback, real publication hubs
behind ``RelayServer``, no engines): it measures the service's scheduling, not ingest. Writes
``benchmarks/results/one_channel.{json,md}``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from grpclib.client import Channel
from grpclib.config import Configuration
from grpclib.const import Cardinality

from benchmarks._common import machine, results_dir, write_json
from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.contract.limits import RelayLimits
from kvrelay.contract.wire import CONTRACT_MARKER
from kvrelay.publication import cbi1
from kvrelay.publication.hub import PublicationHub, Subscription
from kvrelay.publication.splice import FilterUpdateEncoder
from kvrelay.service.server import RelayServer

SVC = "/dynamo.kvrelay.v1.KvEventRelay/"
RELAY = pb.RelayIdentity(drt_instance_id=3, relay_incarnation=0x0BE1)


class _Plane:
    def __init__(self, msg: Any) -> None:
        self._msg = msg

    def current(self) -> tuple[int, Any]:
        return 0, self._msg

    async def wait_newer(self, version: int) -> tuple[int, Any]:
        await asyncio.Event().wait()
        raise AssertionError


def _producer(i: int, buckets: int) -> pb.ProducerIdentity:
    return pb.ProducerIdentity(
        pool_id=pb.KvPoolId(identity_version=1, indexer_domain=pb.IndexerDomainId(
            cache_semantics=pb.DigestIdentity(digest=b"C" * 16, source=1),
            routing_scope=pb.DigestIdentity(digest=i.to_bytes(16, "big"), source=1)),
            dc_id=11),
        producer_incarnation=5, layout_generation=1,
        ckf_format=pb.CkfFormat(format_version=1, seed=0x5EED, bucket_count=buckets,
                                fingerprint_bits=16, slots_per_bucket=4),
    )  # fmt: skip


class LanesView:
    """``RelayView`` of ``lanes`` publication hubs (one lane each), published by ``step``."""

    def __init__(self, lanes: int, buckets: int, limits: RelayLimits) -> None:
        rng = np.random.default_rng(7)
        self.relay_identity = RELAY
        self.catalog = _Plane(pb.KvPoolCatalogUpdate())
        self.readiness = _Plane(pb.ServingReadinessUpdate())
        self.load = _Plane(pb.KvPoolLoadUpdate())
        self.serving_load = _Plane(pb.ServingLoadUpdate())
        self.producers = [_producer(i, buckets) for i in range(lanes)]
        self.hubs: dict[bytes, PublicationHub] = {}
        for p in self.producers:
            table = rng.integers(0, 2**64, size=buckets, dtype=np.uint64)
            self.hubs[bytes(p)] = PublicationHub(
                FilterUpdateEncoder(RELAY, p), seed=0x5EED, bucket_count=buckets, dc_id=11,
                table=table, sequence=0, limits=limits,
            )  # fmt: skip
        self._rng = rng
        self.buckets = buckets

    async def open_pool(
        self, expected: pb.ProducerIdentity, on_release: Callable[[], None] | None = None
    ) -> Subscription:
        return await self.hubs[bytes(expected)].subscribe(on_release)

    def step(self) -> None:
        for hub in self.hubs.values():
            b = self._rng.choice(self.buckets, size=8, replace=False).astype(np.uint32)
            w = self._rng.integers(1, 2**63, size=8, dtype=np.uint64)
            hub.publish(hub.sequence + 1, b, w)


async def run(lanes: int, mib: int, rate: float, window_kib: int) -> dict[str, Any]:
    buckets = mib * (1 << 17)
    limits = RelayLimits()
    view = LanesView(lanes, buckets, limits)
    server = RelayServer(view, limits)  # type: ignore[arg-type]
    await server.start("127.0.0.1", 0)
    window = window_kib * 1024
    ch = Channel("127.0.0.1", server.port, config=Configuration(
        http2_connection_window_size=window, http2_stream_window_size=window))  # fmt: skip
    received = [0]
    done: dict[int, float] = {}
    errors: dict[int, str] = {}
    t0 = time.monotonic()

    async def traffic() -> None:
        while True:
            view.step()
            await asyncio.sleep(1.0 / rate)

    async def follow(i: int, producer: pb.ProducerIdentity) -> None:
        hub = view.hubs[bytes(producer)]
        installed: int | None = None
        req = pb.SubscribeKvPoolRequest(subscriber_id=f"lane-{i}", expected_producer=producer,
                                        contract_marker=CONTRACT_MARKER)  # fmt: skip
        try:
            async with ch.request(SVC + "SubscribeKvPool", Cardinality.UNARY_STREAM,
                                  pb.SubscribeKvPoolRequest, pb.FilterUpdate) as st:  # fmt: skip
                await st.send_message(req, end=True)
                chunks = 0
                while (fu := await st.recv_message()) is not None:
                    if int(fu.kind) == int(pb.FilterUpdateKind.SNAPSHOT_CHUNK):
                        received[0] += len(fu.payload)
                        chunks += 1
                        if chunks == cbi1.chunk_count_for(buckets):
                            installed = fu.sequence
                    elif int(fu.kind) == int(pb.FilterUpdateKind.DELTA):
                        installed = fu.sequence
                    if installed is not None and installed >= hub.sequence - 1:
                        done[i] = time.monotonic() - t0
                        await st.cancel()
                        return
        except Exception as exc:  # lagged, timed out
            errors[i] = f"{type(exc).__name__}: {exc}"

    pump = asyncio.ensure_future(traffic())
    try:
        await asyncio.wait_for(asyncio.gather(*(follow(i, p) for i, p in
                                                enumerate(view.producers))), 600)  # fmt: skip
    finally:
        pump.cancel()
        ch.close()
        await server.close(grace_s=1.0)
    one = sum(len(x) for x in cbi1.encode_snapshot_chunks(
        np.zeros(buckets, dtype=np.uint64), seed=0x5EED, bucket_count=buckets, dc_id=11, epoch=0))
    times = sorted(done.values())
    return {
        "lanes": lanes, "lane_mib": mib, "deltas_per_s_per_lane": rate,
        "client_window_kib": window_kib, "completed": len(done), "errors": errors,
        "bytes_ratio": round(received[0] / (lanes * one), 3),
        "complete_s": {"first": round(times[0], 2) if times else None,
                       "last": round(times[-1], 2) if times else None},
        "recuts": sum(h.recuts for h in view.hubs.values()),
        "lagged": sum(h.lagged for h in view.hubs.values()),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--lanes", type=int, default=32)
    ap.add_argument("--mib", type=int, default=4)
    ap.add_argument("--deltas-per-s", type=float, default=200.0)
    ap.add_argument("--window-kib", type=int, default=1024)
    ap.add_argument("--smoke", action="store_true", help="4 lanes of 1 MiB, to .work/smoke")
    a = ap.parse_args(argv)
    if a.smoke:
        a.lanes, a.mib = 4, 1
    out = results_dir(a.smoke)
    out.mkdir(parents=True, exist_ok=True)
    res = {"benchmark": "one_channel", "machine": machine(),
           "result": asyncio.run(run(a.lanes, a.mib, a.deltas_per_s, a.window_kib))}  # fmt: skip
    write_json(out / "one_channel.json", res)
    r = res["result"]
    md = (
        "# Many lanes joined at once on one connection, under traffic\n\n"
        f"Machine: {res['machine']}\n\n"
        "| lanes x MiB | deltas/s per lane | completed | snapshot bytes received / sent once "
        "| first / last complete s | re-cut at turn | lagged |\n"
        "|---|---:|---:|---:|---|---:|---:|\n"
        f"| {r['lanes']} x {r['lane_mib']} | {r['deltas_per_s_per_lane']:.0f} | "
        f"{r['completed']}/{r['lanes']} | {r['bytes_ratio']} | {r['complete_s']['first']} / "
        f"{r['complete_s']['last']} | {r['recuts']} | {r['lagged']} |\n"
    )
    (out / "one_channel.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
