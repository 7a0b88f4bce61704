"""Checker process: one relay directly and a mirror of it, the same pool on both, compared.

Both streams feed the SDK's strict ``PoolReplica`` (every consumer rule of §4.7 and §5); the raw
frames are kept too. Prints ``SNAPSHOTS_DONE`` once both replicas are installed; on a line
``stop`` on stdin (or SIGTERM) it waits until both replicas reach one sequence, compares them,
and prints one JSON line: tables equal, delta frames identical per sequence, snapshot payloads
equal when both cut at one sequence, RelayInfo and catalog bytes equal, violations.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
from typing import Any

import numpy as np
from grpclib.client import Channel
from grpclib.const import Cardinality
from grpclib.exceptions import GRPCError

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.client.codec import RawCodec
from kvrelay.client.errors import ConsumerViolation
from kvrelay.client.replica import PoolReplica
from kvrelay.client.wire import parse_frame
from kvrelay.contract.wire import CONTRACT_MARKER

SVC = "/dynamo.kvrelay.v1.KvEventRelay/"


async def first(ch: Channel, method: str, request: Any, pred: Any, timeout: float) -> bytes:
    """The first message satisfying ``pred`` (retried while the relay is not up yet: a mirror
    listens only once it is synchronized with its upstream)."""
    async with asyncio.timeout(timeout):
        while True:
            try:
                async with ch.request(SVC + method, Cardinality.UNARY_STREAM, type(request),
                                      bytes) as st:  # fmt: skip
                    await st.send_message(request, end=True)
                    while (data := await st.recv_message()) is not None:
                        if pred(data):
                            await st.cancel()
                            return bytes(data)
            except (OSError, GRPCError):
                pass
            await asyncio.sleep(0.2)


async def info(ch: Channel) -> bytes:
    async with ch.request(SVC + "GetRelayInfo", Cardinality.UNARY_UNARY, pb.RelayInfoRequest,
                          bytes) as st:  # fmt: skip
        await st.send_message(pb.RelayInfoRequest(contract_marker=CONTRACT_MARKER), end=True)
        data = await st.recv_message()
        await st.recv_trailing_metadata()
    return bytes(data or b"")


def _no_ts(frame: bytes) -> tuple[Any, ...]:
    f = parse_frame(frame)
    return (*f[:5], *f[6:9], frame[: f.prefix])


class Side:
    def __init__(self, name: str, ch: Channel, producer: pb.ProducerIdentity,
                 relay: pb.RelayIdentity) -> None:  # fmt: skip
        self.name = name
        self.ch = ch
        self.replica = PoolReplica(producer, relay)
        self.frames: list[bytes] = []
        self.violation: str | None = None
        self.end: str | None = None
        self.installed = asyncio.Event()

    async def run(self, producer: pb.ProducerIdentity) -> None:
        req = pb.SubscribeKvPoolRequest(subscriber_id=f"check-{self.name}",
                                        expected_producer=producer,
                                        contract_marker=CONTRACT_MARKER)  # fmt: skip
        try:
            async with self.ch.request(SVC + "SubscribeKvPool", Cardinality.UNARY_STREAM,
                                       pb.SubscribeKvPoolRequest, bytes) as st:  # fmt: skip
                await st.send_message(req, end=True)
                while (data := await st.recv_message()) is not None:
                    self.frames.append(bytes(data))
                    try:
                        self.replica.feed(pb.FilterUpdate.parse(data))
                    except ConsumerViolation as v:
                        self.violation = v.reason
                        return
                    if self.replica.installed:
                        self.installed.set()
                self.end = "eof"
        except Exception as exc:
            self.end = f"{type(exc).__name__}: {exc}"
        finally:
            self.installed.set()


async def main(a: argparse.Namespace) -> dict[str, Any]:
    direct = Channel(a.host, a.direct, codec=RawCodec(8 << 20))
    mirror = Channel(a.host, a.mirror, codec=RawCodec(8 << 20))
    cat_req = pb.WatchKvPoolCatalogRequest(subscriber_id="check", contract_marker=CONTRACT_MARKER)

    def has_pool(data: bytes) -> bool:
        upd = pb.KvPoolCatalogUpdate.parse(data)
        return upd.snapshot is not None and bool(upd.snapshot.pools)

    cat_d = await first(direct, "WatchKvPoolCatalog", cat_req, has_pool, a.timeout)
    cat_m = await first(mirror, "WatchKvPoolCatalog", cat_req, has_pool, a.timeout)
    upd = pb.KvPoolCatalogUpdate.parse(cat_d)
    producer = upd.snapshot.pools[0].producer  # type: ignore[union-attr]
    assert producer is not None and upd.relay is not None
    sides = [Side("direct", direct, producer, upd.relay), Side("mirror", mirror, producer,
                                                                upd.relay)]  # fmt: skip
    tasks = [asyncio.ensure_future(s.run(producer)) for s in sides]
    await asyncio.wait_for(asyncio.gather(*(s.installed.wait() for s in sides)), a.timeout)
    print("SNAPSHOTS_DONE", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)

    async def stdin_stop() -> None:
        while line := await reader.readline():
            if line.strip() == b"stop":
                break
        stop.set()

    watcher = asyncio.ensure_future(stdin_stop())
    await stop.wait()
    watcher.cancel()
    for _ in range(200):  # settle: both at one sequence
        seqs = {s.replica.sequence for s in sides}
        if len(seqs) == 1 and None not in seqs:
            await asyncio.sleep(0.3)
            if {s.replica.sequence for s in sides} == seqs:
                break
        await asyncio.sleep(0.1)
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await t
    d, m = sides
    fd = [parse_frame(f) for f in d.frames]
    fm = [parse_frame(f) for f in m.frames]
    deltas_d = {f.sequence: b for f, b in zip(fd, d.frames, strict=True) if f.kind == 2}
    deltas_m = {f.sequence: b for f, b in zip(fm, m.frames, strict=True) if f.kind == 2}
    common = deltas_d.keys() & deltas_m.keys()
    snap_d = [f for f in fd if f.kind == 1]
    snap_m = [f for f in fm if f.kind == 1]
    same_cut = bool(snap_d and snap_m and snap_d[0].sequence == snap_m[0].sequence)
    tables_equal = (d.replica.table is not None and m.replica.table is not None
                    and bool(np.array_equal(d.replica.table, m.replica.table)))  # fmt: skip
    out = {
        "sequence": {"direct": d.replica.sequence, "mirror": m.replica.sequence},
        "tables_equal": tables_equal,
        "occupancy": d.replica.occupancy(),
        "frames": {"direct": len(d.frames), "mirror": len(m.frames)},
        "deltas_compared": len(common),
        # byte for byte; and with send_ts_us aside (a relay that stamps per stream, as
        # Dynamo's does, gives two direct subscribers different bytes for one delta)
        "deltas_identical_bytes": sum(deltas_d[s] == deltas_m[s] for s in common),
        "deltas_identical_but_send_ts": sum(_no_ts(deltas_d[s]) == _no_ts(deltas_m[s])
                                            for s in common),
        "snapshot_same_cut": same_cut,
        "snapshot_payloads_equal": same_cut and [f.payload for f in snap_d]
        == [f.payload for f in snap_m],
        "envelope_prefix_equal": bool(d.frames and m.frames)
        and d.frames[0][: fd[0].prefix] == m.frames[0][: fm[0].prefix],
        "relay_info_equal": await info(direct) == await info(mirror),
        "catalog_equal": cat_d == cat_m,
        "violations": {"direct": d.violation, "mirror": m.violation},
        "ends": {"direct": d.end, "mirror": m.end},
    }
    direct.close()
    mirror.close()
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--direct", type=int, required=True)
    p.add_argument("--mirror", type=int, required=True)
    p.add_argument("--timeout", type=float, default=90.0)
    res = asyncio.run(main(p.parse_args()))
    print(json.dumps(res), flush=True)
