"""Connect-mode binds (``[pools.connect] bind``) that cannot all be bound: two pools' binds, two
of one pool, or one and the relay's own listeners (``relay.bind``, ``metrics.bind``).

The oracle is the OS: each pair is bound for real, the connect bind as the relay's SUB binds it
(ZMQ_IPV6 for an IPv6 literal alone) and a listener as the relay's listeners do (SO_REUSEADDR,
IPv6-only), and ``check-config`` must refuse exactly the pairs whose second bind fails, with an
error naming both key paths.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from kvrelay.ingest.connect import _ipv6_bind
from kvrelay.ops.config import ConfigProblem, check_file
from tests.support.ipv6 import IPV6, NEEDS_IPV6
from tests.support.ports import distinct_ports

POOL = """
[[pools]]
namespace = "ns"
component = "c{i}"
endpoint = "generate"
model = "m"
kv_block_size = 16
[pools.connect]
bind = {binds}
topic_pattern = "kv@{{engine}}@{{model}}"
"""


def _listeners() -> tuple[int, str, str]:
    """A port for the binds under test, and a relay and a metrics address on two others."""
    # free on every address: a wildcard bind of one must not fail for another reason
    p, relay, metrics = distinct_ports(3, "::", dual_stack=True) if IPV6 else distinct_ports(
        3, "0.0.0.0"
    )
    return p, f"127.0.0.1:{relay}", f"127.0.0.1:{metrics}"


@contextlib.contextmanager
def _bound(ctx: zmq.Context[zmq.Socket[bytes]], what: str) -> Iterator[None]:
    """Hold ``what`` bound: ``tcp://…`` as the connect SUB binds it, ``HOST:PORT`` (brackets
    for IPv6) as the relay's listeners do. Raises OSError / ZMQError when it cannot be."""
    held: list[socket.socket | zmq.Socket[bytes]] = []
    try:
        if what.startswith("tcp://"):
            sub = ctx.socket(zmq.SUB)
            held.append(sub)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.IPV6, int(_ipv6_bind(what)))
            sub.bind(what)
        else:
            host, _, port = what.rpartition(":")
            infos = socket.getaddrinfo(
                host.strip("[]"), int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )
            for family, kind, proto, _name, addr in infos:
                s = socket.socket(family, kind, proto)
                held.append(s)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                s.bind(addr)
                s.listen(1)
        yield
    finally:
        for h in held:
            h.close()


def _collides(first: str, second: str) -> bool:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        with _bound(ctx, first):
            try:
                with _bound(ctx, second):
                    return False
            except (OSError, zmq.ZMQError):
                return True
    finally:
        ctx.term()


def _check(tmp_path: Path, pools: list[list[str]], relay: str, metrics: str,
           extra: str = "") -> list[ConfigProblem]:  # fmt: skip
    text = f'[relay]\ndc_name = "dc"\nbind = "{relay}"\n[metrics]\nbind = "{metrics}"\n{extra}'
    for i, binds in enumerate(pools):
        text += POOL.format(i=i, binds="[" + ", ".join(f'"{b}"' for b in binds) + "]")
    f = tmp_path / "kvrelay.toml"
    f.write_text(text)
    return check_file(f, env={})[1]


def _errors(problems: list[ConfigProblem]) -> list[tuple[str, str]]:
    return [(p.path, p.reason) for p in problems if p.severity == "error"]


