"""The simulator's /metrics page (read with a raw socket + prometheus parser) and its CLI."""

from __future__ import annotations

import asyncio

from prometheus_client.parser import text_string_to_metric_families

from kvrelay.sim import SimConfig, SimEngine
from kvrelay.sim.cli import build_parser, configs_from_args, main


async def _get(port: int, path: str) -> tuple[bytes, bytes]:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    data = await r.read()
    w.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return head, body


async def test_metrics_page_matches_engine_state() -> None:
    eng = SimEngine(SimConfig(dp_size=2, capacity_blocks=64, served_model_name="m-1"))
    await eng.start()
    try:
        await eng.step(6)
        head, body = await _get(eng.metrics_port or 0, "/metrics")
        assert head.startswith(b"HTTP/1.1 200")
        fams = {f.name: f for f in text_string_to_metric_families(body.decode())}
        usage = {s.labels["engine"]: s.value for s in fams["vllm:kv_cache_usage_perc"].samples}
        assert usage == {"0": eng.kv_usage(0), "1": eng.kv_usage(1)}
        assert 0 < usage["0"] <= 1
        running = fams["vllm:num_requests_running"].samples
        assert {s.labels["model_name"] for s in running} == {"m-1"}
        assert [s.value for s in running] == [len(eng.schedulers[r].running) for r in (0, 1)]
        assert fams["vllm:prefix_cache_queries"].type == "counter"
        head, _ = await _get(eng.metrics_port or 0, "/nope")
        assert head.startswith(b"HTTP/1.1 404")
    finally:
        await eng.stop()


def test_cli_config_mapping_and_usage_errors() -> None:
    args = build_parser().parse_args(
        [
            "--engines",
            "2",
            "--dp-size",
            "2",
            "--pub-port",
            "6000",
            "--replay-port",
            "-1",
            "--grpc-port",
            "7000",
            "--era",
            "array",
            "--hash",
            "bytes",
        ]
    )
    c0, c1 = configs_from_args(args)
    assert (c0.pub_port, c1.pub_port) == (6000, 6200)
    assert c0.replay_port is None and (c0.grpc_port, c1.grpc_port) == (7000, 7001)
    assert c1.era.value == "array" and c1.hash_mode.value == "bytes" and c1.dp_size == 2
    assert main(["--engines", "0"]) == 2


def test_cli_runs_for_a_duration() -> None:
    rc = main(
        [
            "--pub-port",
            "0",
            "--replay-port",
            "0",
            "--grpc-port",
            "0",
            "--metrics-port",
            "0",
            "--duration",
            "0.3",
            "--rate",
            "50",
        ]
    )
    assert rc == 0


def test_sglang_and_connect_flags() -> None:
    args = build_parser().parse_args(
        ["--engines", "2", "--flavor", "sglang", "--sglang-layout", "metadata",
         "--connect", "tcp://10.0.0.9:5557", "--topic", "kv@{engine}@m"]
    )  # fmt: skip
    c0, c1 = configs_from_args(args)
    assert (c0.flavor, c0.sglang_layout.value, c0.pub_connect) == (
        "sglang", "metadata", "tcp://10.0.0.9:5557"
    )
    assert (c0.topic, c1.topic) == ("kv@engine-0@m", "kv@engine-1@m")
