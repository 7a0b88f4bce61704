"""Hashing and identity: XXH3-64 in numba, block/sequence hashes (§7) and relay identity (§8.1).

Kept separate from the pool so that every hash the relay emits has one implementation, shared by
the ingest path, the cuckoo filter and the tests' oracles.
"""
