"""Log lines on the paths a publisher's input reaches come at a bounded rate, whatever it sends.

Each malformed or out-of-sequence message is counted (metrics); a line per message would let one
publisher fill the disk, so ``member_reset``, ``bad_batch``, ``sequence_backwards`` and the
connect socket's lines are logged at most once per 10 s per reason, saying how many went unlogged.
"""

from __future__ import annotations

from typing import Any

import structlog
import zmq
import zmq.asyncio

from kvrelay.sim.wire import encode_batch
from tests.support.connect import connect_rig
from tests.support.crafted import Oracle, RawPublisher
from tests.support.rig import eventually, rig, wait_live

ROUNDS = 200


def lines(logs: list[dict[str, Any]], event: str) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == event]


async def test_a_publisher_sending_bad_batches_and_restarts_is_logged_at_a_bounded_rate() -> None:
    raw = RawPublisher()
    oracle = Oracle()
    try:
        async with rig(
            [], static=(raw.spec(),), model="raw-model", kv_block_size=16, expected_blocks=65_536
        ) as r:
            await wait_live(r.relay, 1)
            (sub,) = r.pool.subscribers.values()
            await raw.announce_until(lambda: sub.counters.batches > 0)
            good = oracle.next_nonempty()
            with structlog.testing.capture_logs() as logs:
                for _ in range(ROUNDS):  # applied (state to lose), then undecodable: a reset each
                    await raw.send_payload(good)
                    await raw.send_payload(b"\xc1")
                for _ in range(ROUNDS):  # applied, then numbered from 0 again: a restart each
                    raw.seq = 0
                    await raw.send_payload(good)
                await eventually(
                    lambda: sub.counters.resets_by_reason.get("incarnation", 0) >= ROUNDS - 1,
                    timeout=20, what="every message counted",
                )  # fmt: skip
            assert sub.counters.bad_batches == ROUNDS
            assert r.pool.counters.member_resets["bad_batch"] == ROUNDS
            resets = lines(logs, "member_reset")
            assert [e["reason"] for e in resets] == ["bad_batch", "incarnation"], resets[:4]
            assert resets[0]["resets_not_logged"] == 0
            assert len(lines(logs, "bad_batch")) == 1
            assert len(lines(logs, "sequence_backwards")) == 1
    finally:
        raw.close()


async def test_a_connected_stranger_resetting_its_member_at_every_message_logs_once() -> None:
    """Anyone the connect socket admits names a member of its own; numbering each message past
    a gap resets that member at every message (counted in full, one line per 10 s)."""
    async with connect_rig() as c:
        r = c.rig
        zctx = zmq.asyncio.Context()
        rogue = zctx.socket(zmq.XPUB)
        rogue.setsockopt(zmq.LINGER, 0)
        rogue.setsockopt(zmq.SNDHWM, 0)
        rogue.connect(c.bind)
        try:
            assert await rogue.poll(5000)
            await rogue.recv()  # the relay's subscription
            payload = encode_batch(1.0, [], 0)  # applied (the member is dirty), nothing stored
            with structlog.testing.capture_logs() as logs:
                for i in range(ROUNDS):
                    await rogue.send_multipart(
                        [b"kv@rogue@sim-model", (2 * i).to_bytes(8, "big"), payload]
                    )
                await eventually(
                    lambda: r.pool.counters.member_resets.get("gap_no_replay", 0) == ROUNDS - 1,
                    what="every gap counted",
                )
        finally:
            rogue.close(linger=0)
            zctx.term()
        resets = lines(logs, "member_reset")
        assert len(resets) == 1 and resets[0]["reason"] == "gap_no_replay", resets[:4]
