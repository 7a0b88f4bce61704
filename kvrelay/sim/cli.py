"""``kvrelay sim``: run simulated vLLM (or SGLang) engines (mounted by kvrelay/cli.py; entry
``main``)."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Sequence
from dataclasses import replace

import zmq

from kvrelay.sim.config import SimConfig
from kvrelay.sim.engine import SimEngine, SimFleet
from kvrelay.sim.kv_events_config import apply_kv_events_config
from kvrelay.sim.sglang_wire import SglLayout
from kvrelay.sim.traffic import TrafficConfig
from kvrelay.sim.wire import Era, HashMode


def build_parser(prog: str = "kvrelay sim") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Simulated vLLM engines emitting KV events. Takes a `vllm serve` line's "
        "model and flags: `kvrelay sim MODEL --port 8000 --grpc-port 50051 ...`.",
    )
    p.add_argument("model", nargs="?", default=None,
                   help="the served model name, as `vllm serve MODEL` (= --served-model-name)")
    p.add_argument("--engines", type=int, default=1, help="number of engines (frontends)")
    p.add_argument("--dp-size", "--data-parallel-size", type=int, default=1,
                   help="data-parallel ranks per engine (vLLM: --data-parallel-size)")
    p.add_argument(
        "--pub-port",
        type=int,
        default=5557,
        help="base PUB port (engine i uses +200*i, rank r +r); 0 = ephemeral",
    )
    p.add_argument(
        "--replay-port",
        type=int,
        default=5657,
        help="base ROUTER port; -1 disables replay; 0 = ephemeral",
    )
    p.add_argument(
        "--grpc-port",
        type=int,
        default=50051,
        help="Control gRPC port of engine 0 (+1 per engine); -1 disables; 0 = ephemeral",
    )
    p.add_argument(
        "--metrics-port", "--port",
        type=int,
        default=8000,
        help="/metrics port of engine 0 (+1 per engine); -1 disables; 0 = ephemeral (vLLM: "
        "--port, the HTTP server that serves /metrics)",
    )  # fmt: skip
    p.add_argument("--host", default="127.0.0.1", help="node IP for listeners and port-0 binds")
    p.add_argument("--bind-host", default="*", help="host part of the ZMQ endpoints")
    p.add_argument(
        "--era",
        choices=[e.value for e in Era],
        default="map",
        help="event encoding: array (vLLM <= 0.23) or map (>= 0.24)",
    )
    p.add_argument("--hash", dest="hash_mode", choices=[h.value for h in HashMode], default="u64")
    p.add_argument("--replay-frames", type=int, choices=[3, 4], default=4,
                   help="vLLM's replay replies: 3 frames (<= 0.25) or 4 with the topic (>= 0.26); "
                   "SGLang's follow --sglang-layout")  # fmt: skip
    p.add_argument("--topic", default="")
    p.add_argument(
        "--kv-events-config",
        metavar="JSON",
        default=None,
        help="vLLM's --kv-events-config JSON; its endpoint, replay_endpoint, topic and bounds "
        "replace --bind-host, --pub-port, --replay-port, --topic and --buffer-steps",
    )
    p.add_argument("--served-model-name", default=None, help="model name reported by Control")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--capacity", type=int, default=2048, help="KV blocks per DP rank")
    p.add_argument("--buffer-steps", type=int, default=10000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rate", type=float, default=20.0, help="scheduler steps per second")
    p.add_argument("--arrivals", type=float, default=1.0, help="new requests per step per rank")
    p.add_argument("--duration", type=float, default=None, help="seconds (default: until Ctrl-C)")
    p.add_argument(
        "--flavor", choices=["vllm", "sglang"], default="vllm",
        help="wire format: vLLM's, or SGLang's (no Control, no /metrics; docs/sglang.md)",
    )  # fmt: skip
    p.add_argument(
        "--sglang-layout", choices=[x.value for x in SglLayout], default="aligned",
        help="SGLang's event layout: no_medium (before 0.5.9), medium (0.5.9-0.5.17), metadata "
        "(0.5.18-0.5.19: salt map after medium), aligned (a development revision: Dynamo's "
        "slots), map (0.5.20-0.5.21: tagged maps), map_lora (0.5.22 on: maps naming the "
        "LoRA adapter, replay replies with the topic frame)",
    )  # fmt: skip
    p.add_argument(
        "--connect", default=None, metavar="ENDPOINT",
        help="connect each PUB to ENDPOINT (a relay's [pools.connect] bind) instead of binding; "
        "with --topic containing {engine}, e.g. 'kv@{engine}@sim-model'",
    )  # fmt: skip
    return p


def hot_tokens(engine: SimEngine, blocks: int = 2) -> list[int]:
    """Tokens whose first ``blocks`` blocks the engine almost always holds under traffic."""
    return engine.schedulers[0].traffic.hot_prefix(blocks * engine.cfg.block_size)


def _opt_port(v: int) -> int | None:
    return None if v < 0 else v


def configs_from_args(a: argparse.Namespace) -> list[SimConfig]:
    base = SimConfig(
        seed=a.seed,
        dp_size=a.dp_size,
        block_size=a.block_size,
        capacity_blocks=a.capacity,
        era=Era(a.era),
        hash_mode=HashMode(a.hash_mode),
        replay_frames=a.replay_frames,
        topic=a.topic,
        bind_host=a.bind_host,
        host_ip=a.host,
        buffer_steps=a.buffer_steps,
        traffic=TrafficConfig(arrivals_per_step=a.arrivals),
        flavor=a.flavor,
        sglang_layout=SglLayout(a.sglang_layout),
        pub_connect=a.connect,
    )
    if a.model and a.served_model_name and a.model != a.served_model_name:
        # vLLM serves MODEL under --served-model-name; the simulator has no weights to load
        base = replace(base, served_model_name=a.served_model_name, model_id=a.model)
    elif a.served_model_name or a.model:
        name = a.served_model_name or a.model
        base = replace(base, served_model_name=name, model_id=name)
    if a.kv_events_config is not None:
        cfg = apply_kv_events_config(replace(base, pub_port=a.pub_port), a.kv_events_config)
        base = cfg
        a.pub_port, a.replay_port = cfg.pub_port, -1 if cfg.replay_port is None else cfg.replay_port
    out = []
    for i in range(a.engines):

        def shift(port: int | None, step: int, i: int = i) -> int | None:
            return port if not port else port + step * i

        out.append(
            replace(
                base,
                name=f"engine-{i}",
                topic=base.topic.replace("{engine}", f"engine-{i}"),
                pub_port=shift(a.pub_port, 200, i) or 0,
                replay_port=shift(_opt_port(a.replay_port), 200, i),
                grpc_port=shift(_opt_port(a.grpc_port), 1, i),
                metrics_port=shift(_opt_port(a.metrics_port), 1, i),
            )
        )
    return out


async def _run(cfgs: list[SimConfig], rate: float, duration: float | None) -> None:
    fleet = SimFleet(cfgs)
    await fleet.start()
    for e in fleet.engines:
        print(
            f"{e.cfg.name} instance={e.instance_id} grpc={e.grpc_port} "
            f"metrics={e.metrics_port} sources="
            + ", ".join(f"{p.endpoint}|{p.replay_endpoint or '-'}" for p in e.publishers),
            flush=True,
        )
    first = fleet.engines[0]
    if first.cfg.flavor == "vllm":
        tokens = hot_tokens(first)
        print(f"a prompt that hits once the relay is in sync (the most popular system prompt's "
              f"first {len(tokens) // first.cfg.block_size} blocks):\n  kvrelay query --model "
              f"{first.cfg.served_model_name} --tokens {','.join(map(str, tokens))}",
              flush=True)  # fmt: skip
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    tasks = [e.run(rate) for e in fleet.engines]
    try:
        if duration is None:
            await stop.wait()
        else:
            await asyncio.wait_for(stop.wait(), timeout=duration)
    except TimeoutError:
        pass
    finally:
        for t in tasks:
            t.cancel()
        await fleet.stop()


def main(argv: Sequence[str] | None = None) -> int:
    """Exit codes: 0 ok, 1 runtime failure, 2 usage error."""
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    if args.engines < 1 or args.dp_size < 1 or args.rate <= 0:
        print("engines, dp-size and rate must be positive", file=sys.stderr)
        return 2
    try:
        configs = configs_from_args(args)
    except ValueError as exc:
        print(f"kvrelay sim: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_run(configs, args.rate, args.duration))
    except (OSError, zmq.ZMQError) as exc:
        print(f"kvrelay sim: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
