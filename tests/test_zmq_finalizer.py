"""The suite's guard against pyzmq's finalizer deadlock (pyproject's ``filterwarnings``).

A context collected with a socket in its own reference cycle hung a test process for good:
the collector clears the context's weak references to its sockets first, so its finalizer
closes none and waits in ``term()`` for the one still open. The finalizer warns
(``ResourceWarning: Unclosed context``) before it ends the context, and the suite makes that
warning an error, which stops the finalizer there: a leak is then reported, never a hang.
"""

from __future__ import annotations

import zmq


def test_a_collected_context_with_an_open_socket_is_reported_not_waited_for() -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.PUB)
    try:
        try:
            ctx.__del__()  # what the collector runs; with the socket open, term() never returns
        except ResourceWarning as warning:
            assert "Unclosed context" in str(warning)
        else:
            raise AssertionError("the finalizer went on to end the context")
        assert not ctx.closed and not sock.closed
    finally:
        sock.close(linger=0)
        ctx.term()
