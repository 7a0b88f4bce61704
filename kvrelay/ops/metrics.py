"""Prometheus metrics: a collector that reads ``Relay.stats()`` at scrape time.

Nothing here runs per ZMQ message: subscribers, pools and hubs keep plain ints and the relay folds
the counters of whatever it replaces (subscribers, generations) into monotonic totals, so a scrape
is one ``stats()`` call turned into metric families. The only per-event work is one histogram
observation per *published delta* (the collector is a ``RelayObserver``) and one per loop-lag
sample. The HTTP endpoint is ``kvrelay.ops.metrics_http``.
"""

from __future__ import annotations

import contextlib
import math
import socket
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from prometheus_client import (
    CollectorRegistry,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from kvrelay import __version__
from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.contract.errors import reason_name
from kvrelay.contract.wire import SLOTS_PER_BUCKET
from kvrelay.discovery.errors import REFUSED, REPLY_REFUSALS
from kvrelay.ingest import stats as decode_stats
from kvrelay.ingest.connect import ConnectCounters
from kvrelay.ingest.counters import LAG_BUCKETS_S, SubscriberCounters
from kvrelay.ingest.errors import DecodeError
from kvrelay.ingest.sink import ResetReason
from kvrelay.ops import gc_pauses
from kvrelay.ops.gc_pauses import GcPauses, pauses
from kvrelay.ops.metrics_http import (
    Collected,
    HttpCounters,
    HttpLimits,
    MetricsServer,
    http_metrics,
    pinned,
)
from kvrelay.pool.errors import MalformedBatch, PoolError
from kvrelay.relay.observer import Observers
from kvrelay.relay.stats import GenerationTotals, RelayStats
from kvrelay.service.h2.guard import ABUSE_REASONS
from kvrelay.service.server import CATALOG_FIRST_KIND

DELTA_LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)
LOOP_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

_MEMBER = ("pool", "worker", "dp_rank")

# The histograms prometheus_client keeps (delta latency, loop lag) would each add a
# ``<name>_created`` gauge family in the text format, a start time no dashboard uses and the
# metric table does not list; the relay's own histograms have none either.
disable_created_metrics()  # type: ignore[no-untyped-call]


def _leaf_kinds(base: type[DecodeError] | type[PoolError]) -> tuple[str, ...]:
    """The ``kind`` of every class below ``base`` that is raised (has no subclass itself)."""
    out: list[str] = []
    todo: list[type] = [base]
    while todo:
        cls = todo.pop()
        subs: list[type] = cls.__subclasses__()
        if not subs and cls is not base:
            out.append(cls.kind)  # type: ignore[attr-defined]
        todo += subs
    return tuple(sorted(set(out)))


# Every known value of the counters labelled by a reason or kind is exported from the start, at
# 0 while it has not happened: a series that appears at its first count hides that count from
# ``increase()``/``rate()``, so an alert on it never fired for a single event. The values come
# from the layers that count them (or, where they are literals there, a list a test holds to
# them); one not listed (a bug's exception name) still appears at its first count. Bounded:
# 11 stream error reasons and 33 metadata rules per process, 17 reset reasons and 8 error kinds
# per pool, 19 rejection kinds, 15 drop reasons and 11 reset reasons per source (per pool with
# ``per_member = false``). ``known_at_zero`` applies them to a family's counts, ``_AT_ZERO``
# to the ingest families'; the mirror's lists are in ``mirror_metrics``.
#: ``kvrelay_stream_errors_total{reason}``: every contract reason a stream can end with.
STREAM_ERROR_REASONS = tuple(
    reason_name(r) for r in pb.RelayErrorReason if r != pb.RelayErrorReason.UNSPECIFIED
)
#: ``kvrelay_pool_member_resets_total{reason}``: an ingest ``ResetReason``, or the pool's own
#: (a crashed subscriber, an engine removed or declared down, a DP rank gone, a rank's source
#: moved to another endpoint, a connected member expired or its socket reconfigured).
POOL_RESET_REASONS = tuple(sorted({
    *(r.value for r in ResetReason), "source_failed", "engine_removed", "engine_down",
    "rank_removed", "source_changed", "member_expired", "reconfigured",
}))  # fmt: skip
#: ``kvrelay_pool_errors_total{kind}``: every pool error the pool counts.
POOL_ERROR_KINDS = _leaf_kinds(PoolError)
#: A protocol error of a publisher's connection, as kvrelay's ZMTP reader names it
#: (``ingest/zmtp.py``: ``ZmtpError.kind``, and its own ``handshake_timeout`` and
#: ``connect_error``); counted as the rejection ``zmtp_<kind>``.
ZMTP_ERROR_KINDS = (
    "bad_command", "bad_frame", "bad_greeting", "connect_error", "handshake_timeout",
    "oversized", "peer_error", "peer_type", "too_many_frames", "write_backlog",
)  # fmt: skip
#: ``kvrelay_ingest_decode_rejections_total{kind}``: every decode rejection, a batch the pool
#: refused whole, and every ZMTP transport error.
DECODE_REJECTION_KINDS = tuple(sorted({
    *_leaf_kinds(DecodeError), MalformedBatch.kind, *(f"zmtp_{k}" for k in ZMTP_ERROR_KINDS),
}))  # fmt: skip
#: ``kvrelay_ingest_dropped_events_total{reason}``: every ``DROP_*`` reason of the decoder, the
#: storage tiers (``medium_<tier>``) included.
INGEST_DROP_REASONS = tuple(sorted({
    *(v for k, v in vars(decode_stats).items()
      if k.startswith("DROP_") and k != "DROP_MEDIUM_PREFIX"),
    *(decode_stats.DROP_MEDIUM_PREFIX + tier
      for tier in ("host_pinned", "disk", "external", "unknown")),
}))  # fmt: skip
#: ``kvrelay_ingest_member_resets_total{reason}``: the subscribers count ``ResetReason`` only.
INGEST_RESET_REASONS = tuple(sorted(r.value for r in ResetReason))
#: ``kvrelay_metadata_rejections_total{plane, rule}``: the rules of ``CatalogError`` (catalog)
#: and ``TopologyError`` (readiness), literals in ``publication/catalog.py`` and
#: ``readiness.py``.
METADATA_RULES: dict[str, tuple[str, ...]] = {
    "catalog": (
        "catalog.duplicate_pool", "endpoint.component", "endpoint.endpoint", "endpoint.missing",
        "endpoint.namespace", "producer.invalid", "query.block_size", "query.hash_format",
        "query.missing", "registration.adapter", "registration.alias",
        "registration.alias_duplicate", "registration.alias_is_canonical",
        "registration.base_count", "registration.base_model", "registration.canonical_model_id",
        "registration.duplicate", "registration.empty", "registration.lora_base",
        "registration.target_ambiguous", "registration.target_unset", "roles.duplicate",
        "roles.empty", "roles.invalid",
    ),
    "readiness": (
        "endpoint.adapter", "endpoint.component", "endpoint.duplicate", "endpoint.endpoint",
        "endpoint.live", "endpoint.model", "endpoint.namespace", "endpoint.needs",
        "endpoint.role",
    ),
}  # fmt: skip
_METADATA_KEYS = tuple((plane, rule) for plane, rules in METADATA_RULES.items() for rule in rules)
#: ``kvrelay_window_errors_total{plane, kind}`` (the relay's statistics list all four).
_WINDOW_ERROR_KEYS = tuple(
    (plane, kind) for plane in ("load", "serving_load") for kind in ("window", "entry")
)
Flat = dict[tuple[str, str], int]
_K = TypeVar("_K")
_LAG_HELP = (
    "Live messages: relay wall clock when applied minus the engine's batch timestamp "
    "(includes clock offset between hosts)."
)

