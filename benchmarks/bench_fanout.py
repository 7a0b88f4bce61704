"""Fan-out benchmark: server CPU per delivered FilterUpdate and subscribe→snapshot latency.

The relay server (RelayServer + PublicationHub over a minimal in-memory view) runs in a child
process so its CPU time (`time.process_time`, all threads) is measured apart from the clients.
Clients are grpclib streams in the parent reading raw bytes (no protobuf decode per frame).

Targets: ≤ 10 µs server CPU per delivered frame; ≤ 20 ms subscribe → snapshot complete for a
4 MiB (524,288-bucket) lane, over loopback.

    .venv/bin/python -m benchmarks.bench_fanout [--subscribers 16] [--deltas 3000] [--smoke]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
from grpclib.client import Channel
from grpclib.config import Configuration
from grpclib.const import Cardinality

from benchmarks._common import machine, results_dir
from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.client.codec import RawCodec

PATH = "/dynamo.kvrelay.v1.KvEventRelay/SubscribeKvPool"
MARKER = 0x4B565231
LANE = 524_288
BURST = 8


def producer_identity() -> pb.ProducerIdentity:
    return pb.ProducerIdentity(
        pool_id=pb.KvPoolId(
            identity_version=1,
            indexer_domain=pb.IndexerDomainId(
                cache_semantics=pb.DigestIdentity(digest=b"c" * 16, source=1),
                routing_scope=pb.DigestIdentity(digest=b"r" * 16, source=1),
            ),
            dc_id=356084303347317832,
        ),
        producer_incarnation=12345,
        layout_generation=1,
        ckf_format=pb.CkfFormat(
            format_version=1,
            seed=0x5DEECE66D1B54A33,
            bucket_count=LANE,
            fingerprint_bits=16,
            slots_per_bucket=4,
        ),
    )


# ------------------------------------------------------------------ server process
def server_main(conn: Connection) -> None:
    import os

    if os.environ.get("BENCH_PROFILE"):  # cProfile the server process (diagnostics only)
        import cProfile

        cProfile.runctx("asyncio.run(_server(conn))", globals(), {"conn": conn},
                        os.environ["BENCH_PROFILE"])
        return
    asyncio.run(_server(conn))


async def _server(conn: Connection) -> None:
    from kvrelay.contract.errors import RelayError
    from kvrelay.publication.hub import PublicationHub, Subscription
    from kvrelay.publication.plane import PlaneClosed
    from kvrelay.publication.splice import FilterUpdateEncoder
    from kvrelay.service.server import RelayServer

    class Plane:
        def __init__(self, msg: Any) -> None:
            self.msg = msg

        def current(self) -> tuple[int, Any]:
            return 0, self.msg

        async def wait_newer(self, version: int) -> tuple[int, Any]:
            await asyncio.Event().wait()
            raise PlaneClosed()

    relay = pb.RelayIdentity(drt_instance_id=1, relay_incarnation=2)
    producer = producer_identity()
    table = np.random.default_rng(0).integers(0, 2**64, size=LANE, dtype=np.uint64)
    seq = 0
    hub_box: list[PublicationHub] = []

    def the_hub() -> PublicationHub:
        if not hub_box:
            hub_box.append(
                PublicationHub(
                    FilterUpdateEncoder(relay, producer),
                    seed=0x5DEECE66D1B54A33,
                    bucket_count=LANE,
                    dc_id=356084303347317832,
                    table=table,
                    sequence=seq,
                )
            )
        return hub_box[0]

    class View:
        relay_identity = relay
        catalog = Plane(
            pb.KvPoolCatalogUpdate(protocol_version=1, relay=relay, contract_marker=MARKER)
        )
        readiness = Plane(
            pb.ServingReadinessUpdate(protocol_version=1, relay=relay, contract_marker=MARKER)
        )
        load = Plane(pb.KvPoolLoadUpdate(protocol_version=1, relay=relay, contract_marker=MARKER))
        serving_load = Plane(
            pb.ServingLoadUpdate(protocol_version=1, relay=relay, contract_marker=MARKER)
        )

        async def open_pool(
            self, expected: pb.ProducerIdentity, on_release: Any = None
        ) -> Subscription:
            if bytes(expected) != bytes(producer):
                raise RelayError.producer_changed()
            return await the_hub().subscribe(on_release)

    server = RelayServer(View())  # type: ignore[arg-type]
    await server.start("127.0.0.1", 0)
    conn.send(server.port)
    loop = asyncio.get_running_loop()
    rng = np.random.default_rng(1)
    while True:
        cmd, arg = await loop.run_in_executor(None, conn.recv)
        if cmd == "stop":
            break
        if cmd == "cpu":
            conn.send(time.process_time())
        elif cmd == "publish":  # (count, images, interval_s)
            count, images, interval = arg
            hub = the_hub()
            batches = []  # generated up front: producer-side RNG is not server work
            for _ in range(count):
                b = np.unique(rng.integers(0, LANE, size=images)).astype(np.uint32)
                batches.append((b, rng.integers(0, 2**64, size=b.size, dtype=np.uint64)))
            t0 = time.process_time()
            next_t = loop.time()
            for i, (b, w) in enumerate(batches):
                seq += 1
                table[b] = w
                hub.publish(seq, b, w)
                if i % BURST == BURST - 1:  # bursts of 8 deltas per tick
                    next_t += interval * BURST
                    await asyncio.sleep(max(0.0, next_t - loop.time()))
            await asyncio.sleep(0.3)  # let the streams drain
            conn.send((time.process_time() - t0, hub.lagged))
    await server.close(grace_s=1.0)


# ------------------------------------------------------------------ clients
def channel(port: int) -> Channel:
    return Channel(
        "127.0.0.1",
        port,
        codec=RawCodec(),
        config=Configuration(
            http2_connection_window_size=16 * 1024 * 1024, http2_stream_window_size=8 * 1024 * 1024
        ),
    )


async def fanout(
    port: int, conn: Connection, n_subs: int, deltas: int, images: int, interval: float
) -> dict[str, Any]:
    req = bytes(
        pb.SubscribeKvPoolRequest(
            subscriber_id="bench", expected_producer=producer_identity(), contract_marker=MARKER
        )
    )
    channels = [channel(port) for _ in range(max(1, n_subs // 8))]
    counts = [0] * n_subs
    streams = []
    cms = []
    for i in range(n_subs):
        cm = channels[i % len(channels)].request(PATH, Cardinality.UNARY_STREAM, bytes, bytes)
        st = await cm.__aenter__()
        await st.send_message(req, end=True)
        await st.recv_message()  # the snapshot chunk
        streams.append(st)
        cms.append(cm)

    async def reader(i: int) -> None:
        st = streams[i]
        while True:
            msg = await st.recv_message()
            if msg is None:
                return
            counts[i] += 1

    tasks = [asyncio.ensure_future(reader(i)) for i in range(n_subs)]
    loop = asyncio.get_running_loop()
    conn.send(("publish", (deltas, images, interval)))
    cpu_s, lagged = await loop.run_in_executor(None, conn.recv)
    for st, t, cm in zip(streams, tasks, cms, strict=True):
        t.cancel()
        await st.cancel()
        await cm.__aexit__(None, None, None)
    for ch in channels:
        ch.close()
    delivered = sum(counts)
    return {
        "subscribers": n_subs,
        "deltas": deltas,
        "images_per_delta": images,
        "publish_interval_ms": interval * 1000,
        "frames_delivered": delivered,
        "lagged_subscribers": lagged,
        "server_cpu_s": round(cpu_s, 4),
        "server_cpu_us_per_frame": round(cpu_s / max(delivered, 1) * 1e6, 2),
    }


async def snapshot_latency(port: int, conn: Connection, trials: int) -> dict[str, Any]:
    req = bytes(
        pb.SubscribeKvPoolRequest(
            subscriber_id="snap", expected_producer=producer_identity(), contract_marker=MARKER
        )
    )
    ch = channel(port)
    loop = asyncio.get_running_loop()
    cold: list[float] = []
    warm: list[float] = []
    for i in range(trials):
        if i % 2 == 0:  # invalidate the per-sequence snapshot cache → a fresh build
            conn.send(("publish", (1, 16, 0.0)))
            await loop.run_in_executor(None, conn.recv)
        t0 = time.perf_counter()
        async with ch.request(PATH, Cardinality.UNARY_STREAM, bytes, bytes) as st:
            await st.send_message(req, end=True)
            chunk = await st.recv_message()
            dt = time.perf_counter() - t0
            assert chunk is not None and len(chunk) > LANE * 8
            await st.cancel()
        (cold if i % 2 == 0 else warm).append(dt * 1000)
    ch.close()

    def summary(xs: list[float]) -> dict[str, float]:
        xs = sorted(xs)
        return {
            "median_ms": round(statistics.median(xs), 2),
            "p90_ms": round(xs[int(0.9 * (len(xs) - 1))], 2),
            "min_ms": round(xs[0], 2),
        }

    return {
        "lane_buckets": LANE,
        "trials": trials,
        "cold_build": summary(cold),
        "cached_snapshot": summary(warm),
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=server_main, args=(child,), daemon=True)
    proc.start()
    loop = asyncio.get_running_loop()
    port = await loop.run_in_executor(None, parent.recv)
    try:
        snap = await snapshot_latency(port, parent, args.snapshot_trials)
        fan = [
            await fanout(port, parent, n, args.deltas, args.images, args.interval_ms / 1000)
            for n in args.subscribers
        ]
    finally:
        parent.send(("stop", None))
        proc.join(10)
    return {"snapshot": snap, "fanout": fan}


def marginal_cost(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Split the per-frame CPU into the publication's fixed cost (encode, hub, timer wake-ups:
    paid once per delta whatever the subscriber count) and the cost of each extra delivered
    frame, from the runs with the fewest and the most subscribers (same deltas, same images)."""
    if len(rows) < 2:
        return None
    lo = min(rows, key=lambda r: r["subscribers"])
    hi = max(rows, key=lambda r: r["subscribers"])
    extra = hi["frames_delivered"] - lo["frames_delivered"]
    if extra <= 0:
        return None
    per_frame = (hi["server_cpu_s"] - lo["server_cpu_s"]) / extra * 1e6
    fixed = lo["server_cpu_s"] / lo["deltas"] * 1e6 - per_frame * lo["subscribers"]
    return {
        "between_subscribers": [lo["subscribers"], hi["subscribers"]],
        "cpu_us_per_extra_frame": round(per_frame, 2),
        "fixed_cpu_us_per_delta": round(fixed, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--subscribers", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--deltas", type=int, default=2000)
    ap.add_argument("--images", type=int, default=16)
    ap.add_argument("--interval-ms", type=float, default=1.0)
    ap.add_argument("--snapshot-trials", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, results to .work/smoke")
    args = ap.parse_args()
    if args.smoke:
        args.subscribers, args.deltas, args.snapshot_trials = [1, 2], 20, 2
    result = asyncio.run(run(args))
    result["targets"] = {"server_cpu_us_per_frame": 10.0, "snapshot_complete_ms": 20.0}
    result["marginal"] = marginal_cost(result["fanout"])
    import os

    result["machine"] = machine() | {"cpus": mp.cpu_count(), "loadavg_after": os.getloadavg()}
    out = results_dir(args.smoke) / "fanout.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    s = result["snapshot"]
    print(
        f"snapshot 4 MiB lane: cold median {s['cold_build']['median_ms']} ms "
        f"(p90 {s['cold_build']['p90_ms']}), cached median {s['cached_snapshot']['median_ms']} ms"
    )
    for f in result["fanout"]:
        print(
            f"fan-out {f['subscribers']:3d} subs: {f['frames_delivered']} frames, "
            f"server CPU {f['server_cpu_us_per_frame']} µs/frame, lagged {f['lagged_subscribers']}"
        )
    m = result["marginal"]
    if m is not None:
        print(
            f"marginal: {m['cpu_us_per_extra_frame']} µs per extra delivered frame, "
            f"{m['fixed_cpu_us_per_delta']} µs fixed per published delta"
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
