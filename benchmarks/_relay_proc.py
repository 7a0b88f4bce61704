"""Run one kvrelay (``Relay`` + ``RelayServer``) in its own process, so its CPU and RSS can be
read from /proc, and dump its counters to a JSON file every ``--stats-interval`` seconds (with
``--stats-interval 0``: at start, on SIGUSR1 and at exit only).

Engines are static ZMQ sources (``--engine NAME=tcp://host:port``), the way a pre-0.27 vLLM or
Dynamo's mocker is configured. Prints ``READY <port>`` once the gRPC server listens; SIGTERM/SIGINT
stop it cleanly (a final stats dump is written first).

``--workers N`` (≥ 2) runs the daemon's worker topology (``kvrelay.ops.front``): the relay serves
a UNIX socket and N−1 fan-out worker processes (children of this one, so ``/proc`` tree CPU
counts them) serve the port; ``service_errors`` are then the workers' (router-facing) errors and
``internal_service_errors`` the relay's own (a worker lagging its upstream would show there).

``--mirror`` puts a ``kvrelay mirror`` process (a child of this one) in front of the relay over
loopback TCP: the relay serves an internal port with the limits a daemon gives its own workers'
streams (``internal_limits``), the mirror serves the port with this run's limits, and
``READY`` names the mirror's port once it has synchronized. ``service_errors`` stay the
relay's: the routers' view of the mirror is what the subscribers themselves report.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

from kvrelay.contract.limits import RelayLimits
from kvrelay.discovery.endpoints import StaticSourceConfig
from kvrelay.relay.relay import Relay
from kvrelay.relay.settings import EngineSpec, PoolSpec, RelaySettings
from kvrelay.service.server import RelayServer

_DEFAULT_DISCOVERY_S = next(
    float(f.default) for f in fields(RelaySettings) if f.name == "discovery_interval_s"
)


def build_settings(a: argparse.Namespace) -> RelaySettings:
    engines = []
    for item in a.engine:
        name, _, endpoint = item.partition("=")
        # one loopback address per engine: static engines are keyed by host (see README)
        host = endpoint.removeprefix("tcp://").rpartition(":")[0] or "127.0.0.1"
        engines.append(
            EngineSpec(
                name=name,
                host=host,
                static=StaticSourceConfig(endpoint=endpoint, replay_endpoint=None, hwm=a.zmq_hwm),
            )
        )
    cadence: dict[str, Any] = {}  # unset: the relay's own defaults (what `kvrelay serve` runs)
    if a.publish_every_n is not None:
        cadence["publish_every_n_events"] = a.publish_every_n
    if a.publication_delay_ms is not None:
        cadence["publication_delay_s"] = a.publication_delay_ms / 1000.0
    limits = RelayLimits(
        **cadence,
        publication_queue_capacity=a.queue_capacity,
        max_pool_streams_total=a.max_streams,
        max_subscribers_per_pool=a.max_streams,
    )
    pool = PoolSpec(
        namespace=a.namespace,
        component=a.component,
        endpoint=a.endpoint_name,
        engines=tuple(engines),
        expected_blocks=a.expected_blocks,
        model=a.model,
        kv_block_size=a.block_size,
    )
    return RelaySettings(
        dc_name=a.dc,
        pools=(pool,),
        limits=limits,
        discovery_interval_s=a.discovery_interval,
        discovery_timeout_s=1.0,
        zmq_reader=a.zmq_reader,
    )


def stats(relay: Relay, server: Any, started: float, front: Any = None) -> dict[str, Any]:
    pools = []
    for p in relay.pools:
        gen = p.generation
        item: dict[str, Any] = {
            "pool": p.name,
            "batches": p.counters.batches,
            "events": p.counters.events,
            "events_rejected": p.counters.events_rejected,
            "dropped_without_generation": p.counters.dropped_without_generation,
            "member_resets": dict(p.counters.member_resets),
            "generations": p.counters.generations,
            "fences": p.counters.fences,
            "ingest": {},
        }
        blocks = gaps = resets = messages = 0
        for key, sub in p.subscribers.items():
            c = sub.counters
            blocks += c.blocks
            gaps += c.gaps
            resets += c.resets
            messages += c.messages
            item["ingest"][f"{key.worker_id}/{key.dp_rank}"] = {
                "messages": c.messages, "blocks": c.blocks, "gaps": c.gaps, "resets": c.resets,
                "missing_history": c.missing_history, "rejections": dict(c.rejections),
                "drops": dict(c.drops), "malformed": c.malformed_events,
            }
        item.update(ingest_blocks=blocks, ingest_gaps=gaps, ingest_resets=resets,
                    ingest_messages=messages)
        if gen is not None:
            hub = gen._hub
            item.update(
                sequence=gen.sequence,
                bucket_count=int(gen.pool.bucket_count),
                memberships=gen.pool.memberships,
                distinct_canonical=gen.pool.distinct_canonical,
                occupancy=gen.pool.occupancy,
                exact_state_bytes=gen.pool.memory_bytes(),
                table_bytes=int(gen.pool.table.nbytes),
                capacity_omissions=gen.pool.capacity_omissions,
                unknown_removals=gen.pool.unknown_removals,
                subscribers=gen.subscriber_count,
                hub_lagged=0 if hub is None else int(getattr(hub, "lagged", 0)),
                hub_direct_frames=0 if hub is None else int(getattr(hub, "direct_frames", 0)),
            )
        pools.append(item)
    out = {
        "pid": os.getpid(),
        "uptime_s": time.monotonic() - started,
        "wall": time.time(),
        "service_errors": dict(server.service.errors),
        "pools": pools,
    }
    if front is not None:  # router-facing errors are the workers'
        out["internal_service_errors"] = out["service_errors"]
        out["service_errors"] = front.supervisor.stats()[1]
        out["workers"] = {"alive": front.supervisor.alive, "restarts": front.supervisor.restarts,
                          "pids": front.supervisor.pids,
                          "mirrors": [w.get("mirror", {}).get("pool_totals", {})
                                      for w in front.supervisor.worker_stats()]}  # fmt: skip
    return out


def warm() -> float:
    """Compile or load every hot kernel before READY, as ``kvrelay serve`` does before it
    declares readiness: without it a cold numba cache turns the first ingested batch into a
    ~20 s event-loop stall (seen on this 2-core machine) inside the measured window. Then, as
    the daemon does, release what only compiling needs (``kvrelay.ops.memory``) and freeze what
    lives for the whole run out of the collector's walks (``kvrelay.ops.gc_freeze``): without
    it, a full collection of the ~140,000 start-up objects lands in some measured windows, about
    0.1–0.4 s of CPU that ``kvrelay serve`` never pays."""
    from kvrelay.ops.warmup import warm_kernels

    seconds = float(warm_kernels())
    with contextlib.suppress(ImportError):
        from kvrelay.ops.memory import release_after_warmup

        release_after_warmup()
    with contextlib.suppress(ImportError):
        from kvrelay.ops.gc_freeze import freeze_startup_objects

        freeze_startup_objects()
    return seconds


def _profile_toggle(path: str) -> Any:
    import cProfile

    state: dict[str, Any] = {"prof": None, "n": 0}

    def toggle() -> None:
        prof = state["prof"]
        if prof is None:
            state["prof"] = cProfile.Profile()
            state["prof"].enable()
            return
        prof.disable()
        prof.dump_stats(f"{path}.{state['n']}")
        state["n"] += 1
        state["prof"] = None

    return toggle


async def amain(a: argparse.Namespace) -> None:
    settings = build_settings(a)
    warm()
    started = time.monotonic()
    front: Any = None
    mirror: asyncio.subprocess.Process | None = None
    if a.mirror:
        from dataclasses import replace

        from kvrelay.ops.front import internal_limits

        inner = internal_limits(settings.limits, 2)
        relay = Relay(replace(settings, limits=inner))
        await relay.start()
        server = RelayServer(relay, inner)  # type: ignore[arg-type]
        await server.start("127.0.0.1", 0)
        mirror, port = await _start_mirror(a, server.port)
    elif a.workers > 1:
        from dataclasses import replace

        from kvrelay.ops.config import DaemonConfig, LoggingConfig
        from kvrelay.ops.front import WorkerFront, internal_limits

        relay = Relay(replace(settings, limits=internal_limits(settings.limits, a.workers)))
        await relay.start()
        cfg = DaemonConfig(relay=settings, bind_host=a.host, bind_port=a.port, workers=a.workers,
                           logging=LoggingConfig(level="warning", format="json"),
                           event_loop=a.event_loop)  # fmt: skip
        front = WorkerFront(cfg, relay)
        await front.start()
        server = front.internal
        port = front.port
    else:
        relay = Relay(settings)
        await relay.start()
        server = RelayServer(relay, settings.limits)  # type: ignore[arg-type]  # as tests/e2e do
        await server.start(a.host, a.port)
        port = server.port
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    prof_out = os.environ.get("KVR_BENCH_CPROFILE")
    timers = None
    if prof_out:  # diagnostic (profile_relay --cprofile): SIGUSR2 starts, the next one dumps
        loop.add_signal_handler(signal.SIGUSR2, _profile_toggle(prof_out))
    elif os.environ.get("KVR_BENCH_STAGES"):  # diagnostic: SIGUSR2 turns the stage timers on/off
        from benchmarks._stages import StageTimers

        timers = StageTimers()
        loop.add_signal_handler(signal.SIGUSR2, timers.toggle)
    out = Path(a.stats) if a.stats else None

    def dump() -> None:
        if out is None:
            return
        doc = stats(relay, server, started, front)
        if timers is not None:
            doc["stage_cpu"] = timers.summary()
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc))
        tmp.replace(out)

    upkeep = None
    with contextlib.suppress(ImportError):  # as `kvrelay serve` does
        from kvrelay.ops.memory import keep_compiler_pages_released

        upkeep = asyncio.create_task(keep_compiler_pages_released())
    if a.stats_interval <= 0:  # on demand: the dump is the benchmark's, not the relay's
        loop.add_signal_handler(signal.SIGUSR1, dump)
        dump()
    print(f"READY {port}", flush=True)
    if a.stats_interval > 0:
        while not stop.is_set():
            dump()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), a.stats_interval)
    else:
        await stop.wait()
    dump()
    if upkeep is not None:
        upkeep.cancel()
    if mirror is not None and mirror.returncode is None:
        mirror.terminate()
        await mirror.wait()
    if front is not None:
        await front.stop(2.0)
    else:
        await server.close(grace_s=1.0)
    await relay.stop()


async def _start_mirror(a: argparse.Namespace, upstream: int) -> tuple[Any, int]:
    """``kvrelay mirror`` of ``127.0.0.1:upstream`` on ``a.host:a.port`` (a free port when 0);
    returns once it accepts connections (it listens only after it has synchronized)."""
    import shutil
    import tempfile

    from benchmarks._common import free_port

    port = a.port or free_port(a.host)
    conf = Path(tempfile.mkdtemp(prefix="kvrelay-bench-mirror-")) / "mirror.toml"
    conf.write_text(
        f'[relay]\nevent_loop = "{a.event_loop}"\n'
        f'[relay.limits]\npublication_queue_capacity = {a.queue_capacity}\n'
        f'max_pool_streams_total = {a.max_streams}\nmax_subscribers_per_pool = {a.max_streams}\n'
        '[logging]\nlevel = "warning"\nformat = "json"\n'
    )
    argv = [sys.executable, "-m", "kvrelay", "mirror", "--config", str(conf), "--upstream",
            f"127.0.0.1:{upstream}", "--bind", f"{a.host}:{port}", "--metrics-bind", "off"]
    proc = await asyncio.create_subprocess_exec(*argv)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 120
    while True:
        if proc.returncode is not None:
            raise RuntimeError(f"the mirror exited ({proc.returncode})")
        try:
            _, w = await asyncio.open_connection(a.host, port)
        except OSError:
            if loop.time() > deadline:
                proc.kill()
                raise RuntimeError("the mirror did not listen within 120 s") from None
            await asyncio.sleep(0.1)
            continue
        w.close()
        shutil.rmtree(conf.parent, ignore_errors=True)  # read at the start, never reloaded
        return proc, port


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--dc", default="dc-bench")
    p.add_argument("--namespace", default="bench")
    p.add_argument("--component", default="backend")
    p.add_argument("--endpoint-name", default="generate")
    p.add_argument("--engine", action="append", default=[], help="NAME=tcp://host:port")
    p.add_argument("--model", default="bench-model")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--expected-blocks", type=int, default=1_048_576)
    p.add_argument("--zmq-hwm", type=int, default=100_000)
    p.add_argument("--publish-every-n", type=int, default=None)
    p.add_argument("--publication-delay-ms", type=float, default=None)
    p.add_argument("--discovery-interval", type=float, default=_DEFAULT_DISCOVERY_S,
                   help="seconds between engine probes (default: the relay's own)")
    p.add_argument("--queue-capacity", type=int, default=16)
    p.add_argument("--max-streams", type=int, default=128)
    p.add_argument("--stats", default="")
    p.add_argument("--stats-interval", type=float, default=0.5, help="0: on SIGUSR1 only")
    p.add_argument("--event-loop", default="auto", choices=("auto", "asyncio", "uvloop"),
                   help="relay.event_loop, as `kvrelay serve` takes it (default: auto)")
    p.add_argument("--uvloop", action="store_const", dest="event_loop", const="uvloop",
                   help="shorthand for --event-loop uvloop")
    p.add_argument("--zmq-reader", default="zmtp", choices=("zmtp", "libzmq"),
                   help="relay.zmq_reader (default: zmtp, as `kvrelay serve`)")
    p.add_argument("--workers", type=int, default=1, help="processes serving gRPC (N-1 workers)")
    p.add_argument("--mirror", action="store_true", help="serve through a kvrelay mirror process")
    a = p.parse_args()
    if not a.engine:
        p.error("at least one --engine is required")
    with contextlib.suppress(ImportError):  # as `kvrelay serve` does before it starts
        from kvrelay.ops.memory import tune_malloc

        tune_malloc()
    from kvrelay.ops.event_loop import loop_factory

    with asyncio.Runner(loop_factory=loop_factory(a.event_loop)) as runner:
        runner.run(amain(a))


if __name__ == "__main__":
    main()
