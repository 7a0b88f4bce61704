"""Request validation in the contract's order (``docs/contract.md`` §3.1).

Step 1 is the marker, step 2 the subscriber id of streaming RPCs; the service takes its permit and
checks ``expected_producer`` (``kvrelay.contract.producer``) after these.
"""

from __future__ import annotations

import re

from kvrelay.contract.errors import RelayError
from kvrelay.contract.wire import CONTRACT_MARKER, MAX_SUBSCRIBER_ID_BYTES

# Unicode general category Cc is exactly C0 (U+0000..U+001F), DEL and C1 (U+007F..U+009F).
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


def check_marker(marker: int) -> None:
    """The message says what to send: a hand-written request (grpcurl, buf curl) usually has no
    marker at all, and "0x00000000 != 0x4b565231" alone does not say where it goes."""
    if marker != CONTRACT_MARKER:
        got = "no contract_marker" if marker == 0 else f"contract_marker 0x{marker:08x}"
        raise RelayError.contract_mismatch(
            f"{got}: send contract_marker = {CONTRACT_MARKER} (0x{CONTRACT_MARKER:08X}, field "
            f"127, fixed32), e.g. grpcurl -d '{{\"contract_marker\": {CONTRACT_MARKER}}}'"
        )


def check_subscriber_id(subscriber_id: str) -> None:
    if not subscriber_id:
        raise RelayError.invalid_request("subscriber_id must be non-empty")
    size = len(subscriber_id.encode("utf-8", "surrogatepass"))
    if size > MAX_SUBSCRIBER_ID_BYTES:
        raise RelayError.invalid_request(
            f"subscriber_id is {size} bytes; at most {MAX_SUBSCRIBER_ID_BYTES} allowed"
        )
    if _CONTROL.search(subscriber_id) is not None:
        raise RelayError.invalid_request("subscriber_id contains control characters")


def validate_stream_request(marker: int, subscriber_id: str) -> None:
    """The marker, then the subscriber id (§3.1); the caller takes the permit next."""
    check_marker(marker)
    check_subscriber_id(subscriber_id)
