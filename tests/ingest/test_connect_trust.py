"""Connect mode against a hostile publisher on another loopback address (127.0.0.2).

Real ZMQ sockets: the bound SUB on 127.0.0.1, the real engine's PUB connecting from 127.0.0.1,
the hostile one from 127.0.0.2 (``tcp://SOURCE:0;HOST:PORT``). The oracle is what each publisher
sent: the sink must see exactly the real engine's batches, in order, and no reset it did not
cause.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Any

import zmq.asyncio

from kvrelay.ingest import zap
from kvrelay.ingest.connect import ConnectSource, ConnectSpec
from kvrelay.ingest.sink import ResetReason
from kvrelay.ingest.topic_pattern import TopicPattern
from kvrelay.ingest.zmtp import GREETING
from tests.ingest.test_connect import Pub, Sink, ctx, payload, pub, source  # noqa: F401 (fixture)
from tests.support import vllm_wire as W
from tests.support.timing import scaled
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


async def test_the_allow_list_refuses_other_addresses_at_the_handshake(
    ctx: zmq.asyncio.Context,  # noqa: F811
) -> None:
    """A peer outside ``allow`` never finishes its handshake (the relay's ZAP handler refuses
    it): it never gets the subscription, nothing it could send is read, no member or topic is
    made; each refusal is counted. The per-message check stays as a second line."""
    sink = Sink()
    src = await source(ctx, sink, allow=("127.0.0.1/32",))
    try:
        host_port = src.endpoints[0].removeprefix("tcp://")
        hostile = Pub(ctx, f"tcp://{HOSTILE}:0;{host_port}", b"kv@ghost@m")
        real = await _pub(ctx, src, b"kv@pod-a@m")
        await until(lambda: src.counters.connections_refused >= 1)
        assert not await hostile.sock.poll(200)  # refused: no subscription ever reaches it
        await real.send()
        await _settle(src, 1)
        c = src.counters
        assert (c.messages, c.peer_refused, c.members_added) == (1, 0, 1)
        assert src.connections == 1  # the refused peer does not count against the limit
        # the second line: a message from an outside address that got past the handshake
        src._on_message([b"kv@ghost@m", bytes(8), payload(9, 0)], HOSTILE)
        assert c.peer_refused == 1 and len(src) == 1 and len(src._topics) == 1
        assert sink.batches() == [("pod-a", 0, 0)]
        hostile.sock.close(linger=0)
    finally:
        await src.stop()


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


_READY_PUB = b"\x05READY\x0bSocket-Type" + (3).to_bytes(4, "big") + b"PUB"
#: What a ZMTP 3.0 publisher says first: its greeting (NULL) and READY naming a PUB.
_PUB_HELLO = GREETING + bytes([0x04, len(_READY_PUB)]) + _READY_PUB


async def unfinished_message(
    endpoint: str, frames: int, size: int, local: str = "127.0.0.1"
) -> tuple[int, asyncio.StreamWriter]:
    """A raw ZMTP publisher that sends ``frames`` frames of ``size`` bytes, each flagged MORE:
    a message that never ends. Returns the bytes of frames written before the peer closed, and
    the connection (still open unless the peer closed it: the caller closes it)."""
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    _r, w = await asyncio.open_connection(host, int(port), local_addr=(local, 0))
    frame = bytes([0x03]) + size.to_bytes(8, "big") + bytes(size)  # MORE | LONG
    sent = 0
    try:
        w.write(_PUB_HELLO)
        await w.drain()
        for _ in range(frames):
            w.write(frame)
            await w.drain()
            sent += size
    except OSError:  # the relay closed the connection
        pass
    return sent, w


async def _close(w: asyncio.StreamWriter) -> None:
    w.close()
    with contextlib.suppress(OSError):
        await w.wait_closed()


async def test_a_strangers_unfinished_message_is_never_buffered(
    ctx: zmq.asyncio.Context,  # noqa: F811
) -> None:
    """libzmq bounds each frame (``ZMQ_MAXMSGSIZE``), not a message: it keeps every frame of a
    message until the last one arrives, and the relay never sees a part of it, so a check per
    message never ran while a stranger's endless message grew. Refused at its handshake, the
    stranger has its connection closed before any frame is taken in."""
    sink = Sink()
    src = await source(ctx, sink, allow=("10.99.0.0/16",))
    try:
        mib = 1024 * 1024
        _sent, w = await unfinished_message(src.endpoints[0], 8, mib)  # warm up the allocator
        await _close(w)
        before = _rss()
        sent, w = await unfinished_message(src.endpoints[0], 64, mib)
        await asyncio.sleep(0.3)  # what libzmq would read of it, it has read
        grown = _rss() - before  # measured while the stranger's connection may still be open
        await _close(w)
        assert grown < 16 * mib, (
            f"the relay grew {grown / mib:.0f} MiB; the stranger wrote {sent / mib:.0f} MiB"
        )
        assert src.counters.connections_refused >= 2
        assert src.counters.messages == 0 and len(src) == 0 and src.connections == 0
    finally:
        await src.stop()


async def test_a_refused_connection_is_closed_at_once(
    ctx: zmq.asyncio.Context,  # noqa: F811
) -> None:
    """After a plain 400, libzmq sends ZMTP ERROR and keeps the connection (reading it) until
    the peer hangs up or the handshake's time ends: a stranger that does neither would hold it
    (and a frame) for 10 s. The relay's refusal makes libzmq close it on the spot."""
    src = await source(ctx, Sink(), allow=("10.99.0.0/16",))
    try:
        host, port = src.endpoints[0].removeprefix("tcp://").rsplit(":", 1)
        r, w = await asyncio.open_connection(host, int(port))
        w.write(_PUB_HELLO)  # and then neither sends nor closes
        started = time.monotonic()
        while await asyncio.wait_for(r.read(65536), 2.0):
            pass  # the relay's greeting; then EOF
        assert time.monotonic() - started < 1.0
        src._take_events()
        assert src._conns == {} and src.counters.connections_refused == 1
        await _close(w)
    finally:
        await src.stop()