# Subscriber counters → (metric name without _total, help, extra label or None).
_SUB_SCALARS: dict[str, tuple[str, str]] = {
    "messages": ("kvrelay_ingest_messages", "ZMQ messages received (live and replayed)."),
    "replayed_messages": ("kvrelay_ingest_replayed_messages", "Messages received by replay."),
    "batches": ("kvrelay_ingest_batches", "Event batches delivered to the pool."),
    "events": ("kvrelay_ingest_events_delivered", "Events delivered to the pool."),
    "blocks": ("kvrelay_ingest_blocks", "Block hashes delivered to the pool."),
    "duplicates": ("kvrelay_ingest_duplicates", "Messages already applied (replay overlap)."),
    "gaps": ("kvrelay_ingest_gaps", "Sequence gaps detected on the live stream."),
    "replays": ("kvrelay_ingest_replays", "Replay requests sent to the engine."),
    "replay_failures": ("kvrelay_ingest_replay_failures", "Replays that timed out or broke."),
    "replay_gaps": (
        "kvrelay_ingest_replay_gaps",
        "Replay replies that skipped a batch after their first one, asked again from the hole "
        "(once; a second hole resets the member).",
    ),
    "missing_history": (
        "kvrelay_ingest_missing_history",
        "History nothing can give back: a replay that started later than asked, or a first "
        "batch numbered past the start with nothing to replay what came before.",
    ),
    "reorder_overflows": (
        "kvrelay_ingest_reorder_overflows", "Reorder buffer bound hit while awaiting a replay."
    ),
    "reconnects": ("kvrelay_ingest_reconnects", "SUB connections re-established after a drop."),
    "incarnations_detected": (
        "kvrelay_ingest_incarnations_detected",
        "Replays that did not hold the last applied batch (engine restarted): member rebuilt.",
    ),
    "epoch_changes": (
        "kvrelay_ingest_epoch_changes", "SGLang publisher epochs that changed (restarts)."
    ),
    "bad_batches": (
        "kvrelay_ingest_bad_batches", "Batches that could not be decoded or were malformed."
    ),
    "repairs": ("kvrelay_ingest_repairs", "Bad batches applied correctly when re-fetched."),
}
_SUB_ANOMALIES = ("unknown_tags", "unknown_fields", "malformed_events", "eagle_bigram", "truncated")
_SUB_DICTS: dict[str, tuple[str, str, str]] = {
    "events_by_kind": ("kvrelay_ingest_events", "Decoded events by kind.", "kind"),
    "rejections": (
        "kvrelay_ingest_decode_rejections", "Frames/messages rejected by kind.", "kind"
    ),
    "drops": ("kvrelay_ingest_dropped_events", "Events dropped by reason.", "reason"),
    "resets_by_reason": (
        "kvrelay_ingest_member_resets", "Member state clears by reason (ingest side).", "reason"
    ),
}
# Generation counters → (metric name, help, extra label or None).
_GEN_COUNTERS: dict[str, tuple[str, str, str | None]] = {
    "capacity_omissions": (
        "kvrelay_ckf_capacity_omissions", "Fingerprints the CKF could not place.", None
    ),
    "unknown_removals": ("kvrelay_pool_unknown_removals", "Removals of unknown blocks.", None),
    "duplicate_stores": (
        "kvrelay_pool_duplicate_stores",
        "Stored blocks a member already held, counted as one more physical copy.",
        None,
    ),
    "report_stores": (
        "kvrelay_pool_report_stores",
        "Stored blocks a member already held, taken as reports (no new copy).",
        None,
    ),
    "ambiguous_stores": (
        "kvrelay_pool_ambiguous_stores",
        "Store events that were reports or new copies, the stream cannot tell (taken as reports).",
        None,
    ),
    "copy_removals": (
        "kvrelay_pool_copy_removals",
        "Removes that dropped one of several physical copies (the block stays held).",
        None,
    ),
    "rebuild_holds": (
        "kvrelay_pool_rebuild_holds",
        "Member rebuilds from replay published as one delta (publications held meanwhile).",
        None,
    ),
    "rebuild_holds_broken": (
        "kvrelay_pool_rebuild_holds_broken",
        "Rebuild holds cut short (time or size bound): the rest published as it came.",
        None,
    ),
    "invariant_violations": (
        "kvrelay_pool_invariant_violations", "Exact-state invariant violations (fences).", None
    ),
    "errors": ("kvrelay_pool_errors", "Pool apply errors by kind.", "kind"),
    "deltas": ("kvrelay_deltas_published", "Deltas published (sequence advances).", None),
    "hub_resets": (
        "kvrelay_hub_resets", "Oversized publications forcing subscribers to re-snapshot.", None
    ),
    "lagged": (
        "kvrelay_pool_lag_terminations", "Pool subscribers ended for lagging (queue full).", None
    ),
    "snapshots_served": (
        "kvrelay_snapshots_sent", "Snapshots sent to pool subscribers (one per subscription).", None
    ),
    "snapshots_built": (
        "kvrelay_snapshots_built", "Snapshot encodes (shared by joiners at one sequence).", None
    ),
}
# PoolCounters attribute → (metric name, help).
_POOL_COUNTERS: dict[str, tuple[str, str]] = {
    "batches": ("kvrelay_pool_batches_applied", "Batches applied to the pool's exact state."),
    "events": ("kvrelay_pool_events_applied", "Events in applied batches."),
    "events_rejected": ("kvrelay_pool_events_rejected", "Events the pool rejected."),
    "dropped_without_generation": (
        "kvrelay_pool_dropped_without_generation", "Batches dropped while no generation existed."
    ),
    "generations": ("kvrelay_pool_generations", "Generations materialized."),
    "fences": ("kvrelay_pool_fences", "Generations fenced (withdrawn and rebuilt)."),
    "block_size_conflicts": (
        "kvrelay_pool_block_size_conflicts", "Engines skipped for a conflicting kv_block_size."
    ),
    "source_duplicates": (
        "kvrelay_pool_source_duplicates",
        "Sources not subscribed because another engine of the pool reports the same publisher "
        "(endpoint, topic and DP rank): one engine counted once.",
    ),
    "source_failures": (
        "kvrelay_pool_source_failures", "Subscribers that crashed or failed to start (restarted)."
    ),
    "engines_down": (
        "kvrelay_pool_engines_down",
        "Engines declared down (Control and ZMQ silent for the grace): members cleared.",
    ),
    "identity_changes": (
        "kvrelay_pool_identity_changes", "Re-materializations for a new model or block size."
    ),
    "identity_conflicts": (
        "kvrelay_pool_identity_conflicts", "Withdrawals because engines disagree on the pool."
    ),
    "rebuild_backoffs": (
        "kvrelay_pool_rebuild_backoffs", "Rebuilds after repeated fences that waited (backoff)."
    ),
    "members_resumed": (
        "kvrelay_pool_members_resumed",
        "Restored members resumed from their saved sequence (then vouched for or reset).",
    ),
    "scrub_passes": ("kvrelay_pool_scrub_passes", "Full scrub passes over a generation."),
    "scrub_divergences": (
        "kvrelay_pool_scrub_divergences",
        "Scrub passes that found the filter or the exact state wrong (the generation fenced).",
    ),
    "members_vouched": (
        "kvrelay_pool_members_vouched",
        "Restored members their engine vouched for (same incarnation and batch bytes): kept.",
    ),
    "restores_discarded": (
        "kvrelay_pool_restores_discarded",
        "Restored pool states not used (another identity, or arrays that do not load).",
    ),
    "reconfigurations": (
        "kvrelay_pool_reconfigurations",
        "Re-materializations because a reload changed a filter setting.",
    ),
    # connect mode (a bound SUB fed by many engines, §22)
    "connect_messages": ("kvrelay_connect_messages", "Messages on the pool's bound SUB."),
    "connect_topic_unmatched": (
        "kvrelay_connect_topic_unmatched", "Messages whose topic the pattern does not match."
    ),
    "connect_topic_malformed": (
        "kvrelay_connect_topic_malformed",
        "Messages whose topic matches but names no valid member (bad UTF-8, engine or rank).",
    ),
    "connect_model_mismatch": (
        "kvrelay_connect_model_mismatch", "Messages whose topic names another model."
    ),
    "connect_frames_rejected": (
        "kvrelay_connect_frames_rejected", "Messages with a bad frame count or sequence frame."
    ),
    "connect_members_added": ("kvrelay_connect_members_added", "Members admitted by topic."),
    "connect_members_refused": (
        "kvrelay_connect_members_refused", "Messages naming a configured engine (refused)."
    ),
    "connect_members_over_limit": (
        "kvrelay_connect_members_over_limit", "Messages naming a new member past max_members."
    ),
    "connect_members_expired": (
        "kvrelay_connect_members_expired", "Members removed after member_silence_s of silence."
    ),
    "connect_peer_refused": (
        "kvrelay_connect_peer_refused",
        "Messages from an address outside the pool's allow list (past the handshake's check).",
    ),
    "connect_connections_refused": (
        "kvrelay_connect_connections_refused",
        "Connections refused at the ZMTP handshake: the address is outside the allow list.",
    ),
    "connect_connections_over_limit": (
        "kvrelay_connect_connections_over_limit",
        "Connections refused at the ZMTP handshake: the socket held its connection limit.",
    ),
    "connect_connections_key_refused": (
        "kvrelay_connect_connections_key_refused",
        "Connections refused at the ZMTP handshake: the publisher's CURVE public key is not in "
        "curve_client_keys_file.",
    ),
    "connect_address_mismatch": (
        "kvrelay_connect_address_mismatch",
        "Messages naming an engine bound to another publisher address (dropped).",
    ),
    "connect_key_mismatch": (
        "kvrelay_connect_key_mismatch",
        "Messages naming an engine the sender's CURVE key may not publish (engines= in "
        "curve_client_keys_file; dropped).",
    ),
    "connect_topic_too_long": (
        "kvrelay_connect_topic_too_long", "Messages whose topic is over max_topic_bytes."
    ),
    "connect_batch_too_large": (
        "kvrelay_connect_batch_too_large",
        "Payloads over max_batch_bytes (dropped; the member is reset).",
    ),
    "connect_member_block_cap": (
        "kvrelay_connect_member_block_cap",
        "Members reset for holding more than max_member_blocks blocks.",
    ),
    "connect_unattributed": (
        "kvrelay_connect_unattributed",
        "Undecodable payloads whose DP rank could not be read (the engine's members reset).",
    ),
}


