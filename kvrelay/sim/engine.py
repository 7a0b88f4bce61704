"""Simulated vLLM engine (one frontend, ``dp_size`` engine cores) and fleets of them.

Tests drive engines step by step (``await engine.step(n)``); ``run(rate)`` runs steps in the
background. Ground truth (exactly what each rank holds) is always available synchronously.
With ``flavor="sglang"`` the engine publishes SGLang's stream instead (no Control, no /metrics).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import replace
from typing import Any

import zmq.asyncio

from kvrelay._aio import cancel_and_wait
from kvrelay.sim.blocks import BlockManager, HeldBlock
from kvrelay.sim.config import LoraInfo, SimConfig
from kvrelay.sim.control import start_control_server, stop_control_server
from kvrelay.sim.hashing import none_digest
from kvrelay.sim.metrics_http import start_metrics_server, stop_metrics_server
from kvrelay.sim.publisher import RankPublisher
from kvrelay.sim.render import render_event
from kvrelay.sim.scheduler import RankScheduler, SimEvent
from kvrelay.sim.sglang_wire import encode_sglang_batch, render_sglang
from kvrelay.sim.traffic import RequestSpec, TrafficGenerator
from kvrelay.sim.wire import encode_batch


class SimEngine:
    """A vLLM-compatible engine: ZMQ publishers per DP rank, Control gRPC, /metrics."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.incarnation = 0
        self.instance_id = self._make_instance_id()
        #: Unix time this incarnation started (its page's ``process_start_time_seconds``).
        self.started_at = round(time.time(), 2)
        self.sleeping = False
        self.paused = False
        self.loras: dict[str, LoraInfo] = {}
        self._next_lora_id = 1
        self._ctx: zmq.asyncio.Context | None = None
        self.publishers: list[RankPublisher] = []
        self.schedulers: list[RankScheduler] = [self._make_scheduler(r) for r in range(cfg.dp_size)]
        self.steps = 0
        self._run_task: asyncio.Task[None] | None = None
        self._grpc: object | None = None
        self._metrics: object | None = None
        self.grpc_port: int | None = None
        self.metrics_port: int | None = None

    # ---- construction helpers ----
    def _make_instance_id(self) -> str:
        return f"{self.cfg.name}-s{self.cfg.seed}-i{self.incarnation}"

    def _make_scheduler(self, rank: int) -> RankScheduler:
        cfg = self.cfg
        traffic = TrafficGenerator(
            cfg.traffic,
            pool_seed=cfg.seed,
            stream_seed=_stable_seed(cfg.seed, cfg.name, rank, self.incarnation),
        )
        return RankScheduler(
            BlockManager(cfg.capacity_blocks, cfg.block_size),
            traffic,
            none_digest(cfg.seed),
            cfg.max_running,
            report_reused=cfg.report_reused,
            eagle=cfg.eagle,
            copies=cfg.flavor == "vllm",
            drop_last_hit=cfg.spec_eagle,
        )

    @property
    def sglang(self) -> bool:
        return self.cfg.flavor == "sglang"

    def _epoch(self, rank: int) -> bytes | None:
        """SGLang's per-publisher epoch token (32 hex digits), new with every incarnation."""
        if not (self.sglang and self.cfg.sglang_epoch):
            return None
        return hashlib.sha256(f"{self.instance_id}/{rank}".encode()).hexdigest()[:32].encode()

    # ---- lifecycle ----
    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        try:
            await self._open_publishers()
        except BaseException:
            self._drop_context()  # no half-opened engine's sockets left for the collector
            raise
        if self.cfg.grpc_port is not None and not self.sglang:
            server, self.grpc_port = await start_control_server(self)
            self._grpc = server
        if self.cfg.metrics_port is not None and not self.sglang:
            msrv, self.metrics_port = await start_metrics_server(self)
            self._metrics = msrv

    async def _open_publishers(self) -> None:
        assert self._ctx is not None
        cfg = self.cfg
        self.publishers = []
        for r in range(cfg.dp_size):
            pub = RankPublisher(
                self._ctx,
                r,
                cfg.endpoint,
                cfg.replay_endpoint,
                cfg.topic,
                cfg.buffer_steps,
                cfg.hwm,
                cfg.sglang_layout.replay_frames if self.sglang else cfg.replay_frames,
                cfg.host_ip,
                connect=cfg.pub_connect,
                epoch=self._epoch(r),
            )
            await _retry_bind(pub)
            self.publishers.append(pub)

    async def stop(self) -> None:
        await self.stop_running()
        if self._grpc is not None:
            await stop_control_server(self._grpc)
            self._grpc = None
        if self._metrics is not None:
            await stop_metrics_server(self._metrics)
            self._metrics = None
        for p in self.publishers:
            await p.close()
        self._drop_context()

    def _drop_context(self) -> None:
        """Close the context and any socket of it still open. Never left to the garbage
        collector: pyzmq's finalizer ends a context whose sockets it can no longer see (they
        share its reference cycle) with ``term()``, which then waits for them for ever."""
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    async def wait_subscribed(self, timeout: float = 10.0) -> None:
        """Connect mode: until every rank's PUB has the bound SUB's subscription."""
        for p in self.publishers:
            await p.wait_subscribed(timeout)

    async def stop_control(self) -> None:
        """Take only the Control frontend down (a Control outage); the ZMQ publishers go on."""
        if self._grpc is not None:
            await stop_control_server(self._grpc)
            self._grpc = None

    async def start_control(self) -> None:
        """Bring the Control frontend back on the port it had."""
        if self._grpc is None and self.grpc_port is not None:
            pinned = replace(self.cfg, grpc_port=self.grpc_port)
            cfg, self.cfg = self.cfg, pinned
            try:
                server, self.grpc_port = await start_control_server(self)
            finally:
                self.cfg = cfg
            self._grpc = server

    async def __aenter__(self) -> SimEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ---- stepping ----
    def _publish(self, rank: int, events: list[SimEvent]) -> None:
        if not self.publishers:
            raise RuntimeError("engine not started: call await engine.start() first")
        cfg = self.cfg
        if self.sglang:
            out: list[list[Any]] = []
            for e in events:
                out += render_sglang(e, cfg.sglang_layout, cfg.block_size, cfg.eagle)
            rank_field = rank if cfg.sglang_rank_in_envelope else None
            self.publishers[rank].publish(encode_sglang_batch(time.time(), out, rank_field))
            return
        lora_ids = {n: li.lora_id for n, li in self.loras.items()}
        wire = [
            render_event(e, cfg.era, cfg.hash_mode, cfg.block_size, lora_ids, cfg.medium)
            for e in events
        ]
        self.publishers[rank].publish(encode_batch(time.time(), wire, rank))

    async def step(self, n: int = 1) -> int:
        """Run ``n`` scheduler steps on every rank; returns batches published. No-op when
        sleeping or paused (vLLM schedules nothing then)."""
        published = 0
        for _ in range(n):
            if self.sleeping or self.paused:
                break
            self.steps += 1
            loras = sorted(self.loras)
            for r, sched in enumerate(self.schedulers):
                events = sched.step(loras)
                if events:
                    self._publish(r, list(events))
                    published += 1
        await asyncio.sleep(0)
        return published

    def submit(
        self,
        rank: int,
        prompt: list[int],
        max_new_tokens: int = 1,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        n: int = 1,
    ) -> None:
        """Queue an exact request on one rank (admitted at the next step); ``n`` > 1 queues
        that many sibling requests (parallel sampling)."""
        for _ in range(n):
            self.schedulers[rank].submit(
                RequestSpec(list(prompt), lora_name, cache_salt, max_new_tokens)
            )

    def run(self, rate: float, duration: float | None = None) -> asyncio.Task[None]:
        """Step ``rate`` times per second in the background until ``stop_running``/duration."""

        async def loop() -> None:
            deadline = None if duration is None else time.monotonic() + duration
            period = 1.0 / rate
            while deadline is None or time.monotonic() < deadline:
                await self.step(1)
                await asyncio.sleep(period)

        self._run_task = asyncio.create_task(loop())
        return self._run_task

    async def stop_running(self) -> None:
        if self._run_task is not None:
            await cancel_and_wait(self._run_task)
            self._run_task = None

    # ---- operator actions ----
    async def restart(self, rebind: bool = True) -> None:
        """New incarnation: new instance_id, seq 0, empty cache and replay buffer, nothing
        published about the lost state (consumers detect it from seq / instance_id)."""
        self.incarnation += 1
        self.instance_id = self._make_instance_id()
        # A new process, a new start time (at the 10 ms resolution of the real one, so distinct).
        self.started_at = max(round(time.time(), 2), round(self.started_at + 0.01, 2))
        self.sleeping = self.paused = False
        self.schedulers = [self._make_scheduler(r) for r in range(self.cfg.dp_size)]
        if rebind:
            for p in self.publishers:
                await p.close()
            await self._open_publishers()
        else:
            for r, p in enumerate(self.publishers):
                p.reset(self._epoch(r))

    def drop_next(self, n: int, keep_in_replay: bool, rank: int | None = None) -> None:
        """Skip publishing the next ``n`` batches live (seq still advances). With
        ``keep_in_replay`` they remain replayable, else the history is lost."""
        for r, p in enumerate(self.publishers):
            if rank is None or rank == r:
                p.drop_next(n, keep_in_replay)

    def mute_replay(self, muted: bool = True) -> None:
        """Every rank's replay takes requests and does not answer them (or answers again)."""
        for p in self.publishers:
            p.replay_muted = muted

    def delay_replay(self, seconds: float) -> None:
        """Every rank's replay answers each request ``seconds`` late (0: at once again)."""
        for p in self.publishers:
            p.replay_delay_s = seconds

    def corrupt_next(self, n: int, replay_good: bool, rank: int | None = None) -> None:
        """Publish the next ``n`` batches live as garbage; ``replay_good``: the replay buffer
        still holds the real batches (else the same garbage)."""
        for r, p in enumerate(self.publishers):
            if rank is None or rank == r:
                p.corrupt_next(n, replay_good)

    def reset_prefix_cache(self) -> None:
        """Abort running requests, clear every rank's cache, publish AllBlocksCleared."""
        for r, sched in enumerate(self.schedulers):
            self._publish(r, list(sched.reset()))

    def sleep(self) -> None:
        if not self.sleeping:
            self.reset_prefix_cache()  # level-1 sleep discards the KV cache
            self.sleeping = True

    def wake(self) -> None:
        self.sleeping = False

    def pause(self, clear_cache: bool = False) -> None:
        if clear_cache:
            self.reset_prefix_cache()
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def load_lora(self, name: str, source_path: str = "") -> LoraInfo:
        if self.sglang and not self.cfg.sglang_layout.names_adapters:
            # before 0.5.22 its events name no adapter: a consumer could not salt them
            raise ValueError(
                "the SGLang simulator serves LoRA adapters only in the map_lora layout"
            )
        if name not in self.loras:
            if len(self.loras) >= self.cfg.max_loras:
                raise ValueError(f"max_loras={self.cfg.max_loras} reached")
            self.loras[name] = LoraInfo(self._next_lora_id, name, source_path or f"/loras/{name}")
            self._next_lora_id += 1
        return self.loras[name]

    def unload_lora(self, name: str) -> LoraInfo:
        try:
            return self.loras.pop(name)
        except KeyError:
            raise KeyError(f"LoRA {name!r} is not loaded") from None

    # ---- ground truth / introspection ----
    def held_blocks(self, dp_rank: int) -> dict[int, HeldBlock]:
        """Exactly the blocks rank ``dp_rank`` holds, keyed by u64 vLLM hash (a copy)."""
        return dict(self.schedulers[dp_rank].blocks.cached)

    def ground_truth(self, dp_rank: int, cache_salt_namespacing: bool = False) -> set[int]:
        """Dynamo canonical sequence hashes of every block held by ``dp_rank``."""
        return self.schedulers[dp_rank].blocks.ground_truth(cache_salt_namespacing)

    def kv_usage(self, dp_rank: int) -> float:
        bm = self.schedulers[dp_rank].blocks
        return bm.used_blocks() / bm.capacity

    @property
    def grpc_address(self) -> tuple[str, int]:
        assert self.grpc_port is not None, "gRPC frontend not started"
        return self.cfg.host_ip, self.grpc_port


