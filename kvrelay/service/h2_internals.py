"""The grpclib and h2 internals kvrelay's own HTTP/2 writers rely on, checked in one place.

``bulk`` (snapshot chunks) and ``direct`` (deltas for idle streams) write DATA frames beside
grpclib. Both need the same private attributes; when a grpclib or h2 release lacks one, both
fall back to sending through grpclib instead of failing.
"""

from __future__ import annotations

from typing import Any


def stream_internals(stream: Any) -> tuple[Any, Any, Any] | None:
    """``(inner stream, connection, h2 connection)`` of a grpclib server stream when each has
    what both writers use; None otherwise."""
    inner: Any = getattr(stream, "_stream", None)
    conn: Any = getattr(inner, "connection", None)
    h2: Any = getattr(inner, "_h2_connection", None)
    if (
        inner is None
        or getattr(inner, "_transport", None) is None
        or not hasattr(conn, "write_ready")
        or not hasattr(conn, "data_send_process")
        or not hasattr(h2, "outbound_flow_control_window")
        or not hasattr(h2, "max_outbound_frame_size")
        or not hasattr(h2, "state_machine")
        or not isinstance(getattr(h2, "streams", None), dict)
        or not hasattr(stream, "_messages_sent")
    ):
        return None
    return inner, conn, h2
