"""Configuration: addresses compared as addresses, however they are spelled.

One engine configured twice (its Control endpoint, or a static publisher, under two entries) is
refused; the relay's and the metrics' listeners collide exactly when the OS says they do (the
oracle: both bound as the daemon binds them).
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from kvrelay.ops.config import ConfigProblem, DaemonConfig, check_file
from kvrelay.ops.reload import read_config
from tests.support.commands import kvrelay
from tests.support.ipv6 import IPV6, NEEDS_IPV6


def _check(tmp_path: Path, text: str) -> tuple[DaemonConfig | None, list[ConfigProblem]]:
    f = tmp_path / "kvrelay.toml"
    f.write_text(text)
    return check_file(f, env={})


def _errors(problems: list[ConfigProblem]) -> dict[str, str]:
    return {p.path: p.reason for p in problems if p.severity == "error"}


def _pool(endpoint: str, *engines: str) -> str:
    return (
        f'\n[[pools]]\nnamespace = "ns"\ncomponent = "backend"\nendpoint = "{endpoint}"\n'
        'model = "m"\nkv_block_size = 16\n' + "".join(engines)
    )


def _control(name: str, host: str, port: int = 50051) -> str:
    return f'\n[[pools.engines]]\nname = "{name}"\nhost = "{host}"\ngrpc_port = {port}\n'


def _static(name: str, host: str, endpoint: str, ranks: str = "[0]") -> str:
    return (
        f'\n[[pools.engines]]\nname = "{name}"\nhost = "{host}"\n[pools.engines.static]\n'
        f'endpoint = "{endpoint}"\ndp_ranks = {ranks}\n'
    )


HEAD = '[relay]\ndc_name = "dc"\n'


@pytest.mark.parametrize(
    ("pools", "path", "fragment"),
    [
        # written alike: the relay's engine table kept one, the other was never watched
        (_pool("g", _control("a", "10.0.0.5"), _control("b", "10.0.0.5")),
         "pools[0].engines[1].grpc_port",
         "vllm.Control endpoint 10.0.0.5:50051 is also the vllm.Control endpoint "
         "10.0.0.5:50051 of pools[0].engines[0].grpc_port"),
        # spelled two ways, in two pools: both were watched, the blocks counted twice
        (_pool("g", _control("a", "::1")) + _pool("h", _control("b", "0:0:0:0:0:0:0:1")),
         "pools[1].engines[0].grpc_port",
         "[0:0:0:0:0:0:0:1]:50051 is also the vllm.Control endpoint [::1]:50051 of "
         "pools[0].engines[0].grpc_port"),
        (_pool("g", _control("a", "127.0.0.1"), _control("b", "::ffff:127.0.0.1")),
         "pools[0].engines[1].grpc_port", "of pools[0].engines[0].grpc_port"),
        (_pool("g", _control("a", "Node-1.example"), _control("b", "node-1.example")),
         "pools[0].engines[1].grpc_port", "of pools[0].engines[0].grpc_port"),
        # static publishers: the wildcard stands for the engine's host
        (_pool("g", _static("a", "127.0.0.1", "tcp://*:5557"))
         + _pool("h", _static("b", "::ffff:127.0.0.1", "tcp://*:5557")),
         "pools[1].engines[0].static.endpoint",
         "rank 0 publisher tcp://[::ffff:127.0.0.1]:5557 is also the rank 0 publisher "
         "tcp://127.0.0.1:5557 of pools[0].engines[0].static.endpoint"),
        (_pool("g", _static("a", "10.0.0.5", "tcp://*:5557"),
               _static("b", "h2", "tcp://10.0.0.5:5557")),
         "pools[0].engines[1].static.endpoint", "of pools[0].engines[0].static.endpoint"),
        # a DP rank's publisher (port + rank) that is another engine's
        (_pool("g", _static("a", "10.0.0.5", "tcp://*:5557", "[0, 1]"),
               _static("b", "10.0.0.5", "tcp://*:5558")),
         "pools[0].engines[1].static.endpoint",
         "rank 0 publisher tcp://10.0.0.5:5558 is also the rank 1 publisher"),
        (_pool("g", _static("a", "h1", "ipc:///run/vllm/kv"),
               _static("b", "h2", "ipc:///run/vllm/kv")),
         "pools[0].engines[1].static.endpoint", "of pools[0].engines[0].static.endpoint"),
        # a rank whose port would pass 65535 (the watcher failed on it at run time)
        (_pool("g", _static("a", "h1", "tcp://*:65535", "[0, 1]")),
         "pools[0].engines[0].static.dp_ranks", "out of range"),
    ],
)  # fmt: skip
def test_one_engine_configured_twice_is_refused(
    tmp_path: Path, pools: str, path: str, fragment: str
) -> None:
    cfg, problems = _check(tmp_path, HEAD + pools)
    assert cfg is None
    errors = _errors(problems)
    assert fragment in errors.get(path, ""), errors
    assert "configure each engine once" in errors[path] or "dp_ranks" in path


@pytest.mark.parametrize(
    "pools",
    [
        _pool("g", _control("a", "10.0.0.5"), _control("b", "10.0.0.5", 50052)),
        _pool("g", _control("a", "10.0.0.5"), _control("b", "10.0.0.6")),
        _pool("g", _static("a", "h1", "tcp://*:5557"), _static("b", "h2", "tcp://*:5557")),
        _pool("g", _static("a", "h1", "tcp://*:5557", "[0, 1]"),
              _static("b", "h1", "tcp://*:5559", "[0, 1]")),
        _pool("g", _static("a", "h1", "tcp://*:0"), _static("b", "h1", "tcp://*:0")),
        # engines found by DNS take their host from the records: not compared here
        _pool("g", '\n[[pools.engines]]\nname = "a"\ndns = "vllm.svc"\ngrpc_port = 50051\n'
              '\n[[pools.engines]]\nname = "b"\ndns = "vllm.svc"\ngrpc_port = 50051\n'),
    ],
)  # fmt: skip
def test_distinct_engines_pass(tmp_path: Path, pools: str) -> None:
    cfg, problems = _check(tmp_path, HEAD + pools)
    assert cfg is not None, problems


def test_check_config_and_a_reload_refuse_one_engine_twice(tmp_path: Path) -> None:
    """``check-config`` exits 2 naming both entries; SIGHUP's re-read (``read_config``) runs
    the same validation, so a reload to such a file changes nothing."""
    f = tmp_path / "kvrelay.toml"
    f.write_text(HEAD + _pool("g", _control("a", "::1")) + _pool("h", _control("b", "[0::1]")))
    run = kvrelay("check-config", str(f))
    assert run.returncode == 2, run.stdout + run.stderr
    assert "pools[1].engines[0].grpc_port" in run.stdout
    assert "pools[0].engines[0].grpc_port" in run.stdout
    cfg, problems = read_config(f)
    assert cfg is None and "pools[1].engines[0].grpc_port" in _errors(problems)


# ---- listeners -------------------------------------------------------------------------------


def _bind(host: str, port: int) -> list[socket.socket]:
    """Bind ``host:port`` as the daemon's listeners do (asyncio's ``create_server``; the
    start-up probe in ``ops/listeners.py``): every address, ``SO_REUSEADDR``, IPv6-only."""
    out: list[socket.socket] = []
    try:
        for family, kind, proto, _n, addr in socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        ):
            s = socket.socket(family, kind, proto)
            out.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            s.bind(addr)
            s.listen(1)
    except OSError:
        for s in out:
            s.close()
        raise
    return out


def _free_port() -> int:
    """A port free on both families' wildcards."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("0.0.0.0", 0))
            port = int(s.getsockname()[1])
        try:
            for s in _bind("0.0.0.0", port) + (_bind("::", port) if IPV6 else []):
                s.close()
        except OSError:
            continue
        return port
    raise AssertionError("no free port")


