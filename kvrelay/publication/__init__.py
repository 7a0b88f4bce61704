"""Everything the relay publishes, transport-neutral: the per-generation filter hub (CBI1
snapshots and deltas through the FilterUpdate splice encoder) and the catalog, readiness and load
planes. The gRPC service only serves what these produce."""