def _stable_seed(*parts: object) -> int:
    """Process-independent seed (``hash()`` of str is randomized per process)."""
    text = "|".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "big")


async def _retry_bind(pub: RankPublisher, within_s: float = 5.0) -> None:
    """Bind, retrying for up to ``within_s`` while the port is in use. An engine restarting on its
    old port finds it taken for a moment: the port lingers in the IO thread after a restart, or
    one of the relay's reconnect attempts took it as its own local end (TCP's self-connect on
    loopback) until ZMQ drops that connection. A fixed attempt count (1 s) was not enough."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            await pub.start()
            return
        except zmq.ZMQError as exc:
            await pub.close()
            if exc.errno != zmq.EADDRINUSE or time.monotonic() >= deadline:
                raise
            await asyncio.sleep(0.02)


class SimFleet:
    """Several engines with distinct names/ports, started and stepped together."""

    def __init__(self, configs: list[SimConfig]) -> None:
        self.engines = [SimEngine(c) for c in configs]

    @classmethod
    def uniform(cls, n: int, base: SimConfig, port_base: int | None = None) -> SimFleet:
        """``n`` engines from ``base``; with ``port_base`` each engine gets its own port range
        (pub at port_base + 200*i, replay at +100), else ephemeral ports."""
        cfgs = []
        for i in range(n):
            c = replace(base, name=f"engine-{i}")
            if port_base is not None:
                c = replace(c, pub_port=port_base + 200 * i, replay_port=port_base + 200 * i + 100)
            cfgs.append(c)
        return cls(cfgs)

    async def start(self) -> None:
        for e in self.engines:
            await e.start()

    async def stop(self) -> None:
        for e in self.engines:
            await e.stop()

    async def step(self, n: int = 1) -> int:
        total = 0
        for _ in range(n):
            for e in self.engines:
                total += await e.step(1)
        return total

    async def __aenter__(self) -> SimFleet:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
