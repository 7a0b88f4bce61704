"""Configuration: one test per validation rule (key path + reason), env overrides, defaults.

The oracle for each rule is the operator-facing text: the exact key path and a reason fragment.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.contract.limits import RelayLimits
from kvrelay.hashing.identity import DEFAULT_CKF_SEED
from kvrelay.ops.config import (
    ConfigError,
    ConfigProblem,
    DaemonConfig,
    check_file,
    load_config,
    parse_bind,
)
from tests.support.certs import make_pki
from tests.support.commands import MINIMAL, kvrelay

POOL = """
[[pools]]
namespace = "ns"
component = "backend"
endpoint = "generate"
"""
ENGINE = """
[[pools.engines]]
name = "e0"
grpc_port = 50051
"""


def _relay(line: str) -> str:
    """MINIMAL with one more key in [relay]."""
    return MINIMAL.replace('dc_name = "dc-test"', f'dc_name = "dc-test"\n{line}')


def _pool(line: str) -> str:
    """MINIMAL with one more key in the first [[pools]]."""
    return MINIMAL.replace('endpoint = "generate"', f'endpoint = "generate"\n{line}')


def _check(
    tmp_path: Path, text: str, env: dict[str, str] | None = None
) -> tuple[DaemonConfig | None, list[ConfigProblem]]:
    f = tmp_path / "kvrelay.toml"
    f.write_text(text)
    return check_file(f, env={} if env is None else env)


def _errors(problems: list[ConfigProblem]) -> dict[str, str]:
    return {p.path: p.reason for p in problems if p.severity == "error"}


# (rule id, file text, expected key path, reason fragment)
RULES = [
    ("unknown-key", _relay('discovery_interval = 3'),
     "relay.discovery_interval", "did you mean 'discovery_interval_s'"),
    ("unknown-section", MINIMAL + "\n[relayy]\nx = 1\n", "relayy", "unknown section"),
    ("unknown-engine-key", MINIMAL + "grcp_port = 1\n", "pools[0].engines[0].grcp_port",
     "did you mean 'grpc_port'"),
    ("wrong-type", MINIMAL.replace("grpc_port = 50051", 'grpc_port = "50051"'),
     "pools[0].engines[0].grpc_port", "must be an integer, got string"),
    ("port-range", MINIMAL.replace("grpc_port = 50051", "grpc_port = 70000"),
     "pools[0].engines[0].grpc_port", "must be in 1..65535"),
    ("bool-type", _pool('cache_salt_namespacing = 1'),
     "pools[0].cache_salt_namespacing", "must be a boolean"),
    ("adapter-names", _pool('lora_adapters = ["a", " b"]'),
     "pools[0].lora_adapters", "without surrounding whitespace"),
    ("adapter-duplicates", _pool('lora_adapters = ["a", "a"]'),
     "pools[0].lora_adapters", "duplicate adapter names"),
    ("adapter-type", _pool('lora_adapters = [1]'),
     "pools[0].lora_adapters", "must be a string or a non-empty list of strings"),
    ("missing-dc-name", MINIMAL.replace('dc_name = "dc-test"', ""), "relay.dc_name",
     "required key is missing"),
    ("missing-relay", MINIMAL.replace('[relay]\ndc_name = "dc-test"', ""), "relay",
     "required section [relay]"),
    ("blank-dc-name", MINIMAL.replace('"dc-test"', '" dc"'), "relay.dc_name",
     "without surrounding whitespace"),
    # the DNS client asks a server by address: a host name passed here and failed at start
    ("dns-server-by-name", MINIMAL.replace('dc_name = "dc-test"',
                                           'dc_name = "dc-test"\ndns_server = "localhost:53"'),
     "relay.dns_server", "must be an IP address and port"),
    # port 0 passed as a bind's ephemeral port: every lookup then failed (EINVAL)
    ("dns-server-port-0", _relay('dns_server = "10.0.0.1:0"'),
     "relay.dns_server", "must be an IP address and port (IP:PORT, [IPv6]:PORT), port 1..65535"),
    ("dns-server-port-high", _relay('dns_server = "[::1]:65536"'),
     "relay.dns_server", "port 1..65535"),
    ("missing-pool-endpoint", MINIMAL.replace('endpoint = "generate"', ""), "pools[0].endpoint",
     "required key is missing"),
    ("duplicate-engine", MINIMAL + ENGINE.replace("50051", "50052"), "pools[1 - 1].engines[1].name",
     "duplicate engine name 'e0'"),
    ("engine-in-two-pools", MINIMAL + POOL.replace("backend", "b2") + ENGINE,
     "pools[1].engines[0].name", "already used in pools[0].engines[0]"),
    ("duplicate-pool", MINIMAL + POOL + ENGINE.replace("e0", "e1"), "pools[1]",
     "same pool name 'ns/backend/generate' (namespace/component/endpoint) as pools[0]"),
    # another triple, one name: the pools would share a state file, metrics and logs
    ("same-pool-name", MINIMAL
     + '[[pools]]\nnamespace = "t"\ncomponent = "a/b"\nendpoint = "c"\n'
     + ENGINE.replace("e0", "e1")
     + '[[pools]]\nnamespace = "t/a"\ncomponent = "b"\nendpoint = "c"\n'
     + ENGINE.replace("e0", "e2"),
     "pools[2]", "same pool name 't/a/b/c' (namespace/component/endpoint) as pools[1]"),
    ("no-grpc-no-static", MINIMAL.replace("grpc_port = 50051", ""),
     "pools[0].engines[0].grpc_port", "required unless [pools.engines.static]"),
    ("static-needs-model", MINIMAL.replace(
        "grpc_port = 50051", '[pools.engines.static]\nendpoint = "tcp://*:5557"'),
     "pools[0].model", "required when an engine has no grpc_port"),
    ("static-needs-block-size", MINIMAL.replace(
        "grpc_port = 50051", '[pools.engines.static]\nendpoint = "tcp://*:5557"'),
     "pools[0].kv_block_size", "required when an engine has no grpc_port"),
    ("static-bad-endpoint", MINIMAL.replace(
        "grpc_port = 50051", 'grpc_port = 1\n[pools.engines.static]\nendpoint = "tcp://*:x"'),
     "pools[0].engines[0].static.endpoint", "bad port in endpoint"),
    ("static-dup-ranks", MINIMAL.replace(
        "grpc_port = 50051",
        'grpc_port = 1\n[pools.engines.static]\nendpoint = "tcp://*:5557"\ndp_ranks = [0, 0]'),
     "pools[0].engines[0].static.dp_ranks", "duplicate values"),
    ("bad-role", _pool('role = "decoder"'),
     "pools[0].role", "must be one of aggregated, prefill, decode, encode, legacy"),
    ("bad-needs-role", _pool('needs = [["legacy"]]'),
     "pools[0].needs[0][0]", "must be one of aggregated, prefill, decode, encode, got 'legacy'"),
    ("needs-shape", _pool('needs = ["prefill"]'),
     "pools[0].needs[0]", "must be a non-empty list of roles"),
    ("legacy-with-needs", MINIMAL.replace(
        'endpoint = "generate"', 'endpoint = "g"\nrole = "legacy"\nneeds = [["prefill"]]'),
     "pools[0].needs", "legacy pool"),
    ("bad-hash-format", _pool('hash_format = "x"'),
     "pools[0].hash_format", "must be one of standard, eagle"),
    ("expected-blocks-too-big", MINIMAL.replace(
        'endpoint = "generate"', 'endpoint = "g"\nexpected_blocks = 100_000_000'),
     "pools[0].expected_blocks", "exceeds 2^24"),
    ("ckf-seed-range", _pool('ckf_seed = -1'),
     "pools[0].ckf_seed", "must be in 0.."),
    ("no-pools", '[relay]\ndc_name = "d"\n', "pools", "no pools configured"),
    ("pool-without-engines", '[relay]\ndc_name = "d"\n' + POOL, "pools[0].engines",
     "at least one [[pools.engines]]"),
    ("bad-bind-port", _relay('bind = "127.0.0.1:99999"'),
     "relay.bind", "bad bind address: port must be 0..65535"),
    ("bad-bind-shape", _relay('bind = "50161"'),
     "relay.bind", "expected HOST:PORT"),
    ("bad-bind-ipv6", _relay('bind = "::1:50161"'),
     "relay.bind", "IPv6 addresses need brackets"),
    ("bad-bind-host", _relay('bind = "bad host:1"'),
     "relay.bind", "bad host"),
    ("drt-zero", _relay('drt_instance_id = 0'),
     "relay.drt_instance_id", "must be in 1.."),
    ("duration-nonpositive", MINIMAL + "", "relay.limits.keepalive_interval_s",
     "must be > 0 and <= 1 year"),
    ("limit-cross-field", MINIMAL + "", "relay.limits.max_message_bytes", "must be >= 4259904"),
    # 0 is allowed (publish at once): the range said "> 0"
    ("delay-negative", MINIMAL + "", "relay.limits.publication_delay_s",
     "must be >= 0 and <= 1 year"),
    ("event-loop", _relay('event_loop = "trio"'),
     "relay.event_loop", "must be one of auto, asyncio, uvloop"),
    ("zmq-reader", _relay('zmq_reader = "czmq"'),
     "relay.zmq_reader", "must be one of zmtp, libzmq"),
    ("log-level", MINIMAL + '\n[logging]\nlevel = "loud"\n', "logging.level",
     "must be one of debug"),
    ("log-format", MINIMAL + '\n[logging]\nformat = "xml"\n', "logging.format",
     "must be one of auto, json, console"),
    ("metrics-same-port", _relay('bind = "127.0.0.1:7000"')
     + '\n[metrics]\nbind = "127.0.0.1:7000"\n', "metrics.bind", "same address as relay.bind"),
    # other spellings of one listener: a name and its address, a wildcard and an address
    ("metrics-same-port-by-name", _relay('bind = "localhost:7000"')
     + '\n[metrics]\nbind = "127.0.0.1:7000"\n', "metrics.bind", "same address as relay.bind"),
    ("metrics-same-port-wildcard", _relay('bind = "0.0.0.0:7000"')
     + '\n[metrics]\nbind = "127.0.0.1:7000"\n', "metrics.bind", "same address as relay.bind"),
    ("tls-cert-without-key", MINIMAL + '\n[tls]\ncert = "{cert}"\n', "tls.key",
     "required when tls.cert is set"),
    ("tls-key-without-cert", MINIMAL + '\n[tls]\nkey = "{cert}"\n', "tls.cert",
     "required when tls.key is set"),
    ("tls-ca-without-cert", MINIMAL + '\n[tls]\nclient_ca = "{cert}"\n', "tls.cert",
     "required when tls.client_ca is set"),
    ("tls-missing-file", MINIMAL + '\n[tls]\ncert = "/nonexistent/c.pem"\nkey = "{cert}"\n',
     "tls.cert", "does not exist"),
    ("pools-not-array", 'pools = 3\n[relay]\ndc_name = "d"\n', "pools",
     "must be an array of tables"),
]
# Rules whose text needs a [relay.limits] table (appending after [[pools]] would nest it there).
LIMITS = {
    "duration-nonpositive": "[relay.limits]\nkeepalive_interval_s = 0\n",
    "limit-cross-field": "[relay.limits]\nmax_message_bytes = 1024\n",
    "delay-negative": "[relay.limits]\npublication_delay_s = -0.5\n",
}


@pytest.mark.parametrize(("rule", "text", "path", "reason"), RULES, ids=[r[0] for r in RULES])
def test_each_rule_reports_key_path_and_reason(
    tmp_path: Path, rule: str, text: str, path: str, reason: str
) -> None:
    cert = tmp_path / "c.pem"
    cert.write_text("not really a certificate")  # readable: file checks pass, pairing fails
    if rule in LIMITS:
        text = text.replace("[[pools]]", LIMITS[rule] + "\n[[pools]]", 1)
    text = text.replace("{cert}", str(cert))
    cfg, problems = _check(tmp_path, text)
    errors = _errors(problems)
    path = path.replace("[1 - 1]", "[0]")
    assert cfg is None, f"{rule}: config built despite errors"
    assert path in errors, f"{rule}: no problem at {path}; got {problems}"
    assert reason in errors[path], f"{rule}: {errors[path]!r} lacks {reason!r}"


def test_every_problem_is_collected_in_one_pass(tmp_path: Path) -> None:
    text = """