class RelaySource(Protocol):
    """What the collector reads: statistics on demand, and observers to register with."""

    @property
    def observers(self) -> Observers: ...

    def stats(self) -> RelayStats: ...


class ReloadSource(Protocol):
    """Configuration reload outcomes (``kvrelay.ops.reload.ReloadStats``)."""

    applied: int
    rejected: int
    failed: int
    last_successful: bool
    last_success_unix: float
    restart_pending: tuple[str, ...]


class UpgradeSource(Protocol):
    """Hot upgrade outcomes (``kvrelay.ops.upgrade.UpgradeStats``)."""

    results: dict[str, int]


class ServiceSource(Protocol):
    def stats(self) -> tuple[dict[str, tuple[int, int]], dict[str, int]]:
        """(stream kind → (open streams, limit), error reason → count)."""
        ...


def guard_families(svc: object) -> Iterator[Metric]:
    """Streams refused by a per-connection/per-peer share and plane streams reset for not
    reading (``KvEventRelayService.guard_stats``); zero for a service without them."""
    guard = getattr(svc, "guard_stats", None)
    refusals, stalled, h2 = guard() if callable(guard) else ({}, {}, {})
    fam = CounterMetricFamily(
        "kvrelay_stream_share_refusals",
        "Streams refused on a full relay because their connection or peer address already held "
        "its share of the stream limit, by kind and scope (connection, peer).",
        labels=["kind", "scope"],
    )  # fmt: skip
    for kind in ("catalog", "pool", "readiness", "load", "serving_load", "health"):
        for scope in ("connection", "peer"):
            fam.add_metric([kind, scope], refusals.get((kind, scope), 0))
    yield fam
    stats = getattr(svc, "preemption_stats", None)
    preempted = stats() if callable(stats) else {}
    pre = CounterMetricFamily(
        "kvrelay_stream_share_preemptions",
        "Streams ended with RESOURCE_LIMIT to make room, on a full relay, for a client below its "
        "share, by kind and the scope (connection, peer) that was over its share.",
        labels=["kind", "scope"],
    )
    for kind in ("catalog", "pool", "readiness", "load", "serving_load", "health"):
        for scope in ("connection", "peer"):
            pre.add_metric([kind, scope], preempted.get((kind, scope), 0))
    yield pre
    resets = CounterMetricFamily(
        "kvrelay_stream_stalled_resets",
        "Plane streams (and GetRelayInfo calls: relay_info) ended because their client took no "
        "message for stalled_stream_reset_s (SUBSCRIBER_LAGGED, or reset mid-message).",
        labels=["kind"],
    )
    for kind in ("catalog", "readiness", "load", "serving_load", "relay_info"):
        resets.add_metric([kind], stalled.get(kind, 0))
    yield resets
    yield CounterMetricFamily(
        "kvrelay_stream_catalog_first_timeouts",
        "Pool streams ending with an error (a fence, a withdrawal) whose status went out after "
        "1 s without waiting further for a catalog stream whose client reads nothing to carry "
        "the catalog that withdrew the pool first.",
        value=stalled.get(CATALOG_FIRST_KIND, 0),
    )  # fmt: skip
    abuse = CounterMetricFamily(
        "kvrelay_http2_abuse",
        "gRPC connections closed with GOAWAY ENHANCE_YOUR_CALM for breaking a per-connection "
        "budget (rapid_reset, stream_flood, empty_frames, ping_flood, settings_flood, "
        "oversized_headers, window_update_flood: more WINDOW_UPDATE frames than the DATA the "
        "relay sent them accounts for, data_flood: more DATA frames not ending an open stream "
        "than its requests need), connections closed as accepted over a connection cap "
        "(too_many_connections), TLS handshakes that failed or did not finish in 10 s, or "
        "that resumed a session whose client certificate has expired since "
        "(tls_handshake), connections closed while still in their TLS handshake to make room "
        "for a new one under a full max_connections or max_connections_per_address "
        "(tls_handshake_evicted), connections "
        "closed for input the HTTP/2 stack could not take, "
        "with the GOAWAY code HTTP/2 gives it (protocol_error), streams reset for lacking "
        ":method or :path, or answered UNKNOWN for a grpc-timeout that does not read "
        "(malformed_headers), streams refused as they opened over the "
        "connection's concurrent-stream limit (refused_stream: RST_STREAM REFUSED_STREAM, the "
        "connection goes on), streams whose request never came "
        "(request_timeout), and requests refused because the requests being read held "
        "max_request_bytes_in_flight (request_bytes), and streams ended to make room past "
        "max_pending_requests streams waiting for their request (request_evicted); and "
        "requests answered before any handler: not gRPC (not_grpc: HTTP 405, 415 or 400) or "
        "for a method the relay does not serve (unknown_method: UNIMPLEMENTED).",
        labels=["reason"],
    )  # fmt: skip
    for reason in (*ABUSE_REASONS, "protocol_error", "malformed_headers", "refused_stream",
                   "request_timeout", "request_bytes", "request_evicted", "not_grpc",
                   "unknown_method"):  # fmt: skip
        abuse.add_metric([reason], h2.get(reason, 0))
    yield abuse
    tls_revoked = CounterMetricFamily(
        "kvrelay_tls_revoked_connections",
        "Client connections ended because a [tls] client_crl revokes the client's certificate: "
        "refused at the TLS handshake (handshake; also counted as tls_handshake abuse), or open "
        "when a reload brought the CRL and closed then, with their GOAWAY (open).",
        labels=["stage"],
    )  # fmt: skip
    tls_revoked.add_metric(["handshake"], h2.get("tls_revoked_handshake", 0))
    tls_revoked.add_metric(["open"], h2.get("tls_revoked_open", 0))
    yield tls_revoked
    authz = getattr(svc, "authz_stats", None)
    denials, revoked = authz() if callable(authz) else ({}, 0)
    denied = CounterMetricFamily(
        "kvrelay_authorization_denials",
        "Requests for an existing pool the client may not see under [[authorization]], answered as "
        "for an absent pool (SubscribeKvPool, HoldPublication), and HoldPublication requests from "
        "a client no rule with spacing = true names (PERMISSION_DENIED).", labels=["rpc"],
    )  # fmt: skip
    for rpc in ("SubscribeKvPool", "HoldPublication"):
        denied.add_metric([rpc], denials.get(rpc, 0))
    yield denied
    yield CounterMetricFamily(
        "kvrelay_authorization_revoked_streams",
        "Pool streams ended PUBLICATION_UNAVAILABLE because a rules reload took their pool away.",
        value=revoked,
    )