async def test_connections_past_the_limit_are_refused_and_strangers_do_not_take_it(
    ctx: zmq.asyncio.Context,  # noqa: F811
) -> None:
    """At ``max_connections`` open connections from admitted addresses, further handshakes are
    refused (counted) as a temporary failure: the publisher connects again by itself and gets in
    once a connection closed. Connections from outside ``allow`` (here: eight that never speak
    ZMTP) do not count, so strangers cannot lock engines out."""
    sink = Sink()
    spec = ConnectSpec(
        bind=("tcp://127.0.0.1:0",), pattern=TopicPattern("kv@{engine}@{model}"),
        kv_block_size=4, model="m", allow=("127.0.0.1/32",), max_connections=3,
    )  # fmt: skip
    # A refused handshake is held until the handshake's time, then the publisher tries again.
    # The silent strangers are closed at that time too: it must outlast the three publishers'
    # connections (0.3 s did not on a busy machine, and the strangers were gone before they came).
    src = ConnectSource(spec, sink, context=ctx, handshake_s=scaled(0.6))
    await src.start()
    strangers = []
    try:
        host, port = src.endpoints[0].removeprefix("tcp://").rsplit(":", 1)
        for _ in range(8):
            strangers.append(
                (await asyncio.open_connection(host, int(port), local_addr=(HOSTILE, 0)))[1]
            )

        def open_conns() -> int:
            src._take_events()
            return len(src._conns)

        await until(lambda: open_conns() == 8)
        assert src.connections == 0
        pubs = [await _pub(ctx, src, f"kv@pod-{i}@m".encode()) for i in range(3)]
        assert open_conns() == 11 and src.connections == 3
        extra = Pub(ctx, src.endpoints[0], b"kv@x@m")
        await until(lambda: src.counters.connections_over_limit >= 1)
        assert not await extra.sock.poll(200)  # refused: no subscription
        await until(lambda: src.counters.connections_over_limit >= 2)  # it tried again
        assert src.counters.connections_refused == 0  # the silent strangers never asked
        pubs[0].sock.close(linger=0)  # one leaves: the extra's next attempt is admitted
        await extra.ready()
        for p in (extra, pubs[1]):
            await p.send()
        await until(lambda: len(sink.batches()) == 2)
        assert sorted(b[0] for b in sink.batches()) == ["pod-1", "x"]
        assert src.connections == 3
        for p in (extra, *pubs[1:]):
            p.sock.close(linger=0)
    finally:
        for w in strangers:
            w.close()
        await src.stop()


