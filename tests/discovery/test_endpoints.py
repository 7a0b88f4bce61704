"""Endpoint rules: wildcard substitution, DP offsets (§15.2), static sources."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrelay.discovery import (
    InvalidEndpoint,
    StaticSourceConfig,
    dp_offset,
    static_sources,
    substitute_wildcard,
)
from kvrelay.discovery.endpoints import canonical_host, canonical_network
from kvrelay.sim.wire import offset_endpoint


@pytest.mark.parametrize("wild", ["*", "0.0.0.0", "::", "[::]"])
def test_wildcards_replaced(wild: str) -> None:
    assert substitute_wildcard(f"tcp://{wild}:5557", "10.1.2.3") == "tcp://10.1.2.3:5557"
    assert substitute_wildcard(f"tcp://{wild}:5557", "fd00::1") == "tcp://[fd00::1]:5557"


@pytest.mark.parametrize("ep", ["tcp://10.0.0.5:5557", "tcp://[fd00::2]:1", "ipc:///tmp/x", ""])
def test_concrete_endpoints_untouched(ep: str) -> None:
    assert substitute_wildcard(ep, "h") == ep


@pytest.mark.parametrize("ep", ["tcp://*:notaport", "tcp://*", "tcp://*:70000"])
def test_bad_endpoints_raise(ep: str) -> None:
    with pytest.raises(InvalidEndpoint):
        substitute_wildcard(ep, "h")


def test_dp_offset_rules() -> None:
    assert dp_offset("tcp://*:5557", 0) == "tcp://*:5557"
    assert dp_offset("tcp://*:5557", 3) == "tcp://*:5560"
    assert dp_offset("tcp://*:0", 3) == "tcp://*:0"  # >= 0.31: port 0 unchanged
    assert dp_offset("inproc://ev", 2) == "inproc://ev_dp2"
    assert dp_offset("", 2) == ""
    with pytest.raises(InvalidEndpoint):
        dp_offset("udp://x:1", 1)
    with pytest.raises(InvalidEndpoint):
        dp_offset("tcp://*:65535", 1)


@settings(max_examples=100, deadline=None)
@given(
    port=st.integers(0, 60000),
    rank=st.integers(0, 64),
    host=st.sampled_from(["*", "0.0.0.0", "10.0.0.1"]),
)
def test_dp_offset_agrees_with_simulator(port: int, rank: int, host: str) -> None:
    ep = f"tcp://{host}:{port}"
    assert dp_offset(ep, rank) == offset_endpoint(ep, rank)


def test_static_sources_pre_027() -> None:
    cfg = StaticSourceConfig("tcp://*:5557", "tcp://*:5657", dp_ranks=(2, 0, 1), topic="kv")
    srcs = static_sources(cfg, "node-7")
    assert [s.dp_rank for s in srcs] == [0, 1, 2]
    assert [s.endpoint for s in srcs] == [f"tcp://node-7:{5557 + r}" for r in range(3)]
    assert [s.replay_endpoint for s in srcs] == [f"tcp://node-7:{5657 + r}" for r in range(3)]
    assert {s.topic for s in srcs} == {"kv"} and srcs[1].advertised_endpoint == "tcp://*:5558"
    no_replay = static_sources(StaticSourceConfig("tcp://10.0.0.9:5557"), "node-7")
    assert no_replay[0].endpoint == "tcp://10.0.0.9:5557" and no_replay[0].replay_endpoint is None


@pytest.mark.parametrize("wild", ["[0:0:0:0:0:0:0:0]", "[::0]", "[::ffff:0.0.0.0]"])
def test_every_spelling_of_the_unspecified_address_is_a_wildcard(wild: str) -> None:
    """Otherwise the relay dialled ``[0:0:0:0:0:0:0:0]:5557`` itself: its own host's port, not
    the engine's (another engine there would have fed this one's member)."""
    assert substitute_wildcard(f"tcp://{wild}:5557", "10.1.2.3") == "tcp://10.1.2.3:5557"


@pytest.mark.parametrize(
    ("host", "canonical"),
    [
        ("[0:0:0:0:0:0:0:1]", "::1"), ("::1", "::1"), ("FD00::A", "fd00::a"),
        ("::ffff:127.0.0.1", "127.0.0.1"), ("[::FFFF:7f00:1]", "127.0.0.1"),
        ("10.0.0.5", "10.0.0.5"), ("engine-0.svc", "engine-0.svc"), ("*", "*"),
    ],
)  # fmt: skip
def test_canonical_host_spells_each_ip_address_once(host: str, canonical: str) -> None:
    assert canonical_host(host) == canonical


def test_canonical_network_maps_ipv4_mapped_networks_to_ipv4() -> None:
    assert str(canonical_network("::ffff:10.0.0.0/104")) == "10.0.0.0/8"
    assert str(canonical_network("::ffff:10.0.0.5")) == "10.0.0.5/32"
    assert str(canonical_network("fd00::/64")) == "fd00::/64"
    assert str(canonical_network("::/0")) == "::/0"  # wider than the mapped range: as written