V6 = NEEDS_IPV6
# (what binds first, the connect bind of pools[1] or of pools[0]), with {p} for one port; the
# first is a listener ("relay.bind=…", "metrics.bind=…") or the connect bind of pools[0]
PAIRS = [
    pytest.param("tcp://*:{p}", "tcp://127.0.0.1:{p}", id="wildcard-and-loopback"),
    pytest.param("tcp://0.0.0.0:{p}", "tcp://localhost:{p}", id="unspecified-and-a-name"),
    pytest.param("tcp://127.0.0.1:{p}", "tcp://127.0.0.2:{p}", id="two-addresses"),
    pytest.param("tcp://[::]:{p}", "tcp://127.0.0.1:{p}", id="dual-stack-and-ipv4", marks=V6),
    pytest.param("tcp://*:{p}", "tcp://[::1]:{p}", id="ipv4-wildcard-and-ipv6", marks=V6),
    pytest.param("tcp://[::1]:{p}", "tcp://[0:0::1]:{p}", id="ipv6-spellings", marks=V6),
    pytest.param("tcp://[::ffff:127.0.0.1]:{p}", "tcp://127.0.0.1:{p}", id="mapped", marks=V6),
    pytest.param("relay.bind=127.0.0.1:{p}", "tcp://*:{p}", id="relay-and-wildcard"),
    pytest.param("relay.bind=127.0.0.1:{p}", "tcp://127.0.0.2:{p}", id="relay-elsewhere"),
    pytest.param("metrics.bind=localhost:{p}", "tcp://127.0.0.1:{p}", id="metrics-by-name"),
    pytest.param("metrics.bind=0.0.0.0:{p}", "tcp://[::]:{p}", id="metrics-dual", marks=V6),
    pytest.param("relay.bind=[::]:{p}", "tcp://*:{p}", id="relay-ipv6-only", marks=V6),
    pytest.param("relay.bind=[::1]:{p}", "tcp://[::]:{p}", id="relay-ipv6-dual", marks=V6),
]


@pytest.mark.parametrize(("first", "second"), PAIRS)
def test_check_config_refuses_the_binds_the_os_refuses(
    tmp_path: Path, first: str, second: str
) -> None:
    """``tcp://*:5557`` in one pool and ``tcp://127.0.0.1:5557`` in another (or the gRPC port
    as a connect bind) passed ``check-config``, and the later bind failed at start."""
    p, relay, metrics = _listeners()
    first, second = first.format(p=p), second.format(p=p)
    setting, _, listen = first.partition("=")
    expected = _collides(listen or first, second)
    if listen:
        relay = listen if setting == "relay.bind" else relay
        metrics = listen if setting == "metrics.bind" else metrics
        problems = _check(tmp_path, [[second]], relay, metrics)
        path, other = "pools[0].connect.bind", f"{setting} ({listen})"
    else:
        problems = _check(tmp_path, [[first], [second]], relay, metrics)
        path, other = "pools[1].connect.bind", f"pools[0].connect.bind ({first})"
    errors = _errors(problems)
    if expected:
        assert len(errors) == 1, problems
        assert errors[0][0] == path and f"{second} binds what {other} does" in errors[0][1]
        assert "Address already in use" in errors[0][1]
    else:
        assert errors == [], problems


def test_two_binds_of_one_pool(tmp_path: Path) -> None:
    p, relay, metrics = _listeners()
    binds = [f"tcp://*:{p}", f"tcp://127.0.0.1:{p}"]
    assert _collides(*binds)
    errors = _errors(_check(tmp_path, [binds], relay, metrics))
    assert errors == [(
        "pools[0].connect.bind",
        f"tcp://127.0.0.1:{p} binds what pools[0].connect.bind (tcp://*:{p}) does: the later "
        "bind fails at start (Address already in use); give each its own port",
    )]  # fmt: skip


def test_a_disabled_metrics_listener_binds_nothing(tmp_path: Path) -> None:
    p, relay, _ = _listeners()
    problems = _check(
        tmp_path, [[f"tcp://*:{p}"]], relay, f"127.0.0.1:{p}", extra="enabled = false\n"
    )
    assert _errors(problems) == []


def test_one_ipc_path_spelled_two_ways(tmp_path: Path) -> None:
    """The later ipc:// bind takes the socket file from the earlier, silently: the earlier
    pool never heard from an engine again (an error at start would have been kinder)."""
    sock = tmp_path / "kv.sock"
    a, b = f"ipc://{sock}", f"ipc://{tmp_path}/./kv.sock"
    _, relay, metrics = _listeners()
    errors = _errors(_check(tmp_path, [[a], [b]], relay, metrics))
    assert len(errors) == 1 and errors[0][0] == "pools[1].connect.bind", errors
    assert f"{b} binds what pools[0].connect.bind ({a}) does" in errors[0][1]
    assert "takes the socket file" in errors[0][1]
    other = f"ipc://{tmp_path}/other.sock"
    assert _errors(_check(tmp_path, [[a], [other]], relay, metrics)) == []