def test_the_default_connection_limit_leaves_headroom_over_max_members() -> None:
    from kvrelay.ingest.connect import connection_limit

    assert connection_limit(1024) == 1280 and connection_limit(1) == 17
    spec = ConnectSpec(bind=("tcp://127.0.0.1:0",), pattern=TopicPattern("kv@{engine}"),
                       kv_block_size=4, max_members=100)  # fmt: skip
    assert ConnectSource(spec, Sink()).max_connections == 125


async def test_sockets_of_one_context_share_a_zap_handler_each_with_its_allow_list(
    ctx: zmq.asyncio.Context,  # noqa: F811
) -> None:
    """libzmq has one ZAP endpoint per context: two pools' sockets on it each answer with their
    own ``allow``; the handler stays while one of them is open, and goes with the last."""
    sink_a, sink_b = Sink(), Sink()
    a = await source(ctx, sink_a, allow=("127.0.0.1",))
    b = await source(ctx, sink_b, allow=("10.99.0.0/16",))
    try:
        to_b = Pub(ctx, b.endpoints[0], b"kv@pod-b@m")
        await until(lambda: b.counters.connections_refused >= 1)
        to_a = await pub(ctx, a, b"kv@pod-a@m")
        await a.stop()
        assert len(zap._HANDLERS) == 1  # b still needs it
        refused = b.counters.connections_refused
        # the refused publisher connects again (libzmq's reconnect): refused again, by b
        await until(lambda: b.counters.connections_refused > refused)
        assert not await to_b.sock.poll(100)
        assert a.counters.connections_refused == 0
        for p in (to_a, to_b):
            p.sock.close(linger=0)
    finally:
        await a.stop()
        await b.stop()
    assert zap._HANDLERS == {}  # the endpoint is free again: a new socket binds it
    c = await source(ctx, Sink(), allow=("127.0.0.1",))
    try:
        p = await pub(ctx, c, b"kv@pod-c@m")
        p.sock.close(linger=0)
    finally:
        await c.stop()


async def test_no_handshake_without_the_zap_handler(
    ctx: zmq.asyncio.Context,  # noqa: F811
) -> None:
    """``ZMQ_ZAP_ENFORCE_DOMAIN``: if the handler is gone, libzmq refuses handshakes instead of
    letting them through unchecked; connections already admitted go on."""
    sink = Sink()
    src = await source(ctx, sink, allow=("10.99.0.0/16", "127.0.0.1"))
    try:
        assert src.zap_enforced
        p = await pub(ctx, src, b"kv@pod-a@m")
        assert src._zap is not None
        src._zap._close_socket()  # the handler's endpoint vanishes
        late = Pub(ctx, src.endpoints[0], b"kv@pod-b@m")
        assert not await late.sock.poll(300)
        await p.send()
        await until(lambda: len(sink.batches()) == 1)
        assert not await late.sock.poll(100)
        p.sock.close(linger=0)
        late.sock.close(linger=0)
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
        assert [r[2] for r in resets] == [ResetReason.BLOCK_CAP, ResetReason.BAD_BATCH]
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


