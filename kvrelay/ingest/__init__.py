"""Engine KV-event ingestion: ZMQ frames, msgpack decoding, per-(engine, dp_rank) subscribers.

``ingest`` turns vLLM's wire format into ``kvrelay.pool.batch.EventBatch`` objects and hands them
to a ``BatchSink``; it never touches pool state itself.
"""
