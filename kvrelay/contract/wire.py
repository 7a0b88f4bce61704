"""Wire constants of ``dynamo.kvrelay.v1`` (``docs/contract.md`` §1–§4). Defined here only."""

from __future__ import annotations

#: ``contract_marker`` (field 127, fixed32) of every request and response: ASCII "KVR1".
CONTRACT_MARKER = 0x4B565231
#: Compatibility major of the contract; additive changes keep it.
PROTOCOL_VERSION = 1
POOL_IDENTITY_VERSION = 1
CKF_FORMAT_VERSION = 1
FINGERPRINT_BITS = 16
SLOTS_PER_BUCKET = 4
#: Largest lane a producer identity may name (2^24 buckets, 128 MiB of bucket words).
MAX_BUCKET_COUNT = 1 << 24
DIGEST_BYTES = 16
MAX_SUBSCRIBER_ID_BYTES = 128
#: ASCII trailing-metadata key carrying the error reason's full enum name.
TRAILER_KEY = "kv-relay-error-reason"
U32_MAX = (1 << 32) - 1
U64_MAX = (1 << 64) - 1
