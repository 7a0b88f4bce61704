"""vLLM's ``--kv-events-config`` JSON for the simulator, so docs and tests launch it like vLLM.

The same JSON an operator passes to ``vllm serve`` configures ``kvrelay sim``: endpoints (rank r
binds port + r on both, as vLLM does), topic, replay buffer and queue bounds. Anything vLLM would
not accept, or the simulator cannot do (a publisher other than zmq, non-tcp endpoints), is a
clear ``ValueError``.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from kvrelay._text import is_decimal
from kvrelay.sim.config import SimConfig

KNOWN = (
    "enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint", "buffer_steps", "hwm",
    "max_queue_size", "topic",
)  # fmt: skip


def _tcp(key: str, value: Any) -> tuple[str, int]:
    if not isinstance(value, str) or not value.startswith("tcp://"):
        raise ValueError(f"{key}: the simulator binds tcp://HOST:PORT endpoints, got {value!r}")
    host, sep, port = value[len("tcp://") :].rpartition(":")
    if not sep or not host or not is_decimal(port) or int(port) > 65535:
        raise ValueError(f"{key}: expected tcp://HOST:PORT, got {value!r}")
    return host, int(port)


def _count(key: str, value: Any, low: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{key}: expected an integer >= {low}, got {value!r}")
    return value


def apply_kv_events_config(base: SimConfig, text: str) -> SimConfig:
    """``base`` with the fields of one ``--kv-events-config`` JSON object applied."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--kv-events-config is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError("--kv-events-config must be a JSON object")
    unknown = sorted(set(raw) - set(KNOWN))
    if unknown:
        raise ValueError(f"--kv-events-config: unknown field(s) {unknown}; known: {list(KNOWN)}")
    if raw.get("enable_kv_cache_events") is not True:
        raise ValueError('--kv-events-config: "enable_kv_cache_events": true is required')
    if raw.get("publisher", "zmq") != "zmq":
        raise ValueError(f'--kv-events-config: publisher must be "zmq", got {raw["publisher"]!r}')
    cfg = base
    if "endpoint" in raw:
        host, port = _tcp("endpoint", raw["endpoint"])
        cfg = replace(cfg, bind_host=host, pub_port=port)
    if raw.get("replay_endpoint") is None:
        cfg = replace(cfg, replay_port=None)  # vLLM's default: replay disabled
    else:
        host, port = _tcp("replay_endpoint", raw["replay_endpoint"])
        if host != cfg.bind_host:
            raise ValueError("--kv-events-config: the simulator binds both endpoints on one host")
        cfg = replace(cfg, replay_port=port)
    if "topic" in raw:
        if not isinstance(raw["topic"], str):
            raise ValueError(f"topic: expected a string, got {raw['topic']!r}")
        cfg = replace(cfg, topic=raw["topic"])
    if "buffer_steps" in raw:
        cfg = replace(cfg, buffer_steps=_count("buffer_steps", raw["buffer_steps"], 1))
    if "hwm" in raw:
        cfg = replace(cfg, hwm=_count("hwm", raw["hwm"], 0))
    if "max_queue_size" in raw:
        cfg = replace(cfg, max_queue_size=_count("max_queue_size", raw["max_queue_size"], 1))
    return cfg
