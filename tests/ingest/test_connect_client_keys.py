"""Connect mode: CURVE publishers authenticated by their own public keys (``curve_client_keys``).

The socket's CURVE public key is no secret (every engine is given it): a stranger with a keypair
of its own encrypted to it, passed CURVE, published phantom blocks and took engines' topics.
Real CURVE sockets here: pyzmq publishers with keypairs of their own against a ``ConnectSource``;
the stranger connects from another loopback address (127.0.0.2), so that a topic it took first
would bind the engine to its address and drop the real engine's messages (``address_mismatch``).
"""

from __future__ import annotations

import asyncio

import pytest
import structlog
import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from kvrelay.ingest import zap
from kvrelay.ingest.connect import ConnectSource, ConnectSpec
from kvrelay.ingest.topic_pattern import TopicPattern
from tests.ingest.test_connect import Pub, Sink, ctx, source  # noqa: F401 (fixture)
from tests.ingest.test_connect_trust import HOSTILE
from tests.support.vllm_publisher import until

Keypair = tuple[bytes, bytes]


def _curve_pub(
    c: zmq.asyncio.Context, src: ConnectSource, server_public: bytes, keys: Keypair,
    topic: bytes, from_addr: str = "127.0.0.1",
) -> Pub:  # fmt: skip
    """A CURVE publisher with its own keypair, encrypting to the socket's public key."""
    p = Pub.__new__(Pub)
    p.topic, p.seq = topic, 0
    p.sock = c.socket(zmq.XPUB)
    p.sock.setsockopt(zmq.LINGER, 0)
    p.sock.curve_serverkey = server_public
    p.sock.curve_publickey, p.sock.curve_secretkey = keys
    host_port = src.endpoints[0].removeprefix("tcp://")
    p.sock.connect(f"tcp://{from_addr}:0;{host_port}")
    return p


async def _keyed_source(
    c: zmq.asyncio.Context, sink: Sink, secret: bytes, *listed: Keypair,
    allow: tuple[str, ...] = (),
) -> ConnectSource:  # fmt: skip
    return await source(
        c, sink, curve_secret_key=secret.decode(), allow=allow,
        curve_client_keys=tuple(k[0].decode() for k in listed),
    )  # fmt: skip


async def test_a_listed_key_gets_in_and_a_stranger_with_its_own_keypair_does_not(
    ctx: zmq.asyncio.Context,  # noqa: F811
) -> None:
    """The stranger knows the socket's public key and encrypts to it, and publishes the
    engine's topic before the engine does: refused at its handshake (counted, logged reason
    ``client_key``), it never gets the subscription, makes no member and binds no topic, so the
    engine's own batches are all applied."""
    server_public, server_secret = zmq.curve_keypair()
    engine_keys, stranger_keys = zmq.curve_keypair(), zmq.curve_keypair()
    sink = Sink()
    src = await _keyed_source(ctx, sink, server_secret, engine_keys)
    try:
        with structlog.testing.capture_logs() as logs:
            stranger = _curve_pub(
                ctx, src, server_public, stranger_keys, b"kv@pod-a@m", HOSTILE
            )
            await until(lambda: src.counters.connections_key_refused >= 1)
        (line,) = [e for e in logs if e["event"] == "connect_handshake_refused"]
        assert (line["reason"], line["address"], line["client_key"]) == (
            "client_key", HOSTILE, stranger_keys[0].decode()
        )  # fmt: skip
        for s in range(3):  # queued at best: nothing passes a refused handshake
            await stranger.send(seq=s, tag=9)
        assert not await stranger.sock.poll(200)  # no subscription ever reaches it
        engine = _curve_pub(ctx, src, server_public, engine_keys, b"kv@pod-a@m")
        await engine.ready()
        for _ in range(3):
            await engine.send(tag=1)
        await until(lambda: len(sink.batches()) == 3)
        assert sink.batches() == [("pod-a", 0, s) for s in range(3)]
        c = src.counters
        assert (c.messages, c.address_mismatch, c.members_added, len(src)) == (3, 0, 1, 1)
        assert c.connections_refused == 0 and c.connections_over_limit == 0
        assert src._owners == {"pod-a": "127.0.0.1"}  # the engine's address, not the stranger's
        for p in (stranger, engine):
            p.sock.close(linger=0)
    finally:
        await src.stop()


