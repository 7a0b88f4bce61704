"""A KvEventRelay whose source is another KvEventRelay (kvrelay's or Dynamo's).

A mirror holds one upstream stream per catalog pool plus the catalog, readiness and load streams,
checks everything like a strict consumer, and re-serves it: the same relay and producer
identities, sequences and CBI1 bytes a direct subscriber would get, with its own limits, queues
and lag rules for its own subscribers. ``Mirror`` implements ``kvrelay.service.view.RelayView``.
It is the fan-out worker of a ``workers = N`` daemon, a fan-out tier in front of any relay, and
the local copy of a remote data centre's relay (``docs/scaling.md``).
"""