TlsSource = Callable[[], Iterable[Any]]  # () → LoadedCertificate-like (role, subject, not_after)


def tls_families(source: TlsSource | None) -> Iterator[Metric]:
    """Expiry of every certificate a TLS context was loaded with (after each reload), and when
    each client CRL is due (only with ``[tls] client_crl``: a CRL is renewed far more often than
    a certificate, so it has a gauge of its own, out of the certificate alerts' way)."""
    fam = GaugeMetricFamily(
        "kvrelay_tls_certificate_expiry_timestamp_seconds",
        "notAfter (Unix time) of each loaded certificate, by role (server, client_ca, "
        "upstream_ca, upstream_client) and subject CN; time left = it - time().",
        labels=["role", "subject"],
    )
    earliest: dict[tuple[str, str], float] = {}
    for c in source() if source is not None else ():
        key = (c.role, c.subject)
        earliest[key] = min(earliest.get(key, c.not_after_unix), c.not_after_unix)
    crls = {subject: t for (role, subject), t in earliest.items() if role == "client_crl"}
    for (role, subject), t in sorted(earliest.items()):
        if role != "client_crl":
            fam.add_metric([role, subject], t)
    yield fam
    if crls:
        due = GaugeMetricFamily(
            "kvrelay_tls_client_crl_next_update_timestamp_seconds",
            "nextUpdate (Unix time) of the [tls] client_crl CRLs, by issuer CN (the earliest "
            "of an issuer's): past it OpenSSL refuses every client of that CA until a fresh "
            "CRL is loaded (reload).",
            labels=["issuer"],
        )  # fmt: skip
        for issuer, t in sorted(crls.items()):
            due.add_metric([issuer], t)
        yield due


#: The outcomes of the state files (``relay.state_restores`` at start, ``relay.state_saves`` at a
#: clean stop and at each checkpoint), exported at 0 from the start: a checkpoint that fails
#: (a full disk) is what an alert on ``increase()`` must see the first time.
STATE_RESTORE_RESULTS = ("restored", "none", "corrupt", "version", "stale", "incompatible",
                         "oversized", "unreadable", "unsafe_dir", "unusable_dir")  # fmt: skip
STATE_SAVE_RESULTS = ("saved", "failed", "checkpointed", "checkpoint_failed", "checkpoint_busy",
                      "checkpoint_overrun", "unsafe_dir", "unusable_dir")  # fmt: skip


def known_at_zero(values: Iterable[_K], counts: Mapping[_K, int]) -> dict[_K, int]:
    """``counts`` with every known value in ``values`` at 0 where it has none."""
    return {**dict.fromkeys(values, 0), **counts}


#: The ingest families' known values (per source, or per pool), and the generations' errors.
_INGEST_KNOWN = (
    ("rejections", DECODE_REJECTION_KINDS),
    ("drops", INGEST_DROP_REASONS),
    ("resets_by_reason", INGEST_RESET_REASONS),
)
_AT_ZERO: Flat = {(attr, value): 0 for attr, values in _INGEST_KNOWN for value in values}
_ERRORS_AT_ZERO: Flat = {("errors", kind): 0 for kind in POOL_ERROR_KINDS}


