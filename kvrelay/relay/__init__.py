"""The orchestrator: discovery → ingest → pool → publication, and the planes the service reads.

It owns pools, producer generations and publication sequences; the gRPC service only reads it
through ``kvrelay.service.view.RelayView``.
"""
