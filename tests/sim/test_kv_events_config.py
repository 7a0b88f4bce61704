"""``kvrelay sim --kv-events-config``: vLLM's JSON configures the simulated publisher."""

from __future__ import annotations

import pytest

from kvrelay.sim.cli import build_parser, configs_from_args
from kvrelay.sim.config import SimConfig
from kvrelay.sim.kv_events_config import apply_kv_events_config

FULL = (
    '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",'
    ' "replay_endpoint": "tcp://*:5657", "topic": "kv-events", "buffer_steps": 77,'
    ' "hwm": 5, "max_queue_size": 9}'
)


def test_fields_map_onto_the_simulator() -> None:
    cfg = apply_kv_events_config(SimConfig(), FULL)
    assert (cfg.bind_host, cfg.pub_port, cfg.replay_port) == ("*", 5557, 5657)
    assert (cfg.endpoint, cfg.replay_endpoint) == ("tcp://*:5557", "tcp://*:5657")
    assert (cfg.topic, cfg.buffer_steps, cfg.hwm, cfg.max_queue_size) == ("kv-events", 77, 5, 9)
    no_replay = apply_kv_events_config(SimConfig(), '{"enable_kv_cache_events": true}')
    assert no_replay.replay_port is None  # vLLM's default: replay disabled


def test_cli_uses_vllm_flag_names() -> None:
    args = build_parser().parse_args(
        ["--data-parallel-size", "2", "--kv-events-config", FULL, "--served-model-name", "m/x"]
    )
    (cfg,) = configs_from_args(args)
    assert cfg.dp_size == 2 and cfg.pub_port == 5557 and cfg.replay_port == 5657
    assert cfg.served_model_name == cfg.model_id == "m/x"


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("[]", "JSON object"),
        ("{", "not JSON"),
        ('{"enable_kv_cache_events": false}', "enable_kv_cache_events"),
        ('{"enable_kv_cache_events": true, "publisher": "null"}', 'publisher must be "zmq"'),
        ('{"enable_kv_cache_events": true, "endpoint": "ipc:///tmp/x"}', "tcp://HOST:PORT"),
        ('{"enable_kv_cache_events": true, "endpont": "tcp://*:1"}', "unknown field(s)"),
        ('{"enable_kv_cache_events": true, "buffer_steps": 0}', "buffer_steps"),
        ('{"enable_kv_cache_events": true, "endpoint": "tcp://*:1",'
         ' "replay_endpoint": "tcp://h:2"}', "one host"),
    ],
)
def test_bad_json_is_a_clear_error(text: str, fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        apply_kv_events_config(SimConfig(), text)
    assert fragment in str(info.value)
