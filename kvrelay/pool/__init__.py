"""Exact ownership state, the cuckoo filter and the apply kernels (one pool each)."""
