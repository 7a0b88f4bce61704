"""The simulator's ``vllm.Control`` gRPC frontend (grpclib), plus the ``vllm.KvTransfer``
fallback service that newer vLLM dev revisions use for ``GetKvEventSources``."""

from __future__ import annotations

import errno
from typing import Any

import grpclib
import grpclib.const
import grpclib.server
from grpclib.server import Server

from kvrelay._aio import server_closed
from kvrelay._proto import vllm as vpb
from kvrelay.sim.face import EngineFace
from kvrelay.sim.ports import free_port_block

KV_TRANSFER_PATH = "/vllm.KvTransfer/GetKvEventSources"


def event_sources(engine: EngineFace) -> vpb.GetKvEventSourcesResponse:
    """One source per DP rank with the resolved endpoints (wildcards left in, like vLLM)."""
    cfg = engine.cfg
    return vpb.GetKvEventSourcesResponse(
        sources=[
            vpb.KvEventSource(
                transport="zmq",
                endpoint=p.endpoint,
                topic=cfg.topic,
                replay_endpoint=p.replay_endpoint,
                data_parallel_rank=p.rank,
                encoding="msgpack",
                schema_version=1,
                buffer_steps=cfg.buffer_steps,
                hwm=cfg.hwm,
                max_queue_size=cfg.max_queue_size,
            )
            for p in engine.publishers
            if cfg.kv_events
        ]
    )


def _adapter(li: Any) -> vpb.LoraAdapter:
    return vpb.LoraAdapter(lora_id=li.lora_id, lora_name=li.name, source_path=li.source_path)


class SimControl(vpb.ControlBase):  # type: ignore[misc]
    """Control RPCs backed by a live ``EngineFace`` (state read at call time)."""

    def __init__(self, engine: EngineFace) -> None:
        self.engine = engine

    async def get_server_info(self, message: vpb.GetServerInfoRequest) -> vpb.ServerInfo:
        e, cfg = self.engine, self.engine.cfg
        total = cfg.capacity_blocks * cfg.dp_size
        return vpb.ServerInfo(
            engine_version=cfg.engine_version,
            api_version="vllm",
            instance_id=e.instance_id,
            parallelism=vpb.ParallelismInfo(
                tensor_parallel_size=1,
                pipeline_parallel_size=1,
                data_parallel_size=cfg.dp_size,
                data_parallel_rank=0,
                decode_context_parallel_size=1,
                world_size=cfg.dp_size,
                data_parallel_size_local=cfg.dp_size,
            ),
            max_model_len=cfg.max_model_len,
            kv_block_size=cfg.block_size,
            total_kv_blocks=total,
            max_running_requests=cfg.max_running,  # vLLM's max_num_seqs: per engine core
            max_batched_tokens=8192,
            max_loras=cfg.max_loras,
            rl_capabilities=vpb.RlCapabilities(sleep_mode_enabled=True),
            effective_attention_block_size=cfg.block_size,
        )

    async def get_model_info(self, message: vpb.GetModelInfoRequest) -> vpb.ModelInfo:
        cfg = self.engine.cfg
        return vpb.ModelInfo(
            model_id=cfg.model_id,
            served_model_name=cfg.served_model_name,
            served_model_aliases=list(cfg.aliases),
            supports_text_input=True,
            supports_token_ids_input=True,
            supports_lora=cfg.max_loras > 0,
        )

    def _served(self, rpc: str) -> None:
        if rpc in self.engine.cfg.unimplemented_rpcs:
            raise grpclib.GRPCError(grpclib.const.Status.UNIMPLEMENTED, f"{rpc} not implemented")

    async def list_loras(self, message: vpb.ListLorasRequest) -> vpb.ListLorasResponse:
        self._served("ListLoras")
        return vpb.ListLorasResponse(adapters=[_adapter(li) for li in self.engine.loras.values()])

    async def load_lora(self, message: vpb.LoadLoraRequest) -> vpb.LoadLoraResponse:
        if not message.lora_name:
            raise grpclib.GRPCError(grpclib.const.Status.INVALID_ARGUMENT, "lora_name required")
        try:
            li = self.engine.load_lora(message.lora_name, message.source_path)
        except ValueError as exc:
            raise grpclib.GRPCError(grpclib.const.Status.RESOURCE_EXHAUSTED, str(exc)) from None
        return vpb.LoadLoraResponse(adapter=_adapter(li))

    async def unload_lora(self, message: vpb.UnloadLoraRequest) -> vpb.UnloadLoraResponse:
        try:
            li = self.engine.unload_lora(message.lora_name)
        except KeyError as exc:
            raise grpclib.GRPCError(grpclib.const.Status.NOT_FOUND, str(exc)) from None
        return vpb.UnloadLoraResponse(adapter=_adapter(li))

    async def get_kv_event_sources(
        self, message: vpb.GetKvEventSourcesRequest
    ) -> vpb.GetKvEventSourcesResponse:
        cfg = self.engine.cfg
        if cfg.kv_transfer_only or cfg.kv_sources_unimplemented:
            raise grpclib.GRPCError(grpclib.const.Status.UNIMPLEMENTED)
        return event_sources(self.engine)

    async def is_sleeping(self, message: vpb.IsSleepingRequest) -> vpb.IsSleepingResponse:
        self._served("IsSleeping")
        return vpb.IsSleepingResponse(sleeping=self.engine.sleeping)

    async def is_paused(self, message: vpb.IsPausedRequest) -> vpb.IsPausedResponse:
        self._served("IsPaused")
        return vpb.IsPausedResponse(paused=self.engine.paused)

    async def sleep(self, message: vpb.SleepRequest) -> vpb.SleepResponse:
        self.engine.sleep()
        return vpb.SleepResponse()

    async def wake_up(self, message: vpb.WakeUpRequest) -> vpb.WakeUpResponse:
        self.engine.wake()
        return vpb.WakeUpResponse()

    async def pause_generation(
        self, message: vpb.PauseGenerationRequest
    ) -> vpb.PauseGenerationResponse:
        self.engine.pause(clear_cache=bool(message.clear_cache))
        return vpb.PauseGenerationResponse()

    async def resume_generation(
        self, message: vpb.ResumeGenerationRequest
    ) -> vpb.ResumeGenerationResponse:
        self.engine.resume()
        return vpb.ResumeGenerationResponse()


