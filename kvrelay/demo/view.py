"""Plain-ANSI live view and summaries of the demo (no curses, no extra dependency).

``Snapshot`` gathers everything once per tick from the relay (filters, subscribers) and from the
consumer (catalog, readiness, latency, as received over gRPC); ``render`` turns it into text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.demo.consumer import Consumer, latency_percentiles

RESET, BOLD, DIM = "\x1b[0m", "\x1b[1m", "\x1b[2m"
GREEN, YELLOW, RED, CYAN = "\x1b[32m", "\x1b[33m", "\x1b[31m", "\x1b[36m"
HOME, CLEAR_DOWN, CLEAR = "\x1b[H", "\x1b[J", "\x1b[2J"
#: Erase to the end of the line: a redrawn line shorter than the one before leaves no old tail.
CLEAR_LINE = "\x1b[K"


def redraw(frame: str) -> str:
    """One frame drawn over the previous one: home, every line cleared to its end, the rest of
    the screen below it cleared."""
    return HOME + frame.replace("\n", CLEAR_LINE + "\n") + CLEAR_LINE + "\n" + CLEAR_DOWN
HIDE_CURSOR, SHOW_CURSOR = "\x1b[?25l", "\x1b[?25h"
#: A CKF bucket is one u64 word of four 16-bit fingerprint slots (contract §6).
SLOTS_PER_BUCKET = 4


def role_name(r: Any) -> str:
    try:
        return str(pb.WorkerRole(int(r)).name)
    except ValueError:
        return str(int(r))


def state_name(s: Any) -> str:
    try:
        return str(pb.ServingReadinessState(int(s)).name)
    except ValueError:
        return str(int(s))


@dataclass(slots=True)
class PoolRow:
    name: str
    generation: int | None
    roles: list[str]
    registrations: list[str]
    fingerprints: int
    capacity: int
    subscribers: int
    deltas: int
    snapshots: int
    delta_rate: float
    p50_ms: float | None
    p99_ms: float | None


@dataclass(slots=True)
class ModelRow:
    namespace: str
    model: str
    state: str
    missing: list[str]
    adapters: list[tuple[str, str]]


@dataclass(slots=True)
class Snapshot:
    elapsed_s: float
    duration_s: float
    address: str
    catalog_revision: int
    pools: list[PoolRow] = field(default_factory=list)
    models: list[ModelRow] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    events: list[str] = field(default_factory=list)
    p50_ms: float | None = None
    p99_ms: float | None = None
    #: A ``kvrelay query`` line whose tokens the aggregated pool holds (the simulator's most
    #: popular system prompt), and the depth the demo's own SDK query found for it at the end.
    hit_query: str = ""
    hit_depth: int | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "duration_s": round(self.elapsed_s, 2),
            "grpc": self.address,
            "catalog_revision": self.catalog_revision,
            "deltas_total": sum(p.deltas for p in self.pools),
            "ready_models": sum(1 for m in self.models if m.state == "READY"),
            "latency_p50_ms": _r(self.p50_ms),
            "latency_p99_ms": _r(self.p99_ms),
            "consumer_errors": dict(self.errors),
            "hit_query": {"command": self.hit_query, "depth_blocks": self.hit_depth},
            "pools": [
                {
                    "pool": p.name,
                    "generation": p.generation,
                    "roles": p.roles,
                    "registrations": p.registrations,
                    "fingerprints": p.fingerprints,
                    "capacity": p.capacity,
                    "subscribers": p.subscribers,
                    "snapshots": p.snapshots,
                    "deltas": p.deltas,
                    "latency_p50_ms": _r(p.p50_ms),
                    "latency_p99_ms": _r(p.p99_ms),
                }
                for p in self.pools
            ],
            "models": [
                {
                    "namespace": m.namespace,
                    "model": m.model,
                    "state": m.state,
                    "missing_roles": m.missing,
                    "adapters": {a: s for a, s in m.adapters},
                }
                for m in self.models
            ],
        }


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 3)


def take_snapshot(
    relay: Any,
    consumer: Consumer,
    *,
    elapsed_s: float,
    duration_s: float,
    address: str,
    previous: dict[str, int],
    interval_s: float,
) -> Snapshot:
    """Collect one frame; ``previous`` (pool → delta count at the last tick) is updated."""
    snap = Snapshot(elapsed_s, duration_s, address, consumer.catalog_revision)
    for pool in relay.pools:
        name = pool.name
        gen = pool.generation
        desc = consumer.catalog.get(name)
        stream = consumer.streams.get(name)
        deltas = stream.deltas if stream is not None else 0
        rate = (deltas - previous.get(name, deltas)) / interval_s if interval_s > 0 else 0.0
        previous[name] = deltas
        p50, p99 = stream.percentiles_ms() if stream is not None else (None, None)
        regs = []
        if desc is not None:
            for reg in desc.registrations:
                lora = reg.target is not None and reg.target.lora is not None
                regs.append(reg.canonical_model_id + (" (lora)" if lora else ""))
        snap.pools.append(
            PoolRow(
                name=name,
                generation=None if gen is None else gen.layout_generation,
                roles=[role_name(r) for r in desc.pool_roles] if desc is not None else [],
                registrations=regs,
                fingerprints=0 if gen is None else int(gen.pool.occupancy),
                capacity=pool.spec.bucket_count * SLOTS_PER_BUCKET,
                subscribers=0 if gen is None else gen.subscriber_count,
                deltas=deltas,
                snapshots=stream.snapshots if stream is not None else 0,
                delta_rate=max(0.0, rate),
                p50_ms=p50,
                p99_ms=p99,
            )
        )
    for e in consumer.readiness:
        snap.models.append(
            ModelRow(
                namespace=e.namespace,
                model=e.canonical_model_id,
                state=state_name(e.state),
                missing=[role_name(r) for r in e.missing_roles],
                adapters=[(a.canonical_model_id, state_name(a.state)) for a in e.adapters],
            )
        )
    snap.errors = dict(consumer.errors)
    snap.p50_ms, snap.p99_ms = latency_percentiles(consumer.all_latencies())
    return snap


def _state(s: str, color: bool) -> str:
    if not color:
        return s
    c = {"READY": GREEN, "UNAVAILABLE": RED}.get(s, YELLOW)
    return f"{c}{s}{RESET}"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def render(s: Snapshot, color: bool = True) -> str:
    b = (lambda t: f"{BOLD}{t}{RESET}") if color else (lambda t: t)
    d = (lambda t: f"{DIM}{t}{RESET}") if color else (lambda t: t)
    lines = [
        b(f"kvrelay demo  ·  relay gRPC {s.address}  ·  ")
        + b(f"{s.elapsed_s:5.1f} s / {s.duration_s:.0f} s")
        + d("  ·  Ctrl-C to stop"),
        "",
        b(f"CATALOG  (revision {s.catalog_revision})"),
        f"  {'POOL':<26} {'GEN':>4}  {'ROLES':<12} REGISTRATIONS",
    ]
    for p in s.pools:
        gen = "-" if p.generation is None else str(p.generation)
        lines.append(
            f"  {p.name:<26} {gen:>4}  {','.join(p.roles) or '-':<12} "
            f"{', '.join(p.registrations) or d('(not in catalog yet)')}"
        )
    lines += [
        "",
        b("READINESS"),
        f"  {'NAMESPACE':<10} {'MODEL':<16} {'STATE':<12} MISSING  ADAPTERS",
    ]
    if not s.models:
        lines.append(d("  (no topology yet)"))
    for m in s.models:
        adapters = ", ".join(f"{a}:{_state(st, color)}" for a, st in m.adapters) or "-"
        state = _state(m.state, color) + " " * max(0, 12 - len(m.state))
        lines.append(
            f"  {m.namespace:<10} {m.model:<16} {state} {','.join(m.missing) or '-':<8} {adapters}"
        )
    lines += [
        "",
        b("POOLS  (filter = fingerprints / capacity; latency = send_ts_us → consumer receive)"),
        f"  {'POOL':<26} {'FILTER':<22} {'DELTAS/s':>9} {'SUBS':>5} {'DELTAS':>8} "
        f"{'p50 ms':>7} {'p99 ms':>7}",
    ]
    for p in s.pools:
        pct = 100.0 * p.fingerprints / p.capacity if p.capacity else 0.0
        filt = f"{p.fingerprints:,}/{p.capacity:,} {pct:4.1f}%"
        lines.append(
            f"  {p.name:<26} {filt:<22} {p.delta_rate:>9.1f} {p.subscribers:>5} {p.deltas:>8} "
            f"{_ms(p.p50_ms):>7} {_ms(p.p99_ms):>7}"
        )
    lines += [
        "",
        f"  all pools: delta latency p50 {_ms(s.p50_ms)} ms, p99 {_ms(s.p99_ms)} ms"
        + (f"  ·  consumer errors {s.errors}" if s.errors else ""),
    ]
    if s.events:
        lines += ["", b("EVENTS")] + [f"  {e}" for e in s.events[-4:]]
    if s.hit_query:
        lines += ["", b("TRY IT  (another terminal, while the demo runs: a prompt that hits)"),
                  f"  {s.hit_query}"]  # fmt: skip
    return "\n".join(lines)


def summary_text(s: Snapshot) -> str:
    j = s.as_json()
    ready = ", ".join(f"{m.namespace}/{m.model}={m.state}" for m in s.models) or "none"
    return (
        f"kvrelay demo finished after {j['duration_s']} s: {j['deltas_total']} deltas over "
        f"{len(s.pools)} pools, delta latency p50 {_ms(s.p50_ms)} ms / p99 {_ms(s.p99_ms)} ms; "
        f"readiness {ready}; consumer errors {sum(s.errors.values())}"
    )
