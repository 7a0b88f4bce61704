"""Publication: the CBI1 wire codec and (later) the per-pool publication hub."""