async def test_ipc_publishers_are_trusted_by_the_socket_files_permissions(
    ctx: zmq.asyncio.Context,  # noqa: F811
    tmp_path: Path,
) -> None:
    """An IPC peer has no IP address (libzmq names it ``localhost:uid:gid:pid``): ``allow`` does
    not apply to it, at the handshake or per message, and it counts against the limit."""
    sink = Sink()
    src = await source(ctx, sink, bind=f"ipc://{tmp_path}/kv.sock", allow=("10.99.0.0/16",))
    try:
        p = Pub(ctx, src.endpoints[0], b"kv@pod-a@m")
        await p.ready()
        await p.send()
        await until(lambda: len(sink.batches()) == 1)
        src._take_events()
        c = src.counters
        assert (c.connections_refused, c.peer_refused, src.connections) == (0, 0, 1)
        p.sock.close(linger=0)
    finally:
        await src.stop()


async def test_curve_and_the_allow_list_both_apply(
    ctx: zmq.asyncio.Context,  # noqa: F811
) -> None:
    """With CURVE the handler is asked only once the publisher proved it encrypts to the
    socket's key; ``allow`` then still refuses it from another address."""
    server_public, server_secret = zmq.curve_keypair()
    src = await source(ctx, Sink(), curve_secret_key=server_secret.decode(),
                       allow=("10.99.0.0/16",))  # fmt: skip
    socks: list[zmq.asyncio.Socket] = []

    def curve_pub(server_key: bytes) -> zmq.asyncio.Socket:
        s = ctx.socket(zmq.XPUB)
        s.setsockopt(zmq.LINGER, 0)
        s.curve_serverkey = server_key
        s.curve_publickey, s.curve_secretkey = zmq.curve_keypair()
        s.connect(src.endpoints[0])
        socks.append(s)
        return s

    try:
        wrong = curve_pub(zmq.curve_keypair()[0])  # encrypts to another key: CURVE refuses it
        assert not await wrong.poll(300)
        assert src.counters.connections_refused == 0  # it never reached the handler
        right = curve_pub(server_public)
        await until(lambda: src.counters.connections_refused >= 1)  # ``allow`` refuses it
        assert not await right.poll(200)
    finally:
        for s in socks:
            s.close(linger=0)
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


#: A publisher in a process of its own (an IPC peer is named by its process): argv endpoint,
#: topic, first sequence; stdin the hex payloads, one per message.
_PROCESS_PUB = """
import sys, zmq
ep, topic, first = sys.argv[1], sys.argv[2].encode(), int(sys.argv[3])
bodies = [bytes.fromhex(h) for h in sys.stdin.read().split()]
c = zmq.Context()
p = c.socket(zmq.XPUB)
p.connect(ep)
assert p.poll(20000), "no subscription"
p.recv()
for i, body in enumerate(bodies):
    p.send_multipart([topic, (first + i).to_bytes(8, "big"), body])
p.close(linger=5000)
c.term()
"""


