"""``kvrelay demo``: a simulated fleet, the relay, its gRPC server and a consumer, in one process.

Everything is on loopback with ephemeral ports (the gRPC port can be fixed with ``--bind``), so
the demo runs beside a production relay without conflict. The consumer talks to the relay only
through gRPC, like a Dynamo router would.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from dataclasses import replace
from typing import Any, TextIO

from kvrelay.demo.fleet import AGG_MODEL, DemoFleet
from kvrelay.ops.config import format_bind

__all__ = ["run_demo"]

TICK_S = 1.0


async def _demo(
    host: str, port: int, duration: float, headless: bool, out: TextIO, workers: int = 1
) -> int:
    from kvrelay.demo.consumer import Consumer
    from kvrelay.demo.view import (
        CLEAR,
        HIDE_CURSOR,
        SHOW_CURSOR,
        redraw,
        render,
        summary_text,
        take_snapshot,
    )
    from kvrelay.ops.warmup import WarmEvent, warm_kernels
    from kvrelay.relay.relay import Relay
    from kvrelay.service.server import RelayServer

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    color = not headless and out.isatty()

    def progress(ev: WarmEvent) -> None:  # stderr: --headless keeps stdout to its one JSON line
        print(f"kvrelay demo: kernels: {ev}", file=sys.stderr, flush=True)

    print(
        "kvrelay demo: compiling or loading the numba kernels (first run: ~22 s on 2 quiet "
        "cores, up to ~75 s on busy ones)",
        file=sys.stderr, flush=True,
    )
    await loop.run_in_executor(None, warm_kernels, progress)
    print("kvrelay demo: starting the simulated fleet, the relay and the consumer",
          file=sys.stderr, flush=True)
    fleet = DemoFleet()
    relay: Relay | None = None
    server: RelayServer | None = None
    front: Any = None
    consumer: Consumer | None = None
    try:
        await fleet.start()
        settings = fleet.settings()
        if workers > 1:  # the relay serves a UNIX socket, N-1 worker processes the public port
            from kvrelay.ops.config import DaemonConfig, LoggingConfig
            from kvrelay.ops.front import WorkerFront, internal_limits

            relay = Relay(replace(settings, limits=internal_limits(settings.limits, workers)))
            await relay.start()
            cfg = DaemonConfig(
                relay=settings, bind_host=host, bind_port=port, workers=workers,
                logging=LoggingConfig(level="warning" if headless else "error", format="json"),
            )  # fmt: skip
            front = WorkerFront(cfg, relay)
            await front.start()
            port = front.port
        else:
            relay = Relay(settings)
            await relay.start()
            view: Any = relay  # Relay implements the RelayView protocol structurally
            server = RelayServer(view, settings.limits)
            await server.start(host, port)
            port = server.port
        address = format_bind(host, port)
        if workers > 1:
            address += f" ({workers - 1} fan-out workers)"
        local = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        hit_tokens = fleet.hit_tokens()
        hit_query = (f"kvrelay query --relay {format_bind(local, port)} --model {AGG_MODEL} "
                     f"--tokens {','.join(map(str, hit_tokens))}")  # fmt: skip
        consumer = Consumer(local, port)
        await consumer.start()
        fleet.run_traffic()
        events: list[str] = []
        scenario = asyncio.create_task(_scenario(fleet, duration, events))
        if color:
            out.write(HIDE_CURSOR + CLEAR)
        t0 = time.monotonic()
        previous: dict[str, int] = {}
        last = t0
        snap = None
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), TICK_S)
            now = time.monotonic()
            consumer.supervise()
            snap = take_snapshot(
                relay, consumer, elapsed_s=now - t0, duration_s=duration, address=address,
                previous=previous, interval_s=now - last,
            )
            snap.events = list(events)
            snap.hit_query = hit_query
            last = now
            if not headless:
                frame = render(snap, color=color)
                out.write(redraw(frame) if color else frame + "\n\n")
                out.flush()
            if stop.is_set() or now - t0 >= duration:
                break
        scenario.cancel()
        if headless:  # the JSON report says whether the printed query hits
            snap.hit_depth = await _hit_depth(format_bind(local, port), hit_tokens)
        if color:
            out.write(SHOW_CURSOR)
        assert snap is not None
        if headless:
            out.write(json.dumps(snap.as_json(), sort_keys=True) + "\n")
        else:
            out.write("\n" + summary_text(snap) + "\n")
        out.flush()
        return 0
    finally:
        if consumer is not None:
            await consumer.stop()
        if front is not None:
            await front.stop(2.0)
        if server is not None:
            await server.close(grace_s=1.0)
        if relay is not None:
            await relay.stop()
        await fleet.stop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


async def _hit_depth(address: str, tokens: list[int]) -> int | None:
    """What the SDK answers for the printed query now (None: no routable pool answered)."""
    from kvrelay.client import ClientConfig, RelayClient

    config = ClientConfig(subscriber_id="kvrelay-demo-query", watch_load=False,
                          watch_serving_load=False)  # fmt: skip
    async with RelayClient([address], config=config) as client:
        await client.wait_ready(10)
        await client.wait_for(lambda: bool(client.readiness()), 5)
        depths = client.overlap(tokens, AGG_MODEL)
    return max(depths.values()) if depths else None


async def _scenario(fleet: DemoFleet, duration: float, events: list[str]) -> None:
    """Mid-run, the prefill engine sleeps for a few seconds: the decode pool loses the role it
    needs and readiness shows demo-qwen-7b UNAVAILABLE (missing PREFILL) until it wakes."""
    from kvrelay.demo.fleet import PD_MODEL

    if duration < 15:
        return
    t0 = time.monotonic()
    await asyncio.sleep(duration * 0.4)
    prefill = fleet.engines["prefill-0"]
    prefill.sleep()
    events.append(f"t={time.monotonic() - t0:4.1f}s prefill-0 sleeps (cache dropped): "
                  f"{PD_MODEL} should lose PREFILL")
    await asyncio.sleep(min(6.0, duration * 0.2))
    prefill.wake()
    events.append(f"t={time.monotonic() - t0:4.1f}s prefill-0 wakes: {PD_MODEL} recovers")


def run_demo(
    *, host: str = "127.0.0.1", port: int = 0, duration: float = 30.0, headless: bool = False,
    out: TextIO | None = None, workers: int = 1,
) -> int:
    """Exit code: 0 after the run (duration or Ctrl-C), 1 if anything failed to start."""
    from kvrelay.logging import configure

    stream = sys.stdout if out is None else out
    # Logs go to stderr and only when they matter: the view owns the terminal.
    configure(level="WARNING" if headless else "ERROR", json=headless)
    try:
        return asyncio.run(_demo(host, port, duration, headless, stream, workers))
    except BrokenPipeError:  # stdout's reader went away (| head -1): stop quietly, as SIGPIPE does
        with contextlib.suppress(OSError, ValueError):  # the last flush must not complain either
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, stream.fileno())
            os.close(null)
        return 141
    except OSError as exc:
        print(f"kvrelay demo: {exc}", file=sys.stderr)
        return 1