[relay]
dc_name = ""
bind = "nowhere"
[relay.limits]
max_subscribers_per_pool = 0
[logging]
level = 3
[[pools]]
namespace = "ns"
component = "c"
endpoint = "e"
role = "chef"
[[pools.engines]]
name = "a"
grpc_port = 0
[[pools.engines]]
name = "a"
"""
    cfg, problems = _check(tmp_path, text)
    assert cfg is None
    assert set(_errors(problems)) == {
        "relay.dc_name",
        "relay.bind",
        "relay.limits.max_subscribers_per_pool",
        "logging.level",
        "pools[0].role",
        "pools[0].engines[0].grpc_port",
        "pools[0].engines[1].name",
        "pools[0].engines[1].grpc_port",
    }


def test_toml_syntax_error_names_the_file(tmp_path: Path) -> None:
    cfg, problems = _check(tmp_path, "[relay\n")
    assert cfg is None
    (p,) = problems
    assert p.path.endswith("kvrelay.toml") and "TOML syntax error" in p.reason


def test_unreadable_file(tmp_path: Path) -> None:
    cfg, problems = check_file(tmp_path / "absent.toml", env={})
    assert cfg is None and "cannot read the file" in problems[0].reason


def test_plaintext_on_network_is_a_warning_not_an_error(tmp_path: Path) -> None:
    text = _relay('bind = "0.0.0.0:50161"')
    cfg, problems = _check(tmp_path, text)
    assert cfg is not None
    (w,) = problems
    assert (w.severity, w.path) == ("warning", "relay.bind") and "plaintext" in w.reason
    assert cfg.warnings == (w,)
    # the same bind with TLS configured raises no warning
    pki = make_pki(tmp_path)  # check-config loads the files: they must be a real pair
    cert, key = pki.server_cert, pki.server_key
    cfg, problems = _check(tmp_path, text + f'\n[tls]\ncert = "{cert}"\nkey = "{key}"\n')
    assert cfg is not None and problems == [] and cfg.tls.enabled


def _warnings(problems: list[ConfigProblem]) -> dict[str, str]:
    return {p.path: p.reason for p in problems if p.severity == "warning"}


def test_a_runtime_dir_workers_cannot_use_is_a_warning(tmp_path: Path) -> None:
    """``workers ≥ 2`` make their internal socket's directory in ``runtime_dir``: one that is
    missing, not a directory or read-only passed ``check-config``, then ``serve`` exited 1
    ("needs a writable runtime directory"). The default (the temp directory) is never named."""
    missing = tmp_path / "missing"
    a_file = tmp_path / "file"
    a_file.write_text("")
    read_only = tmp_path / "ro"
    read_only.mkdir(mode=0o500)
    cases = [(missing, "does not exist"), (a_file, "is not a directory")]
    if os.geteuid() != 0:  # root writes anywhere but on a read-only mount
        cases.append((read_only, "is not writable by this user"))
    for where, why in cases:
        text = _relay(f'workers = 2\nruntime_dir = "{where}"')
        cfg, problems = _check(tmp_path, text)
        assert cfg is not None, problems  # it starts nothing: a warning
        warned = _warnings(problems)
        assert f"{str(where)!r} {why}" in warned.get("relay.runtime_dir", ""), problems
        assert "serve would exit 1 (start_failed)" in warned["relay.runtime_dir"]
        # one process uses no runtime directory: nothing to say
        cfg, problems = _check(tmp_path, _relay(f'workers = 1\nruntime_dir = "{where}"'))
        assert cfg is not None and problems == [], problems
    # systemd's RUNTIME_DIRECTORY is what it defaults to
    cfg, problems = _check(tmp_path, _relay("workers = 2"), {"RUNTIME_DIRECTORY": str(missing)})
    assert "does not exist" in _warnings(problems).get("relay.runtime_dir", ""), problems
    for usable in ({}, {"RUNTIME_DIRECTORY": str(tmp_path)}):
        cfg, problems = _check(tmp_path, _relay("workers = 2"), usable)
        assert cfg is not None and problems == [], problems


def test_a_block_size_given_and_refused_is_not_also_missing(tmp_path: Path) -> None:
    """A static pool's ``kv_block_size = 0`` got its range error and a second one saying the key
    was required, though it was set: one error, naming the range."""
    static = MINIMAL.replace(
        "grpc_port = 50051", '[pools.engines.static]\nendpoint = "tcp://*:5557"'
    ).replace('endpoint = "generate"', 'endpoint = "generate"\nmodel = "m"\nkv_block_size = 0')
    cfg, problems = _check(tmp_path, static)
    assert cfg is None
    assert [(p.path, "must be in 1.." in p.reason) for p in problems if p.severity == "error"] == [
        ("pools[0].kv_block_size", True)
    ], problems


def test_a_state_dir_the_relay_would_refuse_is_a_warning(tmp_path: Path) -> None:
    """A group- or world-writable ``state_dir`` passed ``check-config``; ``serve`` then refused
    it (``state_dir_unusable``) and ran without saving state."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    cfg, problems = _check(tmp_path, _relay(f'state_dir = "{shared}"'))
    assert cfg is not None, problems
    reason = _warnings(problems).get("relay.state_dir", "")
    assert "group- or world-writable (mode 0777)" in reason, problems
    assert "state_dir_unusable" in reason
    # systemd's STATE_DIRECTORY alike; a private one, or one the relay creates, is fine
    cfg, problems = _check(tmp_path, MINIMAL, {"STATE_DIRECTORY": str(shared)})
    assert "relay.state_dir" in _warnings(problems), problems
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    for ok in (private, tmp_path / "made" / "later"):
        cfg, problems = _check(tmp_path, _relay(f'state_dir = "{ok}"'))
        assert cfg is not None and problems == [], problems
    if os.geteuid() != 0:  # root creates anywhere but on a read-only mount
        sealed = tmp_path / "sealed"
        sealed.mkdir(mode=0o500)
        cfg, problems = _check(tmp_path, _relay(f'state_dir = "{sealed / "state"}"'))
        assert "cannot create it" in _warnings(problems).get("relay.state_dir", ""), problems


