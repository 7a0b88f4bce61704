"""gRPC service layer: validation, errors + trailer, limits, the grpclib KvEventRelay server."""