def service_families(svc: ServiceSource) -> Iterator[Metric]:
    """The router-facing service's streams by kind, its contract errors by reason (every
    reason from the start) and its guard counters (a relay's and a mirror's endpoint alike)."""
    streams, errors_by_reason = svc.stats()
    subs = GaugeMetricFamily(
        "kvrelay_stream_subscribers", "Open streams by kind.", labels=["kind"]
    )
    limit = GaugeMetricFamily(
        "kvrelay_stream_subscriber_limit", "Configured stream limit by kind.", labels=["kind"]
    )
    for kind, (open_, cap) in streams.items():
        subs.add_metric([kind], open_)
        limit.add_metric([kind], cap)
    errors = CounterMetricFamily(
        "kvrelay_stream_errors",
        "Streams/calls ended with a contract error, by reason (a pool stream reset with its "
        "status unread, after stalled_stream_reset_s, is counted by the reason it ended with).",
        labels=["reason"],
    )
    for reason, n in sorted(known_at_zero(STREAM_ERROR_REASONS, errors_by_reason).items()):
        errors.add_metric([reason], n)
    yield subs
    yield limit
    yield errors
    yield from guard_families(svc)


def _flatten_subscriber(c: SubscriberCounters) -> Flat:
    out: Flat = {}
    for attr in _SUB_SCALARS:
        out[(attr, "")] = getattr(c, attr)
    for attr in _SUB_ANOMALIES:
        out[("anomalies", attr)] = getattr(c, attr)
    for attr in _SUB_DICTS:
        d: dict[str, int] = getattr(c, attr)
        for label, n in d.items():
            out[(attr, label)] = n
    return out


def _flatten_generations(t: GenerationTotals) -> Flat:
    out: Flat = {(attr, ""): getattr(t, attr) for attr, (_n, _d, label) in _GEN_COUNTERS.items()
                 if label is None}
    for kind, n in t.errors.items():
        out[("errors", kind)] = n
    return out


class MergingRegistry(CollectorRegistry):
    """A registry that writes every family once: the samples of families of one name that
    several collectors yield are joined into one family.

    A ``kvrelay mirror`` with ``workers = N`` has two such collectors: the mirror's own
    ``kvrelay_mirror_*`` families (``worker=""``) and the supervisor's, with a sample per worker.
    Written as they came, each family's ``# HELP``/``# TYPE`` appeared twice: an invalid page
    that an OpenMetrics parser refuses (and Prometheus may read in part). The collectors'
    ``describe`` is empty (registration never collects), so the registry's own duplicate check
    cannot catch it at registration."""

    def collect(self) -> Iterator[Metric]:
        joined: dict[str, Metric] = {}
        for fam in super().collect():
            prior = joined.get(fam.name)
            if prior is None:
                joined[fam.name] = fam
                continue
            if prior.type != fam.type:
                raise ValueError(f"metric {fam.name} collected as {prior.type} and {fam.type}")
            both = Metric(prior.name, prior.documentation, prior.type, prior.unit)
            both.samples = [*prior.samples, *fam.samples]
            joined[fam.name] = both
        return iter(joined.values())


def default_registry() -> CollectorRegistry:
    """A private registry with the standard process/platform/GC collectors (not the global one,
    so several relays in one process — tests — never clash), that writes each family once."""
    reg = MergingRegistry()
    ProcessCollector(registry=reg)
    PlatformCollector(registry=reg)
    GCCollector(registry=reg)
    return reg


@dataclass(frozen=True, slots=True)
class _Scrape:
    """What one scrape read on the event loop; its families are built from it in any thread."""

    stats: RelayStats
    live: tuple[Metric, ...]