def _collide(a: str, b: str, port: int) -> bool:
    first = _bind(a, port)
    try:
        for s in _bind(b, port):
            s.close()
    except OSError:
        return True
    finally:
        for s in first:
            s.close()
    return False


def _host(bind: str) -> str:
    return bind[1:-1] if bind.startswith("[") else bind


V6 = NEEDS_IPV6


@pytest.mark.parametrize(
    ("relay", "metrics"),
    [
        pytest.param("[::]", "0.0.0.0", marks=V6),  # IPv6-only: no collision
        pytest.param("0.0.0.0", "[::]", marks=V6),
        pytest.param("[0:0:0:0:0:0:0:0]", "[::1]", marks=V6),  # the IPv6 wildcard, spelled out
        pytest.param("[::1]", "[0:0::1]", marks=V6),
        pytest.param("[::]", "127.0.0.1", marks=V6),
        ("0.0.0.0", "127.0.0.1"),
        ("127.0.0.1", "127.0.0.2"),
        ("localhost", "127.0.0.1"),
    ],
)
def test_relay_and_metrics_binds_collide_as_the_os_says(
    tmp_path: Path, relay: str, metrics: str
) -> None:
    port = _free_port()
    collide = _collide(_host(relay), _host(metrics), port)
    text = HEAD.replace('"dc"\n', f'"dc"\nbind = "{relay}:{port}"\n') + _pool(
        "g", _control("a", "10.0.0.5")
    ) + f'\n[metrics]\nbind = "{metrics}:{port}"\n'
    cfg, problems = _check(tmp_path, text)
    reported = "same address as relay.bind" in _errors(problems).get("metrics.bind", "")
    assert reported == collide, (relay, metrics, collide, problems)
    assert (cfg is None) == collide


@V6
def test_an_ipv4_mapped_listen_address_is_refused(tmp_path: Path) -> None:
    """The daemon's IPv6 listeners are IPv6-only: ``[::ffff:127.0.0.1]`` cannot be bound there
    ("Invalid argument" at the start, after ``check-config`` passed)."""
    port = _free_port()
    with pytest.raises(OSError):
        _bind("::ffff:127.0.0.1", port)
    text = HEAD.replace('"dc"\n', f'"dc"\nbind = "[::ffff:127.0.0.1]:{port}"\n') + _pool(
        "g", _control("a", "10.0.0.5")
    ) + '\n[metrics]\nbind = "[::FFFF:127.0.0.1]:0"\n'
    cfg, problems = _check(tmp_path, text)
    errors = _errors(problems)
    assert cfg is None
    assert f"write 127.0.0.1:{port}" in errors["relay.bind"]
    assert "write 127.0.0.1:0" in errors["metrics.bind"]