async def _process_pub(endpoint: str, topic: str, seqs: range, tag: int, dp: int = 0) -> None:
    """Publish ``seqs`` from a new process (a new pid: an engine's restart) and wait for it."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _PROCESS_PUB, endpoint, topic, str(seqs.start),
        stdin=asyncio.subprocess.PIPE,
    )  # fmt: skip
    bodies = " ".join(payload(tag, s, dp).hex() for s in seqs)
    await asyncio.wait_for(proc.communicate(bodies.encode()), scaled(30))
    assert proc.returncode == 0


async def test_a_restarted_ipc_engine_is_a_new_incarnation_not_a_stranger(
    ctx: zmq.asyncio.Context,  # noqa: F811
    tmp_path: Path,
) -> None:
    """libzmq names an IPC peer ``localhost:uid:gid:pid``: the engine is bound to its user, and
    a new pid is a restart. The restarted engine was refused (``address_mismatch``) until its
    old member expired (``member_silence_s``, 600 s by default), and another DP rank's process
    for good. Now it is taken at once, as a new incarnation: reset, then its own baseline, even
    where its sequence happens to continue the old one's (3, 4 after 0..2)."""
    sink = Sink()
    src = await source(ctx, sink, bind=f"ipc://{tmp_path}/kv.sock")
    try:
        ep = src.endpoints[0]
        await _process_pub(ep, "kv@pod-a@m", range(3), tag=1)
        await until(lambda: len(sink.batches()) == 3, 10)
        await asyncio.gather(
            _process_pub(ep, "kv@pod-a@m", range(3, 5), tag=2),  # the restarted rank 0
            _process_pub(ep, "kv@pod-a@m", range(1), tag=3, dp=1),  # rank 1's process
        )
        await until(lambda: len(sink.batches()) == 6, 10)
        rank0 = [(k, v) for k, v in sink.log if v[:2] == ("pod-a", 0)]
        assert rank0 == [
            *(("batch", ("pod-a", 0, s, [1_000_000 + s])) for s in range(3)),
            ("reset", ("pod-a", 0, ResetReason.INCARNATION)),
            *(("batch", ("pod-a", 0, s, [2_000_000 + s])) for s in range(3, 5)),
        ]
        assert ("pod-a", 1, 0) in sink.batches()
        c = src.counters
        assert (c.address_mismatch, c.members_expired, c.members_added) == (0, 0, 2)
        member = src._members[("pod-a", 0)].counters
        assert (member.incarnations_detected, member.missing_history) == (1, 1)
    finally:
        await src.stop()


async def test_processes_taking_turns_on_a_member_log_its_new_process_once(
    ctx: zmq.asyncio.Context,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Each new process is a reset (counted); ``connect_member_new_process`` comes at most once
    per 10 s, saying how many went unlogged: processes taking turns would log every message."""
    import structlog

    sink = Sink()
    src = await source(ctx, sink, bind=f"ipc://{tmp_path}/kv.sock")
    try:
        ep = src.endpoints[0]
        with structlog.testing.capture_logs() as logs:
            for tag in (1, 2, 3):
                await _process_pub(ep, "kv@pod-a@m", range(tag - 1, tag), tag=tag)
                await until(lambda t=tag: len(sink.batches()) == t, 10)  # type: ignore[misc]
        member = src._members[("pod-a", 0)].counters
        assert member.incarnations_detected == 2
        lines = [e for e in logs if e["event"] == "connect_member_new_process"]
        assert len(lines) == 1 and lines[0]["not_logged"] == 0, lines
    finally:
        await src.stop()


async def test_ipv4_mapped_spellings_in_allow_and_addresses_match_ipv4_publishers(
    ctx: zmq.asyncio.Context,  # noqa: F811
) -> None:
    """A peer is compared as IPv4 (``::ffff:a.b.c.d`` as ``a.b.c.d``), so the configured
    addresses must be too: ``allow = ["::ffff:127.0.0.1"]`` refused the publisher at 127.0.0.1
    at every handshake, and a pinned ``::ffff:127.0.0.0/104`` dropped its messages."""
    sink = Sink()
    src = await source(
        ctx, sink, allow=("::ffff:127.0.0.1", "::FFFF:127.0.0.2"),
        addresses=(("pod-a", ("::ffff:127.0.0.1/128",)),),
    )  # fmt: skip
    try:
        real = await _pub(ctx, src, b"kv@pod-a@m")
        other = await _pub(ctx, src, b"kv@pod-a@m", HOSTILE)  # allowed, but not pod-a's
        await real.send()
        await other.send(tag=9)
        await real.send()
        await _settle(src, 3)
        assert sink.batches() == [("pod-a", 0, 0), ("pod-a", 0, 1)]
        c = src.counters
        assert (c.connections_refused, c.peer_refused, c.address_mismatch) == (0, 0, 1)
    finally:
        await src.stop()
