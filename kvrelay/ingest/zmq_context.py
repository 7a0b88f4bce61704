"""The process's libzmq contexts, sized for the relay's sources.

Why: libzmq caps a context at 1,023 sockets (``ZMQ_MAX_SOCKETS``) whatever the descriptor
limit. Every replay, every libzmq live reader and every connect-mode socket is a socket of the
one shared context, and one engine may declare up to 4,096 data-parallel ranks: past 1,023, each
new socket failed with ``EMFILE`` ("Too many open files") while the process held a twentieth of
its descriptors, and the sources that hit it failed and restarted over and over. The cap is read
once, when a context makes its first socket, so it is set here, where the relay's contexts are
made, to what the process's descriptor limit allows (each socket holds at least one).
"""

from __future__ import annotations

import resource
from typing import Any, TypeVar

import zmq
import zmq.asyncio

C = TypeVar("C", bound="zmq.Context[Any]")


def sized(ctx: C) -> C:
    """``ctx`` with its socket cap raised to the process's soft descriptor limit, within
    libzmq's own bound (``ZMQ_SOCKET_LIMIT``, 65,535); never lowered. Effective only before the
    context's first socket: libzmq reads it then."""
    cap = int(ctx.get(zmq.SOCKET_LIMIT))
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft != resource.RLIM_INFINITY:
        cap = min(cap, int(soft))
    if int(ctx.get(zmq.MAX_SOCKETS)) < cap:
        ctx.set(zmq.MAX_SOCKETS, cap)
    return ctx


def shared() -> zmq.Context[Any]:
    """The process's shared context for plain sockets (``zmq.Context.instance()``), sized."""
    return sized(zmq.Context.instance())


def shared_async() -> zmq.asyncio.Context:
    """The process's shared asyncio context (``zmq.asyncio.Context.instance()``), sized."""
    return sized(zmq.asyncio.Context.instance())
