"""What a new generation of a pool is built from: its producer identity and an empty pool.

The identity digests follow the pool's settings and what its engines report (``PoolIdentity``);
each materialization takes the relay's next layout generation, so routers see a new producer.
"""

from __future__ import annotations

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.hashing import identity
from kvrelay.pool.pool import Pool
from kvrelay.relay.context import RelayContext
from kvrelay.relay.engines import PoolIdentity
from kvrelay.relay.settings import PoolSpec

__all__ = ["empty_pool", "producer_identity"]


def producer_identity(
    spec: PoolSpec, ctx: RelayContext, ident: PoolIdentity
) -> pb.ProducerIdentity:
    """The producer identity of a new generation (takes the next layout generation)."""
    fmt = identity.CkfFormatSpec(seed=spec.ckf_seed, bucket_count=spec.bucket_count)
    return pb.ProducerIdentity(
        pool_id=pb.KvPoolId(
            identity_version=1,
            indexer_domain=pb.IndexerDomainId(
                cache_semantics=pb.DigestIdentity(
                    digest=identity.cache_semantics_digest(
                        ident.model_source, ident.block_size, int(spec.hash_format)
                    ),
                    source=pb.IdentitySource.DEFAULT_DERIVED,
                ),
                routing_scope=pb.DigestIdentity(
                    digest=identity.routing_scope_digest(*spec.triple),
                    source=pb.IdentitySource.DEFAULT_DERIVED,
                ),
            ),
            dc_id=ctx.dc_id,
        ),
        producer_incarnation=ctx.relay_incarnation,
        layout_generation=ctx.next_layout_generation(),
        ckf_format=fmt.to_proto(),
    )


def empty_pool(spec: PoolSpec, ident: PoolIdentity) -> Pool:
    """The exact state of a generation that starts from nothing (rebuilt by replay)."""
    return Pool(
        bucket_count=spec.bucket_count,
        seed=spec.ckf_seed,
        block_size=ident.block_size,
        hash_format=int(spec.hash_format),
        reports=spec.engine_reports,
    )