async def test_a_refused_keys_connection_is_closed_at_once(
    ctx: zmq.asyncio.Context,  # noqa: F811
) -> None:
    """Refused with ``zap.CLOSE`` (an unlisted key, as an address outside ``allow``): libzmq
    closes the connection on the spot, not at the handshake's time (10 s), so the publisher
    connects again within its reconnect interval (100 ms) and is refused again, counted each
    time. (Three strangers: libzmq keeps the odd refused connection until that time.)"""
    server_public, server_secret = zmq.curve_keypair()
    src = await _keyed_source(ctx, Sink(), server_secret, zmq.curve_keypair())
    strangers, monitors = [], []
    try:
        for _ in range(3):
            p = _curve_pub(ctx, src, server_public, zmq.curve_keypair(), b"kv@x@m")
            strangers.append(p)
            monitors.append(p.sock.get_monitor_socket(zmq.EVENT_CONNECTED))
        connects = 0

        async def count() -> None:
            nonlocal connects
            while True:
                for m in monitors:
                    while await m.poll(0):
                        await recv_monitor_message(m)
                        connects += 1
                await asyncio.sleep(0.01)

        counting = asyncio.create_task(count())
        try:
            # each stranger's first connection, and at least three more: connections closed in
            # well under the handshake time
            await until(lambda: connects >= 6, timeout=4.0)
        finally:
            counting.cancel()
        assert src.counters.connections_key_refused >= 3
        assert src.counters.messages == 0 and len(src) == 0
        verdict = src._decide(zap.Request("d", "127.0.0.1", "CURVE", (zmq.curve_keypair()[0],)))
        assert verdict[0] == zap.CLOSE
    finally:
        for p in strangers:
            p.sock.disable_monitor()
            p.sock.close(linger=0)
        for m in monitors:
            m.close(linger=0)
        await src.stop()


async def test_allow_and_the_client_keys_both_apply(
    ctx: zmq.asyncio.Context,  # noqa: F811
) -> None:
    """A listed key from an address outside ``allow`` is refused by the address; an unlisted key
    from an admitted address by the key; only a listed key from an admitted address gets in."""
    server_public, server_secret = zmq.curve_keypair()
    listed, unlisted = zmq.curve_keypair(), zmq.curve_keypair()
    sink = Sink()
    src = await _keyed_source(ctx, sink, server_secret, listed, allow=("127.0.0.1/32",))
    pubs: list[Pub] = []
    try:
        pubs.append(_curve_pub(ctx, src, server_public, listed, b"kv@pod-b@m", HOSTILE))
        await until(lambda: src.counters.connections_refused >= 1)
        pubs.append(_curve_pub(ctx, src, server_public, unlisted, b"kv@pod-c@m"))
        await until(lambda: src.counters.connections_key_refused >= 1)
        good = _curve_pub(ctx, src, server_public, listed, b"kv@pod-a@m")
        pubs.append(good)
        await good.ready()
        await good.send()
        await until(lambda: len(sink.batches()) == 1)
        for p in pubs[:2]:
            assert not await p.sock.poll(100)
        assert sink.batches() == [("pod-a", 0, 0)] and src.counters.messages == 1
    finally:
        for p in pubs:
            p.sock.close(linger=0)
        await src.stop()


def test_without_a_listed_curve_key_nothing_is_admitted() -> None:
    """The handler's own answer: a listed key passes, another key or a handshake that is not
    CURVE (it cannot reach a CURVE socket's handler, but fails closed if it did) is refused; and
    client keys on a socket that is not CURVE are refused outright."""
    server_secret = zmq.curve_keypair()[1].decode()
    listed = zmq.curve_keypair()[0]
    spec = ConnectSpec(
        bind=("tcp://127.0.0.1:0",), pattern=TopicPattern("kv@{engine}"), kv_block_size=4,
        curve_secret_key=server_secret, curve_client_keys=(listed.decode(),),
    )  # fmt: skip
    src = ConnectSource(spec, Sink())
    from zmq.utils import z85

    raw = z85.decode(listed)
    assert src._decide(zap.Request("d", "10.0.0.1", "CURVE", (raw,))) == (200, "OK")
    other = z85.decode(zmq.curve_keypair()[0])
    for req in (
        zap.Request("d", "10.0.0.1", "CURVE", (other,)),
        zap.Request("d", "10.0.0.1", "CURVE", ()),
        zap.Request("d", "10.0.0.1", "NULL", ()),
        zap.Request("d", "10.0.0.1", "PLAIN", (raw,)),
    ):
        assert src._decide(req)[0] == zap.CLOSE, req
    assert src.counters.connections_key_refused == 4
    with pytest.raises(ValueError, match="CURVE secret key"):
        ConnectSource(
            ConnectSpec(bind=("tcp://127.0.0.1:0",), pattern=TopicPattern("kv@{engine}"),
                        kv_block_size=4, curve_client_keys=(listed.decode(),)),
            Sink(),
        )  # fmt: skip