def test_check_config_prints_the_directory_warnings(tmp_path: Path) -> None:
    """As an operator runs it: exit 0, each warning on its own line."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    f = tmp_path / "kvrelay.toml"
    f.write_text(_relay(f'workers = 2\nruntime_dir = "/proc/kvrelay-nope"\n'
                        f'state_dir = "{shared}"'))  # fmt: skip
    run = kvrelay("check-config", str(f))
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert any(ln.startswith("warning: relay.runtime_dir: '/proc/kvrelay-nope' does not exist")
               for ln in lines), lines  # fmt: skip
    assert any(ln.startswith(f"warning: relay.state_dir: {shared}: group- or world-writable")
               for ln in lines), lines  # fmt: skip
    assert lines[-1].endswith("2 warning(s)"), lines


def test_minimal_file_gets_documented_defaults(tmp_path: Path) -> None:
    cfg, problems = _check(tmp_path, MINIMAL)
    assert problems == [] and cfg is not None
    assert (cfg.bind_host, cfg.bind_port) == ("127.0.0.1", 50161)
    assert (cfg.metrics.enabled, cfg.metrics.host, cfg.metrics.port) == (True, "127.0.0.1", 50162)
    assert (cfg.logging.level, cfg.logging.format) == ("info", "auto")
    assert not cfg.tls.enabled and cfg.event_loop == "auto" and cfg.shutdown_timeout_s == 10.0
    r = cfg.relay
    assert r.dc_name == "dc-test" and r.drt_instance_id is None and r.limits == RelayLimits()
    assert r.zmq_reader == "zmtp"
    assert (r.discovery_interval_s, r.discovery_timeout_s, r.metrics_scrape_interval_s) == (
        5.0, 2.0, 1.0,
    )
    (pool,) = r.pools
    assert pool.triple == ("ns", "backend", "generate")
    assert pool.role == pb.WorkerRole.AGGREGATED and pool.needs == ()
    assert pool.hash_format == pb.KvQueryHashFormat.DYNAMO_STANDARD_V1
    assert (pool.expected_blocks, pool.ckf_seed) == (1_048_576, DEFAULT_CKF_SEED)
    (engine,) = pool.engines
    assert (engine.name, engine.host, engine.grpc_port, engine.static) == (
        "e0", "127.0.0.1", 50051, None,
    )
    assert "1 pool(s), 1 engine(s)" in cfg.summary()


def test_full_file_maps_every_section(tmp_path: Path) -> None:
    limits = "\n".join(
        f"{k} = {v}"
        for k, v in {
            "max_message_bytes": 9 * 1024 * 1024, "keepalive_interval_s": 30,
            "keepalive_timeout_s": 5.5, "pool_heartbeat_s": 2, "readiness_heartbeat_s": 3,
            "snapshot_progress_timeout_s": 40, "load_window_s": 0.5,
            "publication_queue_capacity": 8, "publication_queue_bytes": 32 * 1024 * 1024,
            "publication_encoding_concurrency": 3, "max_catalog_subscribers": 5,
            "max_pool_streams_total": 6, "max_subscribers_per_pool": 7,
            "max_initialized_pool_hubs": 9, "max_readiness_subscribers": 10,
            "max_load_subscribers": 11, "load_fanout_capacity": 12,
            "publish_every_n_events": 13, "publication_delay_s": 0.002,
        }.items()
    )
    text = f"""
