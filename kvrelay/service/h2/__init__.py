"""The only room of the server that touches grpclib's and h2's private state (see internals.py)."""
