"""The relay's libzmq contexts take as many sockets as its descriptor limit allows: libzmq's own
default cap (1,023 per context) failed every socket past it with ``EMFILE``, an engine declaring
thousands of data-parallel ranks among them, with most descriptors still free."""

from __future__ import annotations

import resource
from collections.abc import Iterator

import pytest
import zmq

from kvrelay.ingest import zmq_context
from kvrelay.ingest.sink import SourceSpec
from kvrelay.ingest.subscriber import Subscriber

SOCKETS = 1_500  # past libzmq's default cap, each with its own descriptor (its mailbox)


@pytest.fixture
def room() -> Iterator[None]:
    """A soft descriptor limit with room for ``SOCKETS`` (raised for the test when the hard
    limit allows, as the daemon raises its own at start)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 3 * SOCKETS
    if soft != resource.RLIM_INFINITY and soft < want:
        if hard != resource.RLIM_INFINITY and hard < want:
            pytest.skip(f"hard descriptor limit {hard} < {want}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _open(ctx: zmq.Context, n: int) -> int:  # type: ignore[type-arg]
    """How many of ``n`` DEALER sockets ``ctx`` gives (all closed again)."""
    socks = []
    try:
        for _ in range(n):
            try:
                socks.append(ctx.socket(zmq.DEALER))
            except zmq.ZMQError:
                break
        return len(socks)
    finally:
        for s in socks:
            s.close(linger=0)


def test_a_sized_context_takes_more_sockets_than_libzmqs_default(room: None) -> None:
    plain = zmq.Context()
    sized = zmq_context.sized(zmq.Context())
    try:
        assert plain.get(zmq.MAX_SOCKETS) == 1023
        assert _open(plain, SOCKETS) == 1023  # what the relay hit
        assert sized.get(zmq.MAX_SOCKETS) >= 3 * SOCKETS
        assert _open(sized, SOCKETS) == SOCKETS
    finally:
        plain.term()
        sized.term()


def test_sizing_never_lowers_a_cap() -> None:
    ctx = zmq.Context()
    try:
        ctx.set(zmq.MAX_SOCKETS, 65_535)
        assert zmq_context.sized(ctx).get(zmq.MAX_SOCKETS) == 65_535
    finally:
        ctx.term()


def test_sources_use_the_sized_shared_context() -> None:
    spec = SourceSpec(endpoint="tcp://127.0.0.1:1", replay_endpoint=None, topic=b"", dp_rank=0,
                      worker_id=1, kv_block_size=4)  # fmt: skip
    sub = Subscriber(spec, sink=None)  # type: ignore[arg-type]
    assert sub._ctx.underlying == zmq_context.shared().underlying
    assert zmq_context.shared().get(zmq.MAX_SOCKETS) > 1023 or (
        resource.getrlimit(resource.RLIMIT_NOFILE)[0] <= 1023
    )