[relay]
dc_name = "dc-x"
bind = "[::1]:6000"
drt_instance_id = 42
discovery_interval_s = 1
event_loop = "UVLOOP"
[relay.limits]
{limits}
[logging]
level = "DEBUG"
format = "json"
[metrics]
enabled = false
[[pools]]
namespace = "ns"
component = "prefill"
endpoint = "generate"
role = "prefill"
hash_format = "eagle"
expected_blocks = 1000
ckf_seed = 7
model = "m"
kv_block_size = 32
cache_salt_namespacing = true
multimodal_hashing = true
[[pools.engines]]
name = "p0"
host = "10.0.0.5"
metrics_port = 8000
total_kv_blocks = 4096
[pools.engines.static]
endpoint = "tcp://*:5557"
replay_endpoint = "tcp://*:5657"
dp_ranks = [0, 1]
topic = "kv"
[[pools]]
namespace = "ns"
component = "decode"
endpoint = "generate"
role = "decode"
needs = [["prefill"], ["aggregated", "encode"]]
[[pools.engines]]
name = "d0"
grpc_port = 50052
"""
    cfg, problems = _check(tmp_path, text)
    assert problems == [] and cfg is not None
    assert (cfg.bind_host, cfg.bind_port) == ("::1", 6000)
    assert cfg.event_loop == "uvloop" and cfg.logging.level == "debug" and not cfg.metrics.enabled
    assert cfg.relay.drt_instance_id == 42 and cfg.relay.discovery_interval_s == 1.0
    lim = cfg.relay.limits
    assert lim.keepalive_timeout_s == 5.5 and lim.publication_delay_s == 0.002
    assert lim.max_load_subscribers == 11 and lim.publish_every_n_events == 13
    p, d = cfg.relay.pools
    assert p.role == pb.WorkerRole.PREFILL and p.hash_format == pb.KvQueryHashFormat.DYNAMO_EAGLE_V1
    assert (p.expected_blocks, p.ckf_seed, p.model, p.kv_block_size) == (1000, 7, "m", 32)
    assert p.decode.cache_salt_namespacing and p.decode.multimodal_hashing
    (e,) = p.engines
    assert e.static is not None and e.static.dp_ranks == (0, 1) and e.static.topic == "kv"
    assert e.static.replay_endpoint == "tcp://*:5657" and e.total_kv_blocks == 4096
    assert d.needs == (
        frozenset({pb.WorkerRole.PREFILL}),
        frozenset({pb.WorkerRole.AGGREGATED, pb.WorkerRole.ENCODE}),
    )


def test_every_relay_limit_is_configurable() -> None:
    from dataclasses import fields

    from kvrelay.ops.config import LIMITS_KEYS

    assert set(LIMITS_KEYS) == {f.name for f in fields(RelayLimits)}


def test_publication_delay_may_be_zero_as_documented() -> None:
    """docs/operations.md: ``publication_delay_s`` 0 = never wait (RelayLimits takes it too)."""
    from kvrelay.ops.config import parse_config

    raw: dict[str, Any] = {"relay": {"dc_name": "dc", "limits": {"publication_delay_s": 0}},
           "pools": [{"namespace": "a", "component": "b", "endpoint": "c",
                      "engines": [{"name": "e", "grpc_port": 1}]}]}  # fmt: skip
    cfg, problems = parse_config(raw, env={})
    assert cfg is not None, problems
    assert cfg.relay.limits.publication_delay_s == 0
    raw["relay"]["limits"] = {"pool_heartbeat_s": 0}
    assert "relay.limits.pool_heartbeat_s" in _errors(parse_config(raw, env={})[1])


@pytest.mark.parametrize("key", ["sync_wait_s", "upstream_heartbeat_s"])
def test_mirror_durations_are_refused_where_the_mirror_would_refuse_them(key: str) -> None:
    """MirrorSettings takes (0, 3600] s: check-config must not pass a value the start refuses."""
    from kvrelay.ops.config import parse_config
    from kvrelay.ops.front import mirror_settings

    ok, problems = parse_config({"mirror": {"upstream": "127.0.0.1:50161", key: 3600}}, env={})
    assert ok is not None and ok.mirror is not None, problems
    mirror_settings(ok.mirror, ok.relay.limits)  # builds
    bad, problems = parse_config({"mirror": {"upstream": "127.0.0.1:50161", key: 3601}}, env={})
    assert bad is None and "(0, 3600]" in _errors(problems)[f"mirror.{key}"]


@pytest.mark.parametrize("key", ["pool_heartbeat_s", "readiness_heartbeat_s"])
def test_worker_periods_are_refused_where_a_worker_would_refuse_them(key: str) -> None:
    """With ``workers`` ≥ 2 each fan-out worker mirrors the ingest process at the relay's
    heartbeat periods, and a mirror takes at most 3600 s: a longer one passed check-config and
    then failed every worker's start. With one process a year is still fine."""
    from kvrelay.ops.config import parse_config

    def raw(workers: int, seconds: float) -> dict[str, object]:
        return {"relay": {"dc_name": "dc", "workers": workers, "limits": {key: seconds}},
                "pools": [{"namespace": "a", "component": "b", "endpoint": "c",
                           "engines": [{"name": "e", "grpc_port": 1}]}]}  # fmt: skip

    assert parse_config(raw(1, 7200.0), env={})[0] is not None
    assert parse_config(raw(2, 3600.0), env={})[0] is not None
    bad, problems = parse_config(raw(2, 3601.0), env={})
    assert bad is None and "workers" in _errors(problems)[f"relay.limits.{key}"]