async def test_a_socket_whose_counters_carry_earlier_refusals_still_counts_its_failures(
    ctx: zmq.asyncio.Context,  # noqa: F811
) -> None:
    """A re-bound (or restarted) socket takes the pool's counters as they were, refusals
    included. Failures are matched with this socket's own refusals, not the counters': matched
    with the carried ones, each failure was taken for a refusal and never counted."""
    from kvrelay.ingest.connect import SETTLE_S, ConnectCounters

    carried = ConnectCounters(connections_refused=5, connections_over_limit=2,
                              connections_key_refused=3)  # fmt: skip
    spec = ConnectSpec(
        bind=("tcp://127.0.0.1:0",), pattern=TopicPattern("kv@{engine}@{model}"),
        kv_block_size=4, model="m", allow=("127.0.0.1",),
    )  # fmt: skip
    src = ConnectSource(spec, Sink(), carried, context=ctx, handshake_s=0.3)
    await src.start()
    try:
        host, port = src.endpoints[0].removeprefix("tcp://").rsplit(":", 1)
        _r, silent = await asyncio.open_connection(host, int(port))  # says nothing: unfinished
        await until(lambda: src.counters.handshakes_failed_unfinished == 1, timeout=4 * SETTLE_S)
        silent.close()
        c = src.counters
        assert (c.connections_refused, c.connections_over_limit, c.connections_key_refused) == (
            5, 2, 3
        )  # fmt: skip
    finally:
        await src.stop()


async def test_a_key_bound_to_engines_publishes_them_alone_and_only_them(
    ctx: zmq.asyncio.Context,  # noqa: F811
) -> None:
    """``engines=`` in the client keys file ties a key to engine names: a listed key could
    publish as any engine (phantom engines, or a real engine's topic taken first). Now a
    message naming an engine bound to another key, or one the sender's bound key does not name,
    is dropped and counted (``key_mismatch``, logged with the key); a key bound to nothing may
    publish any engine no key is bound to. All from one address: the address binding cannot
    tell them apart."""
    server_public, server_secret = zmq.curve_keypair()
    a_keys, b_keys = zmq.curve_keypair(), zmq.curve_keypair()
    sink = Sink()
    src = await source(
        ctx, sink, curve_secret_key=server_secret.decode(),
        curve_client_keys=(a_keys[0].decode(), b_keys[0].decode()),
        curve_key_engines=((a_keys[0].decode(), ("pod-a",)),),
    )  # fmt: skip
    pubs = []
    try:
        with structlog.testing.capture_logs() as logs:
            b_as_a = _curve_pub(ctx, src, server_public, b_keys, b"kv@pod-a@m")
            pubs.append(b_as_a)
            await b_as_a.ready()
            for _ in range(2):
                await b_as_a.send(tag=9)
            await until(lambda: src.counters.key_mismatch == 2)
        (line,) = [e for e in logs if e["event"] == "connect_key_mismatch"]
        assert (line["engine"], line["client_key"]) == ("pod-a", b_keys[0].decode())
        a_as_b = _curve_pub(ctx, src, server_public, a_keys, b"kv@pod-b@m")
        a = _curve_pub(ctx, src, server_public, a_keys, b"kv@pod-a@m")
        b = _curve_pub(ctx, src, server_public, b_keys, b"kv@pod-b@m")
        pubs += [a_as_b, a, b]
        for p in (a_as_b, a, b):
            await p.ready()
        await a_as_b.send(tag=9)
        await until(lambda: src.counters.key_mismatch == 3)
        for p in (a, b):
            for _ in range(2):
                await p.send(tag=1)
        await until(lambda: len(sink.batches()) == 4)
        assert sorted(sink.batches()) == [("pod-a", 0, 0), ("pod-a", 0, 1), ("pod-b", 0, 0),
                                          ("pod-b", 0, 1)]  # fmt: skip
        c = src.counters
        assert (c.key_mismatch, c.address_mismatch, c.members_added) == (3, 0, 2)
    finally:
        for p in pubs:
            p.sock.close(linger=0)
        await src.stop()
