"""Publication tests share the identity builders (plane tests build many producers)."""

from tests.support.identities import pool_id, producer, relay

__all__ = ["pool_id", "producer", "relay"]