# ---- environment overrides ------------------------------------------------------------------


def test_env_overrides_are_typed_and_win_over_the_file(tmp_path: Path) -> None:
    env = {
        "KVRELAY_RELAY_BIND": "127.0.0.2:7001",
        "KVRELAY_RELAY_DC_NAME": "dc-env",
        "KVRELAY_RELAY_DRT_INSTANCE_ID": "0x10",
        "KVRELAY_RELAY_DISCOVERY_INTERVAL_S": "0.25",
        "KVRELAY_RELAY_LIMITS_MAX_POOL_STREAMS_TOTAL": "8",
        "KVRELAY_LOGGING_LEVEL": "warning",
        "KVRELAY_METRICS_BIND": "127.0.0.1:9999",
        "KVRELAY_METRICS_ENABLED": "no",
        "KVRELAY_CONFIG": "/ignored/not/a/section.toml",
        "UNRELATED": "x",
    }
    cfg, problems = _check(tmp_path, MINIMAL, env)
    assert problems == [] and cfg is not None
    assert (cfg.bind_host, cfg.bind_port, cfg.relay.dc_name) == ("127.0.0.2", 7001, "dc-env")
    assert cfg.relay.drt_instance_id == 16 and cfg.relay.discovery_interval_s == 0.25
    assert cfg.relay.limits.max_pool_streams_total == 8
    assert cfg.logging.level == "warning"
    assert (cfg.metrics.enabled, cfg.metrics.port) == (False, 9999)


@pytest.mark.parametrize(
    ("name", "value", "path", "reason"),
    [
        ("KVRELAY_RELAY_DISCOVERY_INTERVAL_S", "fast", "env.KVRELAY_RELAY_DISCOVERY_INTERVAL_S",
         "expected a number"),
        ("KVRELAY_METRICS_ENABLED", "maybe", "env.KVRELAY_METRICS_ENABLED",
         "expected a boolean (true/false/1/0/yes/no/on/off), got 'maybe'"),
        ("KVRELAY_RELAY_DRT_INSTANCE_ID", "1.5", "env.KVRELAY_RELAY_DRT_INSTANCE_ID",
         "expected an integer"),
        ("KVRELAY_RELAY_DC_NAM", "x", "env.KVRELAY_RELAY_DC_NAM",
         "did you mean KVRELAY_RELAY_DC_NAME"),
        ("KVRELAY_RELAY_LIMITS", "x", "env.KVRELAY_RELAY_LIMITS", "no scalar key relay.limits"),
        ("KVRELAY_RELAY_BIND", "127.0.0.1", "relay.bind", "(set by KVRELAY_RELAY_BIND)"),
        ("KVRELAY_LOGGING_LEVEL", "chatty", "logging.level", "(set by KVRELAY_LOGGING_LEVEL)"),
    ],
)
def test_bad_env_overrides_are_problems(
    tmp_path: Path, name: str, value: str, path: str, reason: str
) -> None:
    cfg, problems = _check(tmp_path, MINIMAL, {name: value})
    errors = _errors(problems)
    assert cfg is None and path in errors and reason in errors[path], problems


def test_load_config_raises_with_all_problems(tmp_path: Path) -> None:
    f = tmp_path / "k.toml"
    f.write_text(MINIMAL.replace("grpc_port = 50051", "grpc_port = 0"))
    with pytest.raises(ConfigError) as info:
        load_config(f, env={})
    assert [p.path for p in info.value.problems] == ["pools[0].engines[0].grpc_port"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:0", ("127.0.0.1", 0)),
        ("[::]:80", ("::", 80)),
        ("relay.local:1", ("relay.local", 1)),
    ],
)
def test_parse_bind(text: str, expected: tuple[str, int]) -> None:
    assert parse_bind(text) == expected


