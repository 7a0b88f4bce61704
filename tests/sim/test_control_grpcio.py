"""Wire compatibility of the simulator's Control server with official grpcio + protobuf stubs."""

from __future__ import annotations

from dataclasses import replace
from types import ModuleType

import grpc
import pytest

from kvrelay.sim import SimConfig, SimEngine
from kvrelay.sim.ports import free_port_block


@pytest.fixture
def control(official_pb2: dict[str, ModuleType]) -> tuple[ModuleType, ModuleType]:
    return official_pb2["control"], official_pb2["control_grpc"]


async def test_grpcio_client_reads_every_discovery_rpc(
    control: tuple[ModuleType, ModuleType],
) -> None:
    pb, pbg = control
    base = free_port_block(4)
    eng = SimEngine(
        SimConfig(
            dp_size=2,
            pub_port=base,
            replay_port=base + 2,
            topic="kv",
            block_size=32,
            capacity_blocks=100,
            buffer_steps=77,
        )
    )
    await eng.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{eng.grpc_port}") as ch:
            stub = pbg.ControlStub(ch)
            info = await stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=5)
            assert info.instance_id == eng.instance_id and info.engine_version == "0.33.0"
            assert info.kv_block_size == 32 and info.total_kv_blocks == 200
            assert info.parallelism.data_parallel_size == 2
            assert info.HasField("effective_attention_block_size")
            model = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
            assert model.model_id == "sim/model-7b" and list(model.served_model_aliases)
            resp = await stub.GetKvEventSources(pb.GetKvEventSourcesRequest(), timeout=5)
            assert [s.endpoint for s in resp.sources] == [f"tcp://*:{base}", f"tcp://*:{base + 1}"]
            assert [s.replay_endpoint for s in resp.sources] == [
                f"tcp://*:{base + 2}",
                f"tcp://*:{base + 3}",
            ]
            for r, s in enumerate(resp.sources):
                assert s.HasField("data_parallel_rank") and s.data_parallel_rank == r
                assert (s.transport, s.encoding, s.schema_version, s.topic) == (
                    "zmq",
                    "msgpack",
                    1,
                    "kv",
                )
                assert (s.buffer_steps, s.hwm, s.max_queue_size) == (77, 100000, 100000)
            lo = await stub.LoadLora(pb.LoadLoraRequest(lora_name="a1", source_path="/x"))
            assert lo.adapter.lora_name == "a1" and lo.adapter.lora_id == 1
            assert [
                a.lora_name for a in (await stub.ListLoras(pb.ListLorasRequest())).adapters
            ] == ["a1"]
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await stub.UnloadLora(pb.UnloadLoraRequest(lora_name="nope"))
            assert ei.value.code() == grpc.StatusCode.NOT_FOUND
            await stub.Sleep(pb.SleepRequest())
            assert (await stub.IsSleeping(pb.IsSleepingRequest())).sleeping
            await stub.WakeUp(pb.WakeUpRequest())
            assert not (await stub.IsSleeping(pb.IsSleepingRequest())).sleeping
            await stub.PauseGeneration(pb.PauseGenerationRequest(mode=pb.PAUSE_MODE_KEEP))
            assert (await stub.IsPaused(pb.IsPausedRequest())).paused and eng.paused
            await stub.ResumeGeneration(pb.ResumeGenerationRequest())
            assert not (await stub.IsPaused(pb.IsPausedRequest())).paused
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await stub.Shutdown(pb.ShutdownRequest())
            assert ei.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        await eng.stop()


async def test_grpcio_kv_transfer_fallback_service(control: tuple[ModuleType, ModuleType]) -> None:
    pb, _ = control
    eng = SimEngine(replace(SimConfig(), kv_transfer_only=True))
    await eng.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{eng.grpc_port}") as ch:
            ctl = ch.unary_unary(
                "/vllm.Control/GetKvEventSources",
                request_serializer=pb.GetKvEventSourcesRequest.SerializeToString,
                response_deserializer=pb.GetKvEventSourcesResponse.FromString,
            )
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await ctl(pb.GetKvEventSourcesRequest(), timeout=5)
            assert ei.value.code() == grpc.StatusCode.UNIMPLEMENTED
            kvt = ch.unary_unary(
                "/vllm.KvTransfer/GetKvEventSources",
                request_serializer=pb.GetKvEventSourcesRequest.SerializeToString,
                response_deserializer=pb.GetKvEventSourcesResponse.FromString,
            )
            resp = await kvt(pb.GetKvEventSourcesRequest(), timeout=5)
            assert [s.endpoint for s in resp.sources] == [eng.publishers[0].endpoint]
            assert resp.sources[0].endpoint.startswith("tcp://127.0.0.1:")
    finally:
        await eng.stop()
