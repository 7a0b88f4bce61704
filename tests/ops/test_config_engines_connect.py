"""Configuration of SGLang engines (``kind``) and of connect mode (``[pools.connect]``).

The oracle is the operator-facing text (key path + reason fragment) and the built settings.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvrelay.ingest.kinds import EngineKind
from kvrelay.ops.config import ConfigProblem, DaemonConfig, check_file

HEAD = """
[relay]
dc_name = "dc-test"

[[pools]]
namespace = "ns"
component = "backend"
endpoint = "generate"
"""
IDENTITY = 'model = "m"\nkv_block_size = 16\n'
CONNECT = """
[pools.connect]
bind = "tcp://0.0.0.0:5557"
topic_pattern = "kv@{engine}@{model}"
"""
SGLANG = """
[[pools.engines]]
name = "sg"
kind = "sglang"
[pools.engines.static]
endpoint = "tcp://*:5557"
replay_endpoint = "tcp://*:5657"
dp_ranks = [0, 1]
"""


def _check(tmp_path: Path, text: str) -> tuple[DaemonConfig | None, list[ConfigProblem]]:
    f = tmp_path / "kvrelay.toml"
    f.write_text(text)
    return check_file(f, env={})


def _errors(problems: list[ConfigProblem]) -> dict[str, str]:
    return {p.path: p.reason for p in problems if p.severity == "error"}


def test_connect_only_pool(tmp_path: Path) -> None:
    cfg, problems = _check(tmp_path, HEAD + IDENTITY + CONNECT)
    assert cfg is not None, problems
    (pool,) = cfg.relay.pools
    assert pool.engines == () and pool.connect is not None
    c = pool.connect
    assert c.bind == ("tcp://0.0.0.0:5557",) and c.topic_pattern == "kv@{engine}@{model}"
    assert (c.kind, c.max_members, c.member_silence_s) == (EngineKind.VLLM, 1024, 600.0)
    assert "1 pool(s), 0 engine(s), 1 connect endpoint(s);" in cfg.summary()


def test_connect_with_every_key_and_engines(tmp_path: Path) -> None:
    text = HEAD + IDENTITY + CONNECT.replace(
        'bind = "tcp://0.0.0.0:5557"',
        'bind = ["tcp://0.0.0.0:5557", "ipc:///run/kv.sock"]\nkind = "SGLang"\n'
        "max_members = 64\nmember_silence_s = 30",
    ) + SGLANG  # fmt: skip
    cfg, problems = _check(tmp_path, text)
    assert cfg is not None, problems
    c = cfg.relay.pools[0].connect
    assert c is not None and c.bind == ("tcp://0.0.0.0:5557", "ipc:///run/kv.sock")
    assert (c.kind, c.max_members, c.member_silence_s) == (EngineKind.SGLANG, 64, 30.0)
    (eng,) = cfg.relay.pools[0].engines
    assert eng.kind is EngineKind.SGLANG and eng.static is not None


@pytest.mark.parametrize(
    ("text", "path", "reason"),
    [
        (HEAD + CONNECT, "pools[0].model", "required with [pools.connect]"),
        (HEAD + IDENTITY + CONNECT.replace('topic_pattern = "kv@{engine}@{model}"\n', ""),
         "pools[0].connect.topic_pattern", "required key is missing"),
        (HEAD + IDENTITY + CONNECT.replace("{engine}", "{pod}"),
         "pools[0].connect.topic_pattern", "unknown placeholder"),
        (HEAD + IDENTITY + CONNECT.replace("{engine}@{model}", "{engine}{model}"),
         "pools[0].connect.topic_pattern", "literal text between"),
        (HEAD + IDENTITY + CONNECT.replace(":5557", ":0"), "pools[0].connect.bind",
         "fixed port"),
        (HEAD + IDENTITY + CONNECT.replace("tcp://0.0.0.0:5557", "udp://x:1"),
         "pools[0].connect.bind", "ZMQ endpoint"),
        (HEAD + IDENTITY + CONNECT.replace('bind = "tcp://0.0.0.0:5557"', "bind = []"),
         "pools[0].connect.bind", "a string or a non-empty list"),
        (HEAD + IDENTITY + CONNECT + "max_members = 0\n", "pools[0].connect.max_members",
         "must be in 1..65536"),
        (HEAD + IDENTITY + CONNECT + 'kind = "trt"\n', "pools[0].connect.kind",
         "must be one of vllm, sglang"),
        (HEAD + IDENTITY + CONNECT + "replay = true\n", "pools[0].connect.replay",
         "unknown key"),
        (HEAD + IDENTITY, "pools[0].engines", "at least one"),
        (HEAD + IDENTITY + SGLANG.replace('kind = "sglang"', 'kind = "sglang"\ngrpc_port = 1'),
         "pools[0].engines[0].grpc_port", "SGLang has no vllm.Control"),
        (HEAD + IDENTITY + '[[pools.engines]]\nname = "s"\nkind = "sglang"\n',
         "pools[0].engines[0].static", "required for an SGLang engine"),
        (HEAD + SGLANG, "pools[0].kv_block_size", "static sources"),
    ],
)  # fmt: skip
def test_rules(tmp_path: Path, text: str, path: str, reason: str) -> None:
    cfg, problems = _check(tmp_path, text)
    assert cfg is None
    errors = _errors(problems)
    assert reason in errors.get(path, ""), errors


def test_two_pools_cannot_bind_one_endpoint(tmp_path: Path) -> None:
    second = HEAD.split("[[pools]]")[1].replace('"generate"', '"other"')
    text = HEAD + IDENTITY + CONNECT + "[[pools]]" + second + IDENTITY + CONNECT
    cfg, problems = _check(tmp_path, text)
    assert cfg is None
    reason = _errors(problems).get("pools[1].connect.bind", "")
    assert "binds what pools[0].connect.bind (tcp://0.0.0.0:5557) does" in reason, problems