def test_check_config_subprocess_exit_codes(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(MINIMAL.replace("grpc_port = 50051", "grpc_port = 70000"))
    run = kvrelay("check-config", str(bad))
    assert run.returncode == 2
    assert "error: pools[0].engines[0].grpc_port: must be in 1..65535, got 70000" in run.stdout
    good = tmp_path / "good.toml"
    good.write_text(MINIMAL)
    run = kvrelay("check-config", str(good))
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 1 and "ok:" in lines[0] and "1 pool(s), 1 engine(s)" in lines[0]


def test_a_refused_start_is_an_error_in_the_journal(tmp_path: Path) -> None:
    """Under systemd stderr is the journal: the lines that say why ``serve`` refuses to start
    (and ``check-config`` in ``ExecStartPre=``) carry their syslog priority, as the daemon's log
    lines do, so ``journalctl -p err`` (or the documented ``-p warning``) shows them.
    Unprefixed, journald stored them as info."""
    import os
    import subprocess
    import sys

    from tests.support.commands import REPO, clean_env

    cfg = tmp_path / "bad.toml"
    cfg.write_text(MINIMAL.replace('dc_name = "dc-test"', 'dc_name = "dc-test"\nbind = '
                                   '"0.0.0.0:50161"').replace("50051", "70000"))  # fmt: skip
    problems = [
        "<3>error: pools[0].engines[0].grpc_port: must be in 1..65535, got 70000",
        "<4>warning: relay.bind: plaintext gRPC on non-loopback address 0.0.0.0:50161; "
        "configure [tls] cert/key (and client_ca) for anything beyond one host",
    ]
    for args, last in (
        (("serve", "--config", str(cfg)), f"kvrelay serve: refusing to start: invalid "
                                          f"configuration {cfg}"),
        (("check-config", str(cfg)), f"{cfg}: 1 error(s); the relay would refuse to start"),
    ):  # fmt: skip
        journal = tmp_path / "journal"
        with journal.open("w") as out:
            st = os.fstat(out.fileno())
            env = clean_env(JOURNAL_STREAM=f"{st.st_dev}:{st.st_ino}")
            run = subprocess.run([sys.executable, "-m", "kvrelay", *args], stdout=out,
                                 stderr=out, env=env, cwd=REPO, timeout=60)  # fmt: skip
        assert run.returncode == 2
        assert journal.read_text().splitlines() == [*problems, f"<3>{last}"]


def _static(name: str, host: str, endpoint: str, replay: str | None, ranks: str) -> str:
    replay_line = f'replay_endpoint = "{replay}"\n' if replay else ""
    return (
        f'\n[[pools.engines]]\nname = "{name}"\nhost = "{host}"\n[pools.engines.static]\n'
        f'endpoint = "{endpoint}"\n{replay_line}dp_ranks = {ranks}\n'
    )


STATIC_POOL = POOL + 'model = "m"\nkv_block_size = 16\n'


@pytest.mark.parametrize(
    ("engines", "expected"),
    [
        # vLLM's common pair with 2 ranks: rank 1 publishes on 5558, rank 0's replay port
        (_static("a", "h1", "tcp://*:5557", "tcp://*:5558", "[0, 1]"),
         [("pools[0].engines[0].static.replay_endpoint",
           "rank 0 replay port 5558 on h1 is also the rank 1 publisher port 5558")]),
        (_static("a", "h1", "tcp://*:5557", "tcp://*:5657", "[0, 1]"), []),
        (_static("a", "h1", "tcp://*:5557", "tcp://*:5558", "[0]"), []),
        # two engines on one host with overlapping ranges (one publisher port twice is one
        # engine configured twice: an error, test_one_engine_configured_twice_is_refused); on
        # two hosts they are fine
        (_static("a", "h1", "tcp://*:5557", None, "[0]")
         + _static("b", "h1", "tcp://*:5600", "tcp://*:5557", "[0]"),
         [("pools[0].engines[1].static.replay_endpoint",
           "rank 0 replay port 5557 on h1 is also the rank 0 publisher port 5557 of "
           "pools[0].engines[0].static")]),
        (_static("a", "h1", "tcp://*:5557", None, "[0]")
         + _static("b", "h2", "tcp://*:5600", "tcp://*:5557", "[0]"), []),
        # an explicit host in the endpoint counts, not the engine's host; port 0 is ephemeral
        (_static("a", "h1", "tcp://h9:5557", None, "[0]")
         + _static("b", "h2", "tcp://*:5600", "tcp://h9:5557", "[0]"),
         [("pools[0].engines[1].static.replay_endpoint", "port 5557 on h9")]),
        (_static("a", "h1", "tcp://*:0", "tcp://*:0", "[0, 1, 2]"), []),
        # hosts compare as addresses: two spellings of one address, a name in another case
        (_static("a", "10.0.0.5", "tcp://*:5557", None, "[0]")
         + _static("b", "::ffff:10.0.0.5", "tcp://*:5600", "tcp://*:5557", "[0]"),
         [("pools[0].engines[1].static.replay_endpoint", "port 5557 on ::ffff:10.0.0.5")]),
        (_static("a", "::1", "tcp://*:5557", None, "[0]")
         + _static("b", "h2", "tcp://*:5600", "tcp://[0:0:0:0:0:0:0:1]:5557", "[0]"),
         [("pools[0].engines[1].static.replay_endpoint",
           "port 5557 on [0:0:0:0:0:0:0:1]")]),
        (_static("a", "Node-1", "tcp://*:5557", None, "[0]")
         + _static("b", "node-1", "tcp://*:5600", "tcp://*:5557", "[0]"),
         [("pools[0].engines[1].static.replay_endpoint", "port 5557 on node-1")]),
        # a wildcard binds every address of its engine's host: it collides with an explicit
        # address there, however written
        (_static("a", "10.0.0.5", "tcp://*:5557", None, "[0]")
         + _static("b", "10.0.0.5", "tcp://*:5600", "tcp://192.168.0.5:5557", "[0]"),
         [("pools[0].engines[1].static.replay_endpoint", "port 5557 on 192.168.0.5")]),
        (_static("a", "10.0.0.5", "tcp://[0::0]:5557", None, "[0]")
         + _static("b", "10.0.0.5", "tcp://*:5600", "tcp://192.168.0.5:5557", "[0]"),
         [("pools[0].engines[1].static.replay_endpoint", "port 5557 on 192.168.0.5")]),
        # vLLM binds its publisher only for '*' or '::': one given 0.0.0.0 connects instead
        # (its replay socket always binds)
        (_static("a", "h1", "tcp://0.0.0.0:5557", "tcp://0.0.0.0:5657", "[0]"),
         [("pools[0].engines[0].static.endpoint", "binds its publisher only when")]),
        (_static("a", "h1", "tcp://[::]:5557", "tcp://0.0.0.0:5657", "[0]"), []),
        # engines found by DNS are at their records' addresses, not at the default host
        (_static("a", "x", "tcp://*:5557", None, "[0]").replace('host = "x"', 'dns = "a.svc"')
         + _static("b", "x", "tcp://*:5557", None, "[0]").replace('host = "x"', 'dns = "b.svc"'),
         []),
    ],
)
def test_static_port_collisions_are_warnings(
    tmp_path: Path, engines: str, expected: list[tuple[str, str]]
) -> None:
    text = '[relay]\ndc_name = "dc"\n' + STATIC_POOL + engines
    cfg, problems = _check(tmp_path, text)
    assert cfg is not None, problems
    got = [(p.path, p.reason) for p in problems]
    assert [p.severity for p in problems] == ["warning"] * len(expected)
    assert len(got) == len(expected)
    for (path, reason), (want_path, fragment) in zip(got, expected, strict=True):
        assert path == want_path and fragment in reason, got


def test_dc_id_is_suggested_as_dc_name(tmp_path: Path) -> None:
    cfg, problems = _check(tmp_path, MINIMAL.replace("dc_name", "dc_id"))
    errors = _errors(problems)
    assert cfg is None
    assert "did you mean 'dc_name'" in errors["relay.dc_id"]
    assert "Dynamo's dc_id is kvrelay's dc_name" in errors["relay.dc_id"]
    _, problems = _check(tmp_path, MINIMAL, {"KVRELAY_RELAY_DC_ID": "x"})
    assert "did you mean KVRELAY_RELAY_DC_NAME" in _errors(problems)["env.KVRELAY_RELAY_DC_ID"]


def test_dynamo_dc_id_variable_is_the_last_fallback_for_dc_name(tmp_path: Path) -> None:
    no_dc = MINIMAL.replace('dc_name = "dc-test"\n', "")
    cfg, problems = _check(tmp_path, no_dc, {"DYN_DC_ID": "dc-dynamo"})
    assert problems == [] and cfg is not None and cfg.relay.dc_name == "dc-dynamo"
    cfg, _ = _check(tmp_path, MINIMAL, {"DYN_DC_ID": "dc-dynamo"})
    assert cfg is not None and cfg.relay.dc_name == "dc-test"  # the file wins
    env = {"DYN_DC_ID": "dc-dynamo", "KVRELAY_RELAY_DC_NAME": "dc-env"}
    cfg, _ = _check(tmp_path, no_dc, env)
    assert cfg is not None and cfg.relay.dc_name == "dc-env"  # and kvrelay's own variable
    cfg, problems = _check(tmp_path, no_dc, {"DYN_DC_ID": " padded "})
    assert cfg is None and "(set by DYN_DC_ID)" in _errors(problems)["relay.dc_name"]


def test_dynamo_1_7_cluster_id_names(tmp_path: Path) -> None:
    """Dynamo 1.7 renamed --dc-id / DYN_DC_ID to --cluster-id / DYN_CLUSTER_ID: both fall back
    for dc_name (1.7's first), and check-config suggests dc_name for cluster_id."""
    no_dc = MINIMAL.replace('dc_name = "dc-test"\n', "")
    cfg, problems = _check(tmp_path, no_dc, {"DYN_CLUSTER_ID": "dc-17"})
    assert problems == [] and cfg is not None and cfg.relay.dc_name == "dc-17"
    cfg, _ = _check(tmp_path, no_dc, {"DYN_CLUSTER_ID": "dc-17", "DYN_DC_ID": "dc-16"})
    assert cfg is not None and cfg.relay.dc_name == "dc-17"
    cfg, _ = _check(tmp_path, MINIMAL, {"DYN_CLUSTER_ID": "dc-17"})
    assert cfg is not None and cfg.relay.dc_name == "dc-test"  # the file wins
    cfg, problems = _check(tmp_path, no_dc, {"DYN_CLUSTER_ID": " padded "})
    assert cfg is None and "(set by DYN_CLUSTER_ID)" in _errors(problems)["relay.dc_name"]
    _, problems = _check(tmp_path, MINIMAL.replace("dc_name", "cluster_id"))
    errors = _errors(problems)
    assert "did you mean 'dc_name'" in errors["relay.cluster_id"]
    assert "Dynamo's cluster_id is kvrelay's dc_name" in errors["relay.cluster_id"]
    _, problems = _check(tmp_path, MINIMAL, {"KVRELAY_RELAY_CLUSTER_ID": "x"})
    assert "did you mean KVRELAY_RELAY_DC_NAME" in _errors(problems)["env.KVRELAY_RELAY_CLUSTER_ID"]


def test_per_member_metrics_switch(tmp_path: Path) -> None:
    cfg, _ = _check(tmp_path, MINIMAL)
    assert cfg is not None and cfg.metrics.per_member
    cfg, _ = _check(tmp_path, MINIMAL + "\n[metrics]\nper_member = false\n")
    assert cfg is not None and not cfg.metrics.per_member
    cfg, _ = _check(tmp_path, MINIMAL, {"KVRELAY_METRICS_PER_MEMBER": "no"})
    assert cfg is not None and not cfg.metrics.per_member


def test_needs_that_no_configured_pool_meets_warn(tmp_path: Path) -> None:
    """The example's first pool is a decode pool that needs prefill: an aggregated fleet that
    deletes the prefill pool must hear that its model will stay UNAVAILABLE."""
    example = (Path(__file__).resolve().parents[2] / "deploy" / "kvrelay.example.toml").read_text()
    second = example.index("\n[[pools]]\n", example.index("\n[[pools]]\n") + 1)
    decode_only = example[:second]
    assert 'role = "decode"' in decode_only and 'role = "prefill"' not in decode_only
    cfg, problems = _check(tmp_path, decode_only)
    assert cfg is not None
    warnings = {p.path: p.reason for p in problems if p.severity == "warning"}
    assert "pools[0].needs" in warnings, problems
    why = warnings["pools[0].needs"]
    assert "needs prefill in namespace 'dynamo'" in why and "have only decode" in why
    assert "UNAVAILABLE" in why
    # the full example (decode + prefill) and a pool meeting an alternative of a DNF: no warning
    _, problems = _check(tmp_path, example)
    assert not [p for p in problems if p.path.endswith(".needs")]
    dnf = decode_only.replace('needs = [["prefill"]]', 'needs = [["prefill"], ["decode"]]')
    _, problems = _check(tmp_path, dnf)
    assert not [p for p in problems if p.path.endswith(".needs")]


def test_a_mirror_has_its_own_default_metrics_port() -> None:
    """A relay and a mirror of it on one host must not collide on 50162 by default."""
    from kvrelay.ops.config import parse_config

    relay, _ = parse_config({"relay": {"dc_name": "dc"}, "pools": []})
    mirror, problems = parse_config({"mirror": {"upstream": "127.0.0.1:50161"}})
    assert mirror is not None, problems
    assert relay is None or relay.metrics.port == 50162
    assert (mirror.metrics.host, mirror.metrics.port) == ("127.0.0.1", 50172)
    given, _ = parse_config({"mirror": {"upstream": "127.0.0.1:50161"},
                             "metrics": {"bind": "127.0.0.1:9100"}})  # fmt: skip
    assert given is not None and given.metrics.port == 9100


@pytest.mark.parametrize(
    "text,env,expected",
    [
        ("", {}, None),
        ("", {"XDG_RUNTIME_DIR": "/run/user/7"}, "/run/user/7"),
        ("", {"RUNTIME_DIRECTORY": "/run/kvrelay:/run/b", "XDG_RUNTIME_DIR": "/x"}, "/run/kvrelay"),
        ('runtime_dir = "/srv/run"\n', {"RUNTIME_DIRECTORY": "/run/kvrelay"}, "/srv/run"),
        ("", {"KVRELAY_RELAY_RUNTIME_DIR": "/var/run/k", "RUNTIME_DIRECTORY": "/r"}, "/var/run/k"),
    ],
)  # fmt: skip
def test_runtime_dir_from_the_file_systemd_or_xdg(
    tmp_path: Path, text: str, env: dict[str, str], expected: str | None
) -> None:
    f = tmp_path / "k.toml"
    f.write_text(MINIMAL.replace('dc_name = "dc-test"\n', f'dc_name = "dc-test"\n{text}'))
    assert load_config(f, env=env).runtime_dir == expected


# ---- [[authorization]] ---------------------------------------------------------------------------
AUTHZ = """
[[authorization]]
uri = ["spiffe://cluster.local/ns/team-a/*"]
namespaces = ["team-a"]
spacing = true

[[authorization]]
dns = ["router.team-b.svc"]
cn = ["router-b"]
pools = ["team-b/router/*"]
models = ["llama-*"]
"""


def _mtls(tmp_path: Path, client_ca: bool = True) -> str:
    pki = make_pki(tmp_path)
    ca = f'client_ca = "{pki.client_ca}"\n' if client_ca else ""
    return f'\n[tls]\ncert = "{pki.server_cert}"\nkey = "{pki.server_key}"\n{ca}'


def test_authorization_rules_are_read_with_mutual_tls(tmp_path: Path) -> None:
    from kvrelay.service.authz import AuthorizationRule

    cfg, problems = _check(tmp_path, MINIMAL + _mtls(tmp_path) + AUTHZ)
    assert problems == [] and cfg is not None
    assert cfg.authorization == (
        AuthorizationRule(uri=("spiffe://cluster.local/ns/team-a/*",), namespaces=("team-a",),
                          spacing=True),
        AuthorizationRule(dns=("router.team-b.svc",), cn=("router-b",),
                          pools=("team-b/router/*",), models=("llama-*",)),
    )  # fmt: skip
    assert "2 authorization rule(s)" in cfg.summary()
    cfg, _ = _check(tmp_path, MINIMAL + _mtls(tmp_path))
    assert cfg is not None and cfg.authorization is None  # no table: everyone sees everything


@pytest.mark.parametrize(("tls", "path", "fragment"), [
    ("none", "authorization", "need client certificates"),
    ("server-only", "authorization", "need client certificates"),
])  # fmt: skip
def test_authorization_without_client_certificates_is_refused(
    tmp_path: Path, tls: str, path: str, fragment: str
) -> None:
    extra = "" if tls == "none" else _mtls(tmp_path, client_ca=False)
    cfg, problems = _check(tmp_path, MINIMAL + extra + AUTHZ)
    assert cfg is None and fragment in _errors(problems)[path]


@pytest.mark.parametrize(("rule", "path", "fragment"), [
    ('namespaces = ["a"]', "authorization[0]", "names no client"),
    ('uri = ["spiffe://x/*"]', "authorization[0]", "selects no pool"),
    ('cn = ["r"]\npools = ["team-a/router"]', "authorization[0].pools",
     "not namespace/component/endpoint"),
    ('cn = ["r"]\nnamespace = ["a"]', "authorization[0].namespace", "unknown key"),
    ('cn = ["r"]\nnamespaces = ["a"]\nspacing = "yes"', "authorization[0].spacing",
     "a boolean"),
])  # fmt: skip
def test_authorization_rule_errors_name_the_rule(
    tmp_path: Path, rule: str, path: str, fragment: str
) -> None:
    cfg, problems = _check(tmp_path, MINIMAL + _mtls(tmp_path) + f"\n[[authorization]]\n{rule}\n")
    assert cfg is None and fragment in _errors(problems).get(path, ""), _errors(problems)


def test_authorization_is_carried_to_the_fanout_workers(tmp_path: Path) -> None:
    from kvrelay.ops.worker import WorkerSpec, rules_from_json, rules_json

    cfg, problems = _check(tmp_path, _relay("workers = 2") + _mtls(tmp_path) + AUTHZ)
    assert problems == [] and cfg is not None and cfg.authorization is not None
    spec = WorkerSpec(index=1, upstream="unix:/x", host="h", port=1,
                      authorization=rules_json(cfg.authorization))  # fmt: skip
    assert rules_from_json(WorkerSpec.from_json(spec.to_json()).authorization) == (
        cfg.authorization
    )


def test_every_limit_in_error_is_reported_at_once() -> None:
    """docs/operations.md, "Validation": every problem at once. RelayLimits stops at its first
    rule, so two limits under their bounds were reported one per run."""
    from kvrelay.ops.config import parse_config

    limits = {"max_message_bytes": 1024, "publication_queue_bytes": 1024,
              "load_fanout_capacity": 65537, "publication_cpu_percent": 101}  # fmt: skip
    raw: dict[str, Any] = {"relay": {"dc_name": "dc", "limits": limits},
           "pools": [{"namespace": "a", "component": "b", "endpoint": "c",
                      "engines": [{"name": "e", "grpc_port": 1}]}]}  # fmt: skip
    cfg, problems = parse_config(raw, env={})
    assert cfg is None
    assert sorted(_errors(problems)) == sorted(f"relay.limits.{k}" for k in limits)


def test_a_connect_section_in_error_reports_only_its_own_problem() -> None:
    """A pool with [pools.connect] needs no [[pools.engines]]: a bad value in that section
    (here an empty ``allow``) was followed by "a pool needs at least one [[pools.engines]]"."""
    from kvrelay.ops.config import parse_config

    pool = {"namespace": "a", "component": "b", "endpoint": "c", "model": "m",
            "kv_block_size": 16,
            "connect": {"bind": "tcp://127.0.0.1:5557", "topic_pattern": "kv@{engine}",
                        "allow": []}}  # fmt: skip
    cfg, problems = parse_config({"relay": {"dc_name": "dc"}, "pools": [pool]}, env={})
    assert cfg is None
    assert list(_errors(problems)) == ["pools[0].connect.allow"]
    del pool["model"]
    _, problems = parse_config({"relay": {"dc_name": "dc"}, "pools": [pool]}, env={})
    assert sorted(_errors(problems)) == ["pools[0].connect.allow", "pools[0].model"]


def test_declared_adapters_reach_the_pool(tmp_path: Path) -> None:
    cfg, problems = _check(tmp_path, _pool('lora_adapters = ["sql", "chat"]'))
    assert cfg is not None, problems
    assert cfg.relay.pools[0].lora_adapters == ("sql", "chat")
    cfg, _ = _check(tmp_path, _pool('lora_adapters = "sql"'))  # one name as a string
    assert cfg is not None and cfg.relay.pools[0].lora_adapters == ("sql",)
    cfg, problems = _check(tmp_path, _pool("lora_adapters = []"))  # the default, written out
    assert cfg is not None and cfg.relay.pools[0].lora_adapters == (), problems