class RelayMetrics:
    """All kvrelay metrics for one relay, plus the ``/metrics`` HTTP endpoint."""

    def __init__(
        self,
        relay: RelaySource,
        registry: CollectorRegistry | None = None,
        *,
        service: ServiceSource | None = None,
        per_member: bool = True,
    ) -> None:
        self.relay = relay
        self.registry = registry if registry is not None else default_registry()
        self._service = service
        self._reloads: ReloadSource | None = None
        self._upgrades: UpgradeSource | None = None
        self.per_member = per_member  # False: ingest families summed per pool
        self.delta_latency = Histogram(
            "kvrelay_delta_latency_seconds",
            "First applied command of a delta to its publication (relay share of latency).",
            ["pool"],
            buckets=DELTA_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.loop_lag = Histogram(
            "kvrelay_event_loop_lag_seconds",
            "Event loop scheduling lag samples.",
            buckets=LOOP_LAG_BUCKETS,
            registry=self.registry,
        )
        self.loop_lag_last = Gauge(
            "kvrelay_event_loop_lag_last_seconds",
            "Most recent event loop lag sample.",
            registry=self.registry,
        )
        self.registry.register(_RelayCollector(self))
        pauses()  # garbage collections are timed from now on
        self._http: MetricsServer | None = None
        self.http_counters = HttpCounters()
        self._tls: TlsSource | None = None
        relay.observers.add(self)

    # ---- wiring ----------------------------------------------------------------------------------

    def attach_service(self, service: ServiceSource) -> None:
        """Export the gRPC service's per-stream-kind subscriber counts and error counts."""
        self._service = service

    def attach_tls(self, certificates: TlsSource) -> None:
        """Export the expiry of the certificates the listener serves and trusts."""
        self._tls = certificates

    def attach_reloads(self, reloads: ReloadSource) -> None:
        """Export configuration reload outcomes (the daemon's SIGHUP handling)."""
        self._reloads = reloads

    def attach_upgrades(self, upgrades: UpgradeSource) -> None:
        """Export hot upgrade outcomes (the daemon's SIGUSR2 handling)."""
        self._upgrades = upgrades

    def observe_loop_lag(self, seconds: float) -> None:
        if math.isnan(seconds):
            return
        s = max(0.0, seconds)
        self.loop_lag.observe(s)
        self.loop_lag_last.set(s)

    # ---- RelayObserver ---------------------------------------------------------------------------

    def delta_published(self, pool: str, seconds: float) -> None:
        self.delta_latency.labels(pool=pool).observe(seconds)

    def pool_removed(self, pool: str) -> None:
        """A removed pool's latency series go with it (18 per pool stayed for the relay's life)."""
        with contextlib.suppress(KeyError):
            self.delta_latency.remove(pool)

    # ---- collection (called by the registry at scrape time) -------------------------------------

    def collect(self) -> Iterator[Metric]:
        """Every kvrelay family: from the snapshot a :class:`Collected` pinned for this relay
        (off the loop), else from the relay's state now (on the loop)."""
        scrape = pinned(self)
        if isinstance(scrape, _Scrape):
            stats, live = scrape.stats, scrape.live
        else:
            stats, live = self.relay.stats(), None
        yield from _relay_metrics(stats)
        yield from _pool_metrics(stats)
        yield from _member_metrics(stats, self.per_member)
        yield from _source_metrics(stats)
        yield from _generation_metrics(stats)
        yield from live if live is not None else self._live_families()

    def _live_families(self) -> Iterator[Metric]:
        """The families read from live objects as they are built (few samples each)."""
        yield from gc_pause_families(pauses())
        yield from self._service_metrics()
        yield from self._reload_metrics()
        yield from http_metrics(self.http_counters)
        yield from tls_families(self._tls)
        yield from self._upgrade_metrics()

    def _upgrade_metrics(self) -> Iterator[Metric]:
        yield from upgrade_families(self._upgrades)

    def _reload_metrics(self) -> Iterator[Metric]:
        yield from reload_families(self._reloads)

    def _service_metrics(self) -> Iterator[Metric]:
        if self._service is not None:
            yield from service_families(self._service)

    # ---- HTTP endpoint ---------------------------------------------------------------------------

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def collected(self) -> Collected:
        """What the endpoint serves. On the loop: the relay's snapshot (``Relay.stats``, whose
        counters are copies the relay no longer changes) and the few families read from live
        objects. Off it, in the executor: every family built from that snapshot, and the text."""
        scrape = _Scrape(self.relay.stats(), tuple(self._live_families()))
        return Collected(self.registry, pins={self: scrape})

    async def start_http(
        self,
        host: str,
        port: int,
        healthy: Callable[[], bool] | None = None,
        limits: HttpLimits | None = None,
        sock: socket.socket | None = None,
    ) -> int:
        """Serve ``/metrics`` (and ``/healthz``: 200 while ``healthy()``) on the running loop
        (on ``sock`` when given: a hot upgrade's inherited listener); returns the bound port."""
        if self._http is not None:
            raise RuntimeError("metrics endpoint already started")
        self._http = MetricsServer(
            self.collected, healthy or (lambda: True), limits, self.http_counters
        )
        return await self._http.start(host, port, sock)

    def listening_socket(self) -> socket.socket | None:
        """The endpoint's listener, if it serves one."""
        return None if self._http is None else self._http.listening_socket()

    async def close(self) -> None:
        """Stop the endpoint and stop observing the relay."""
        self.relay.observers.remove(self)
        http, self._http = self._http, None
        if http is not None:
            await http.close()


def _relay_metrics(r: RelayStats) -> Iterator[Metric]:
    info = InfoMetricFamily("kvrelay_relay", "Relay identity.")
    info.add_metric(
        [],
        {
            "version": __version__,
            "dc_name": r.dc_name,
            "dc_id": str(r.dc_id),
            "drt_instance_id": str(r.drt_instance_id),
            "incarnation": str(r.relay_incarnation),
        },
    )
    yield info
    for name, doc, value in (
        ("kvrelay_catalog_revision", "Current pool catalog revision.", r.catalog_revision),
        ("kvrelay_readiness_revision", "Current serving readiness revision.",
         r.readiness_revision),
        ("kvrelay_load_revision", "Current load window version.", r.load_version),
        ("kvrelay_pool_hubs_initialized", "Publication hubs holding a permit.",
         r.hubs_initialized),
        ("kvrelay_pool_hubs_limit", "max_initialized_pool_hubs.", r.hubs_limit),
    ):
        yield GaugeMetricFamily(name, doc, value=value)
    yield CounterMetricFamily(
        "kvrelay_pool_metadata_rejections",
        "Catalog/topology refreshes that rejected a pool's engine metadata.",
        value=r.metadata_errors,
    )
    by_rule = CounterMetricFamily(
        "kvrelay_metadata_rejections",
        "Pools or endpoints left out of a plane for invalid metadata, by plane and rule.",
        labels=["plane", "rule"],
    )
    for (plane, rule), n in sorted(known_at_zero(_METADATA_KEYS, r.metadata_rejections).items()):
        by_rule.add_metric([plane, rule], n)
    yield by_rule
    for name, doc, value in (
        ("kvrelay_pool_hubs_evicted", "Idle hubs retired to free a hub permit.", r.hubs_evicted),
        ("kvrelay_dns_removals_deferred",
         "Engines absent from DNS kept because their ZMQ stream was live (once per absence).",
         r.dns_removals_deferred),
        ("kvrelay_dns_engines_duplicate",
         "Addresses from DNS not added: another engine is reached there (once per address).",
         r.dns_duplicates),
        ("kvrelay_dns_resolutions", "DNS lookups of the pools' dns names that were answered.",
         r.dns_resolutions),
        ("kvrelay_dns_resolution_failures",
         "DNS lookups that failed (SERVFAIL, no nameserver answering, timeout) or were refused "
         "(more than 1,024 engines): nothing changed. NXDOMAIN or an answer without records is "
         "an answer (every engine gone), not a failure.", r.dns_failures),
        ("kvrelay_dns_engines_added", "Engines added because DNS named a new address.",
         r.dns_engines_added),
        ("kvrelay_dns_engines_removed",
         "Engines removed because DNS no longer named their address (and their streams were "
         "down for the grace).", r.dns_engines_removed),
        ("kvrelay_scrape_errors", "Engine /metrics scrapes that failed unexpectedly.",
         r.scrape_errors),
    ):
        yield CounterMetricFamily(name, doc, value=value)
    failed = CounterMetricFamily(
        "kvrelay_engine_scrape_failures",
        "Engine /metrics pages not read (that engine's load and serving figures unknown until "
        "the next good one), by reason: unreachable (no connection or no whole answer in time), "
        "status (not 200), malformed (cut short, unparsable, a series listed twice, a value that "
        "is no count, a Content-Encoding), oversized (over 8 MiB, 65,536 chunks or 8,192 lines "
        "of the samples read).",
        labels=["reason"],
    )
    for reason in ("unreachable", "status", "malformed", "oversized"):
        failed.add_metric([reason], r.scrape_failures.get(reason, 0))
    yield failed
    refused = CounterMetricFamily(
        "kvrelay_control_reply_refusals",
        "vllm.Control replies refused as no engine's (that engine's snapshot, or the optional "
        "value, unknown this poll), by reason: too_large (length prefix over 1 MiB, refused "
        "before the body is read), undecodable (broken wire format, or not the message), "
        "implausible (parallelism, sources, adapters, aliases or fields no engine has; lists "
        "and fields counted before the reply is parsed), flood (the connection closed for PING, "
        "SETTINGS or WINDOW_UPDATE frames past their budget).",
        labels=["reason"],
    )
    counts = dict(REFUSED)  # process-wide: discovery runs in the relay process only
    for reason in REPLY_REFUSALS:
        refused.add_metric([reason], counts.get(reason, 0))
    yield refused
    yield _by_result(
        "kvrelay_state_restores",
        "State files at start by outcome: restored, none, corrupt, version, stale, incompatible, "
        "oversized, unreadable, unsafe_dir, unusable_dir.",
        known_at_zero(STATE_RESTORE_RESULTS, r.state_restores),
    )  # fmt: skip
    yield _by_result(
        "kvrelay_state_saves",
        "Pool states written, by result: saved, failed (a clean stop), checkpointed, "
        "checkpoint_failed, checkpoint_busy, checkpoint_overrun (periodic), unsafe_dir, "
        "unusable_dir.",
        known_at_zero(STATE_SAVE_RESULTS, r.state_saves),
    )
    ckpt = GaugeMetricFamily(
        "kvrelay_state_checkpoint_timestamp_seconds",
        "Unix time of each pool's last checkpoint written (absent before the first).",
        labels=["pool"],
    )
    for pool, t in sorted(r.checkpoint_unix.items()):
        ckpt.add_metric([pool], t)
    yield ckpt
    age = GaugeMetricFamily(
        "kvrelay_pool_scrub_last_pass_age_seconds",
        "Seconds since each pool's last full scrub pass (absent before the first).",
        labels=["pool"],
    )
    ok = GaugeMetricFamily(
        "kvrelay_pool_scrub_last_pass_ok",
        "1 when each pool's last full scrub pass found nothing wrong, else 0.", labels=["pool"],
    )
    now = time.time()
    for pool, (t, good) in sorted(r.scrub_last.items()):
        age.add_metric([pool], max(0.0, now - t))
        ok.add_metric([pool], 1.0 if good else 0.0)
    yield age
    yield ok
    windows = CounterMetricFamily(
        "kvrelay_window_errors",
        "Load (plane load) and serving-load (serving_load) windows skipped because they could not "
        "be built (kind window), and entries dropped from a window as invalid or listed twice "
        "(kind entry).",
        labels=["plane", "kind"],
    )
    for (plane, kind), n in sorted(known_at_zero(_WINDOW_ERROR_KEYS, r.window_errors).items()):
        windows.add_metric([plane, kind], n)
    yield windows


def _pool_metrics(r: RelayStats) -> Iterator[Metric]:
    pc = {
        attr: CounterMetricFamily(name, doc, labels=["pool"])
        for attr, (name, doc) in _POOL_COUNTERS.items()
    }
    resets = CounterMetricFamily(
        "kvrelay_pool_member_resets", "Member clears by reason (pool side, incl. incarnation).",
        labels=["pool", "reason"],
    )
    handshakes = CounterMetricFamily(
        "kvrelay_connect_handshakes_failed",
        "Connections to the connect socket whose ZMTP handshake failed before the relay's own "
        "check, by reason: protocol (a malformed handshake, or the wrong security mechanism, "
        "which may count as unfinished instead), auth (a security check other than the relay's "
        "refused it), unfinished (the peer hung up or did not finish within 10 s), not_zmtp3 (a "
        "connection from outside the allow list, or one closed before its address could be "
        "read, whose first bytes were not a ZMTP 3 greeting).",
        labels=["pool", "reason"],
    )
    g = {
        name: GaugeMetricFamily(name, doc, labels=["pool"])
        for name, doc in (
            ("kvrelay_ckf_capacity_slots", "CKF fingerprint slots (buckets × 4)."),
            ("kvrelay_ckf_buckets", "CKF bucket count."),
            ("kvrelay_pool_materialized", "1 while the pool has a live generation."),
        )
    }
    sources = GaugeMetricFamily(
        "kvrelay_ingest_sources",
        "Subscribers by state: replaying, live, disconnected (past its replay, no connection to "
        "its publisher), flapping (its connections end without a message), failed.",
        labels=["pool", "state"],
    )
    engines = GaugeMetricFamily(
        "kvrelay_engine_reachable", "1 if the engine's last probe reached it.",
        labels=["pool", "worker"],
    )
    down = GaugeMetricFamily(
        "kvrelay_engine_down", "1 while the engine is declared down (members cleared).",
        labels=["pool", "worker"],
    )
    unknown = GaugeMetricFamily(
        "kvrelay_engine_control_unknown",
        "1 for each optional Control RPC that failed on the last probe (value kept, not trusted).",
        labels=["pool", "worker", "rpc"],
    )
    for p in r.pools:
        for attr, fam in pc.items():
            fam.add_metric([p.name], p.counters[attr])
        for reason, n in sorted(known_at_zero(POOL_RESET_REASONS, p.member_resets).items()):
            resets.add_metric([p.name, reason], n)
        for reason, attr in ConnectCounters.HANDSHAKE_FAILURES.items():
            handshakes.add_metric([p.name, reason], p.counters.get(f"connect_{attr}", 0))
        g["kvrelay_ckf_capacity_slots"].add_metric([p.name], p.bucket_count * SLOTS_PER_BUCKET)
        g["kvrelay_ckf_buckets"].add_metric([p.name], p.bucket_count)
        g["kvrelay_pool_materialized"].add_metric([p.name], int(p.materialized))
        states: dict[str, int] = {}
        for s in p.sources:
            if s.state != "stopped":
                states[s.state] = states.get(s.state, 0) + 1
        for state, n in sorted(states.items()):
            sources.add_metric([p.name, state], n)
        for e in p.engines:
            engines.add_metric([p.name, e.name], int(e.reachable))
            down.add_metric([p.name, e.name], int(e.down))
            for rpc in e.control_unknown:
                unknown.add_metric([p.name, e.name, rpc], 1)
    yield from pc.values()
    yield resets
    yield handshakes
    yield from g.values()
    yield sources
    yield engines
    yield down
    yield unknown


def _member_metrics(r: RelayStats, per_member: bool = True) -> Iterator[Metric]:
    """Ingest counters and the lag histogram per (pool, worker, dp_rank), or summed per pool."""
    member = list(_MEMBER) if per_member else ["pool"]
    fams: dict[str, CounterMetricFamily] = {}
    for attr, (name, doc) in _SUB_SCALARS.items():
        fams[attr] = CounterMetricFamily(name, doc, labels=member)
    fams["anomalies"] = CounterMetricFamily(
        "kvrelay_ingest_decode_anomalies", "Tolerated decode anomalies by kind.",
        labels=[*member, "kind"],
    )
    for attr, (name, doc, label) in _SUB_DICTS.items():
        fams[attr] = CounterMetricFamily(name, doc, labels=[*member, label])
    lag = HistogramMetricFamily("kvrelay_ingest_engine_lag_seconds", _LAG_HELP, labels=member)
    for p in r.pools:
        groups: dict[tuple[str, ...], list[SubscriberCounters]] = {}
        for s in p.sources:
            key: tuple[str, ...] = (p.name, s.engine, str(s.dp_rank)) if per_member else (p.name,)
            groups.setdefault(key, []).append(s.counters)
        for key, counters in groups.items():
            flat: Flat = dict(_AT_ZERO)
            for c in counters:
                for k, n in _flatten_subscriber(c).items():
                    flat[k] = flat.get(k, 0) + n
            for (attr, label), n in sorted(flat.items()):
                fams[attr].add_metric(
                    list(key) if attr in _SUB_SCALARS else [*key, label], n
                )
            buckets, lag_sum = _lag_buckets(counters)
            lag.add_metric(list(key), buckets, lag_sum)
    yield from fams.values()
    yield lag


def _lag_buckets(counters: Iterable[SubscriberCounters]) -> tuple[list[tuple[str, float]], float]:
    """Cumulative Prometheus buckets from the counters' per-bucket counts."""
    per: dict[str, int] = {}
    total_s = 0.0
    for c in counters:
        for k, n in c.lag_buckets.items():
            per[k] = per.get(k, 0) + n
        total_s += c.lag_sum_s
    return cumulative_buckets(LAG_BUCKETS_S, per), total_s


def cumulative_buckets(
    bounds: Iterable[float], per: Mapping[str, int]
) -> list[tuple[str, float]]:
    """Prometheus's cumulative buckets from counts per bucket keyed by the bound's ``repr``
    (and ``+Inf``)."""
    out: list[tuple[str, float]] = []
    running = 0
    for key in (*(repr(b) for b in bounds), "+Inf"):
        running += per.get(key, 0)
        out.append((key, running))
    return out


def gc_pause_families(p: GcPauses) -> Iterator[Metric]:
    """``kvrelay_gc_pause_seconds`` (a relay's and a mirror's endpoint alike)."""
    fam = HistogramMetricFamily(
        "kvrelay_gc_pause_seconds",
        "Wall time of each garbage collection, by generation (2: a full collection). It holds "
        "the thread that allocated, usually the event loop.",
        labels=["generation"],
    )  # fmt: skip
    for gen in gc_pauses.GENERATIONS:
        buckets = cumulative_buckets(gc_pauses.BUCKETS_S, p.counts[gen])
        fam.add_metric([str(gen)], buckets, p.sums[gen])
    yield fam


def _source_metrics(r: RelayStats) -> Iterator[Metric]:
    """Per running source, always (bounded by the configuration): when it last delivered."""
    last = GaugeMetricFamily(
        "kvrelay_ingest_last_message_timestamp_seconds",
        "Unix time of the source's last applied message (0: none yet); staleness = time() - it.",
        labels=list(_MEMBER),
    )
    for p in r.pools:
        for s in p.sources:
            if s.state != "stopped":
                last.add_metric([p.name, s.engine, str(s.dp_rank)], s.counters.last_message_unix)
    yield last


def _generation_metrics(r: RelayStats) -> Iterator[Metric]:
    fams: dict[str, CounterMetricFamily] = {
        attr: CounterMetricFamily(name, doc, labels=["pool"] + ([label] if label else []))
        for attr, (name, doc, label) in _GEN_COUNTERS.items()
    }
    for p in r.pools:
        flat = {**_ERRORS_AT_ZERO, **_flatten_generations(p.generations)}
        for (attr, label), n in sorted(flat.items()):
            fams[attr].add_metric([p.name, label] if label else [p.name], n)
    yield from fams.values()
    g = {
        name: GaugeMetricFamily(name, doc, labels=["pool"])
        for name, doc in (
            ("kvrelay_ckf_occupancy_fingerprints", "Fingerprints in the CKF table."),
            ("kvrelay_pool_members", "Members (engine, dp_rank) in the generation."),
            ("kvrelay_pool_memberships", "Member-to-block lineage edges."),
            ("kvrelay_pool_distinct_blocks", "Distinct canonical blocks owned."),
            ("kvrelay_pool_state_bytes", "Allocated bytes of the exact state (not the CKF)."),
            ("kvrelay_pool_sequence", "Current producer sequence."),
            ("kvrelay_pool_layout_generation", "Current layout generation."),
            ("kvrelay_pool_subscribers", "Open SubscribeKvPool streams on the pool."),
        )
    }
    for p in r.pools:
        gen = p.generation
        if gen is None:
            continue
        for name, value in (
            ("kvrelay_ckf_occupancy_fingerprints", gen.occupancy),
            ("kvrelay_pool_members", gen.members),
            ("kvrelay_pool_memberships", gen.memberships),
            ("kvrelay_pool_distinct_blocks", gen.distinct_blocks),
            ("kvrelay_pool_state_bytes", gen.state_bytes),
            ("kvrelay_pool_sequence", gen.sequence),
            ("kvrelay_pool_layout_generation", gen.layout_generation),
            ("kvrelay_pool_subscribers", gen.subscribers),
        ):
            g[name].add_metric([p.name], value)
    yield from g.values()


class _RelayCollector(Collector):
    """Registry adapter; ``describe`` is empty so registration never triggers a collection."""

    def __init__(self, metrics: RelayMetrics) -> None:
        self._metrics = metrics

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        return self._metrics.collect()


def _by_result(name: str, doc: str, counts: Mapping[str, int]) -> CounterMetricFamily:
    """A counter with one sample per ``result`` label, in label order."""
    family = CounterMetricFamily(name, doc, labels=["result"])
    for result, n in sorted(counts.items()):
        family.add_metric([result], n)
    return family


def reload_families(r: ReloadSource | None) -> Iterator[Metric]:
    """``kvrelay_config_reloads_total`` and the last reload's outcome (a relay's and a mirror's
    endpoint alike: ``kvrelay reload`` reads them)."""
    if r is None:
        return
    total = CounterMetricFamily(
        "kvrelay_config_reloads", "Configuration reloads (SIGHUP) by result: applied, "
        "rejected (invalid file, running configuration kept), failed.", labels=["result"],
    )  # fmt: skip
    for result in ("applied", "rejected", "failed"):
        total.add_metric([result], getattr(r, result))
    yield total
    yield GaugeMetricFamily(
        "kvrelay_config_last_reload_successful",
        "1 if the last reload was applied (or none happened since start).",
        value=1 if r.last_successful else 0,
    )
    yield GaugeMetricFamily(
        "kvrelay_config_last_reload_success_timestamp_seconds",
        "Unix time of the last applied reload (or of start).",
        value=r.last_success_unix,
    )
    # the names are setting paths of a fixed set (``ops/reload.py``): a bounded label
    yield GaugeMetricFamily(
        "kvrelay_config_restart_pending",
        "Settings the configuration file changed that only a restart applies (as of the last "
        "applied reload; 0 after a restart).",
        value=len(r.restart_pending),
    )
    pending = InfoMetricFamily(
        "kvrelay_config_restart_pending_setting",
        "One series per setting that waits for a restart (kvrelay_config_restart_pending).",
        labels=["setting"],
    )
    for setting in r.restart_pending:
        pending.add_metric([setting], {})
    yield pending


def upgrade_families(u: UpgradeSource | None) -> Iterator[Metric]:
    """``kvrelay_upgrades_total`` (a relay's and a mirror's endpoint alike)."""
    if u is None:
        return
    yield _by_result(
        "kvrelay_upgrades", "Hot upgrades (SIGUSR2) by result: handed_over and taken_over "
        "(the old and the new process), refused, spawn_failed, cut_failed, successor_exited, "
        "successor_failed, timeout (the old process keeps serving).", u.results,
    )  # fmt: skip