class SimKvTransfer:
    """Hand-written grpclib service: ``vllm.KvTransfer/GetKvEventSources`` only."""

    def __init__(self, engine: EngineFace) -> None:
        self.engine = engine

    async def _get_sources(
        self,
        stream: grpclib.server.Stream[vpb.GetKvEventSourcesRequest, vpb.GetKvEventSourcesResponse],
    ) -> None:
        request = await stream.recv_message()
        if request is None:
            raise grpclib.GRPCError(grpclib.const.Status.INVALID_ARGUMENT, "empty request")
        await stream.send_message(event_sources(self.engine))

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        return {
            KV_TRANSFER_PATH: grpclib.const.Handler(
                self._get_sources,
                grpclib.const.Cardinality.UNARY_UNARY,
                vpb.GetKvEventSourcesRequest,
                vpb.GetKvEventSourcesResponse,
            )
        }


async def start_control_server(engine: EngineFace) -> tuple[Server, int]:
    handlers: list[Any] = [SimControl(engine)]
    if engine.cfg.kv_transfer_only and not engine.cfg.kv_sources_unimplemented:
        handlers.append(SimKvTransfer(engine))
    server = Server(handlers)
    port = engine.cfg.grpc_port or 0
    if port:
        await server.start(engine.cfg.host_ip, port)
    else:
        # A port below the kernel's ephemeral range, not port 0: ``stop_control`` then
        # ``start_control`` binds the same port again, and one from that range could meanwhile
        # be any outgoing connection's own port ("address already in use"). Another pick can
        # take one first: pick again.
        for attempt in range(20):
            port = free_port_block(1)
            try:
                await server.start(engine.cfg.host_ip, port)
                break
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE or attempt == 19:
                    raise
    inner: Any = server._server  # grpclib keeps the asyncio server private
    sockets = inner.sockets if inner is not None else ()
    bound = sockets[0].getsockname()[1] if sockets else port
    return server, int(bound)


async def stop_control_server(server: Any) -> None:
    server.close()
    await server_closed(server)  # (bounded: a relay's Control channel may stay open)
