"""The floor every layer stands on: what the ``dynamo.kvrelay.v1`` contract fixes.

Wire constants, the transport-neutral ``RelayError`` (a reason and a message; the gRPC status a
reason maps to is the service's business), the ``ProducerKey`` that says what "the same
generation" means, envelope validators, and the relay's limits. It imports nothing of kvrelay but
the generated protobuf classes, so the relay core, the publication layer, the gRPC service and the
consumer SDK can all share it without importing each other. See ``docs/contract.md``.
"""

from kvrelay.contract import proto_fixes as _proto_fixes  # noqa: F401  (before anything parses)
