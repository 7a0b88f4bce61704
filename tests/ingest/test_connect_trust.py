"""Connect mode against a hostile publisher on another loopback address (127.0.0.2).

Real ZMQ sockets: the bound SUB on 127.0.0.1, the real engine's PUB connecting from 127.0.0.1,
the hostile one from 127.0.0.2 (``tcp://SOURCE:0;HOST:PORT``). The oracle is what each publisher
sent: the sink must see exactly the real engine's batches, in order, and no reset it did not
cause.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import zmq.asyncio

from kvrelay.ingest.connect import ConnectSource
from tests.ingest.test_connect import Pub, Sink, ctx, payload, source  # noqa: F401 (fixture)
from tests.support import vllm_wire as W
from tests.support.vllm_publisher import until

HOSTILE = "127.0.0.2"


async def _pub(
    c: zmq.asyncio.Context, src: ConnectSource, topic: bytes, from_addr: str = "127.0.0.1"
) -> Pub:
    host_port = src.endpoints[0].removeprefix("tcp://")
    p = Pub(c, f"tcp://{from_addr}:0;{host_port}", topic)
    await p.ready()
    return p


def _store(hashes: range) -> Any:
    """A store of ``len(hashes)`` chained blocks of 4 tokens (the source's kv_block_size)."""
    return W.stored("map", block_hashes=list(hashes), token_ids=list(range(4 * len(hashes))),
                    block_size=4)  # fmt: skip


async def _settle(src: ConnectSource, sent: int) -> None:
    await until(lambda: src.counters.messages >= sent)


async def test_a_hostile_peer_cannot_reset_or_feed_a_members_topic(
    ctx: zmq.asyncio.Context,  # noqa: F811
) -> None:
    sink = Sink()
    src = await source(ctx, sink)
    try:
        real = await _pub(ctx, src, b"kv@pod-a@m")
        hostile = await _pub(ctx, src, b"kv@pod-a@m", HOSTILE)
        for _ in range(3):
            await real.send(tag=1)
        await _settle(src, 3)
        # the same topic from another address: a lower sequence (would reset), the next one
        # (would be applied), a gap (would reset)
        await hostile.send(seq=0, tag=9)
        await hostile.send(seq=3, tag=9)
        await hostile.send(seq=100, tag=9)
        await real.send(tag=1)
        await _settle(src, 7)
        assert sink.batches() == [("pod-a", 0, s) for s in range(4)]
        assert sink.of("reset") == []
        assert src.counters.address_mismatch == 3
    finally:
        await src.stop()


async def test_the_allow_list_drops_other_addresses_before_any_member_exists(
    ctx: zmq.asyncio.Context,  # noqa: F811
) -> None:
    sink = Sink()
    src = await source(ctx, sink, allow=("127.0.0.1/32",))
    try:
        hostile = await _pub(ctx, src, b"kv@ghost@m", HOSTILE)
        for i in range(50):  # fifty made-up members, none admitted
            await hostile.send(topic=f"kv@ghost-{i}@m".encode(), seq=0)
        real = await _pub(ctx, src, b"kv@pod-a@m")
        await real.send()
        await _settle(src, 51)
        assert src.counters.peer_refused == 50 and src.counters.members_added == 1
        assert len(src) == 1 and sink.batches() == [("pod-a", 0, 0)]
        assert len(src._topics) == 1  # nothing cached for the refused topics either
    finally:
        await src.stop()


async def test_pinned_addresses_win_over_the_first_claimant(
    ctx: zmq.asyncio.Context,  # noqa: F811
) -> None:
    sink = Sink()
    src = await source(ctx, sink, addresses=(("pod-a", ("127.0.0.1",)),))
    try:
        hostile = await _pub(ctx, src, b"kv@pod-a@m", HOSTILE)
        await hostile.send()  # first, but not from pod-a's address
        real = await _pub(ctx, src, b"kv@pod-a@m")
        await real.send()
        await _settle(src, 2)
        assert sink.batches() == [("pod-a", 0, 0)] and src.counters.address_mismatch == 1
    finally:
        await src.stop()


async def test_caps_on_topic_length_batch_size_and_member_blocks(
    ctx: zmq.asyncio.Context,  # noqa: F811
) -> None:
    sink = Sink()
    src = await source(ctx, sink, max_topic_bytes=64, max_batch_bytes=4096, max_member_blocks=8)
    try:
        p = await _pub(ctx, src, b"kv@pod-a@m")
        await p.send(topic=b"kv@" + b"x" * 100 + b"@m", seq=0)  # too long: never matched
        await p.send(W.batch([_store(range(1, 7))]))  # 6 blocks
        await p.send(W.batch([W.removed("map", [1, 2])]))  # 4 held
        await p.send(W.batch([_store(range(10, 15))]))  # 9 > 8
        await p.send(b"\x00" * 5000)  # over max_batch_bytes
        await _settle(src, 5)
        c = src.counters
        assert (c.topic_too_long, c.member_block_cap, c.batch_too_large) == (1, 1, 1)
        assert len(src._topics) == 1
        resets: list[Any] = sink.of("reset")
        assert [r[:2] for r in resets] == [("pod-a", 0), ("pod-a", 0)]
        assert [b[2] for b in sink.batches()] == [1, 2, 3]  # seq 0 was the dropped topic
    finally:
        await src.stop()


async def test_a_curve_socket_takes_only_publishers_that_encrypt_to_it(
    ctx: zmq.asyncio.Context,  # noqa: F811
) -> None:
    server_public, server_secret = zmq.curve_keypair()
    sink = Sink()
    src = await source(ctx, sink, curve_secret_key=server_secret.decode())
    try:
        c_public, c_secret = zmq.curve_keypair()
        curve = Pub.__new__(Pub)
        curve.topic, curve.seq = b"kv@pod-a@m", 0
        curve.sock = ctx.socket(zmq.XPUB)
        curve.sock.setsockopt(zmq.LINGER, 0)
        curve.sock.curve_serverkey = server_public
        curve.sock.curve_publickey, curve.sock.curve_secretkey = c_public, c_secret
        curve.sock.connect(src.endpoints[0])
        await curve.ready()
        plain = Pub(ctx, src.endpoints[0], b"kv@pod-b@m")  # no CURVE: the handshake fails
        await curve.send()
        for _ in range(3):
            await plain.send()
        await curve.send()
        await until(lambda: len(sink.batches()) == 2)
        assert sink.batches() == [("pod-a", 0, 0), ("pod-a", 0, 1)]
        assert src.counters.messages == 2 and len(src) == 1
        plain.sock.close(linger=0)
        curve.sock.close(linger=0)
    finally:
        await src.stop()


def test_check_config_reads_the_curve_key_and_the_allow_list(tmp_path: Path) -> None:
    from kvrelay.ops.config import check_file

    def check(extra: str) -> list[tuple[str, str]]:
        p = tmp_path / "kvrelay.toml"
        p.write_text(
            '[relay]\ndc_name = "dc"\n[[pools]]\nnamespace = "ns"\ncomponent = "c"\n'
            'endpoint = "e"\nmodel = "m"\nkv_block_size = 16\n[pools.connect]\n'
            'bind = "tcp://127.0.0.1:5557"\ntopic_pattern = "kv@{engine}@{model}"\n' + extra
        )
        _cfg, problems = check_file(p, env={})
        return [(q.path, q.severity) for q in problems
                if q.severity == "error" and q.path.startswith("pools[0].connect")]  # fmt: skip

    good = tmp_path / "curve.key"
    good.write_text(zmq.curve_keypair()[1].decode() + "\n")
    bad = tmp_path / "bad.key"
    bad.write_text("not a key\n")
    assert check(f'curve_secret_key_file = "{good}"\nallow = ["10.0.0.0/24", "::1"]\n') == []
    assert check(f'curve_secret_key_file = "{bad}"\n') == [
        ("pools[0].connect.curve_secret_key_file", "error")
    ]
    assert check('allow = ["10.0.0.300"]\n') == [("pools[0].connect.allow", "error")]
    assert check('[pools.connect.addresses]\n"pod-a" = ["nope"]\n') == [
        ("pools[0].connect.addresses.pod-a", "error")
    ]


async def test_a_frame_far_over_max_batch_bytes_is_never_received(
    ctx: zmq.asyncio.Context,  # noqa: F811
) -> None:
    """libzmq would take in a frame of any size before the relay sees it (or its sender's
    address): one more than 1 MiB over ``max_batch_bytes`` ends that publisher's connection at
    its header instead (the publisher connects again), so a peer cannot make the relay hold
    gigabytes. A payload just over the bound is still received, counted and dropped."""
    sink = Sink()
    src = await source(ctx, sink, max_batch_bytes=4096)
    try:
        p = await _pub(ctx, src, b"kv@pod-a@m")
        await p.send(b"\x00" * (4096 + 3 * 1024 * 1024))  # never received
        deadline = 50
        while src.counters.messages == 0 and deadline:  # the publisher reconnects
            await p.send()
            await asyncio.sleep(0.1)
            deadline -= 1
        await _settle(src, 1)
        assert src.counters.batch_too_large == 0
        await p.send(b"\x00" * 5000)  # just over: received, counted, dropped
        await until(lambda: src.counters.batch_too_large == 1)
    finally:
        await src.stop()
