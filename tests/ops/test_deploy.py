"""The systemd units and the example config in ``deploy/``.

With ``systemd-analyze`` on the machine the units are verified by systemd itself (unknown keys and
unparsable values only produce warnings there, so warnings fail the test too) and scored with
``systemd-analyze security --offline``. Without it, a small INI reader checks every directive
against the set systemd accepts for these sections. The required-directive checks run always.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvrelay.ops import config as cfgmod
from kvrelay.ops.files import ASSETS, asset_text

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
UNITS = ("kvrelay.service", "kvrelay@.service")
VENV_KVRELAY = "/opt/kvrelay/venv/bin/kvrelay"
Unit = dict[str, dict[str, list[str]]]

REQUIRED_SERVICE = {
    "Type": "notify",
    "WatchdogSec": "30",
    "Restart": "on-failure",
    "DynamicUser": "yes",
    "ProtectSystem": "strict",
    "ProtectHome": "yes",
    "NoNewPrivileges": "yes",
    "PrivateTmp": "yes",
    "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6",
    "KillSignal": "SIGTERM",
}
# Directives these units may use (fallback check when systemd-analyze is absent).
KNOWN = {
    "Unit": {"Description", "Documentation", "Wants", "After", "Requires", "Before",
             "StartLimitIntervalSec", "StartLimitBurst", "PartOf"},
    "Service": {
        "Type", "NotifyAccess", "ExecStartPre", "ExecStart", "ExecReload", "Restart", "RestartSec",
        "WatchdogSec", "TimeoutStartSec", "TimeoutStopSec", "KillSignal", "KillMode",
        "OOMPolicy", "LimitNOFILE", "CacheDirectory", "CacheDirectoryMode", "StateDirectory",
        "StateDirectoryMode", "RuntimeDirectory", "RuntimeDirectoryMode", "ConfigurationDirectory",
        "ConfigurationDirectoryMode", "Environment", "SyslogIdentifier", "DynamicUser",
        "NoNewPrivileges", "ProtectSystem", "ProtectHome", "PrivateTmp", "PrivateDevices",
        "ProtectKernelTunables", "ProtectKernelModules", "ProtectKernelLogs",
        "ProtectControlGroups", "ProtectClock", "ProtectHostname", "ProtectProc",
        "RestrictAddressFamilies", "RestrictNamespaces", "RestrictRealtime", "RestrictSUIDSGID",
        "LockPersonality", "SystemCallArchitectures", "SystemCallFilter",
        "SystemCallErrorNumber", "CapabilityBoundingSet", "AmbientCapabilities", "UMask",
    },
    "Install": {"WantedBy", "Alias", "Also"},
}


def parse_unit(text: str) -> Unit:
    """Minimal systemd INI reader: sections, repeated keys kept in order, comments, `\\` joins."""
    out: Unit = {}
    section: str | None = None
    pending = ""
    for n, raw in enumerate(text.splitlines(), 1):
        line = pending + raw.strip()
        pending = ""
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            out.setdefault(section, {})
            continue
        if section is None or "=" not in line:
            raise ValueError(f"line {n}: not a key=value inside a section: {raw!r}")
        key, value = (p.strip() for p in line.split("=", 1))
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9]*", key):
            raise ValueError(f"line {n}: bad key {key!r}")
        out[section].setdefault(key, []).append(value)
    return out


def _unit(name: str, where: Path = DEPLOY) -> Unit:
    return parse_unit((where / name).read_text())


def _one(unit: Unit, key: str) -> str:
    values = unit["Service"][key]
    assert len(values) == 1, f"{key} set more than once"
    return values[0]


@pytest.mark.parametrize("name", UNITS)
def test_unit_has_required_directives(name: str) -> None:
    unit = _unit(name)
    assert set(unit) == {"Unit", "Service", "Install"}
    for key, expected in REQUIRED_SERVICE.items():
        assert _one(unit, key) == expected, key
    assert int(_one(unit, "LimitNOFILE")) >= 65536
    stop = _one(unit, "TimeoutStopSec").removesuffix("s")
    # must exceed the daemon's default shutdown_timeout_s, or systemd kills a clean shutdown
    assert float(stop) > cfgmod.DaemonConfig.__dataclass_fields__["shutdown_timeout_s"].default
    env = unit["Service"]["Environment"]
    cache = _one(unit, "CacheDirectory")
    assert f"NUMBA_CACHE_DIR=%C/{cache}" in env, "numba cache must be the unit's CacheDirectory"
    assert "MemoryDenyWriteExecute" not in unit["Service"], "numba's JIT needs W+X pages"
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]
    exec_start = _one(unit, "ExecStart").split()
    # the venv of deploy/README.md's install section (not PATH: distributions refuse system pip)
    assert exec_start[:2] == [VENV_KVRELAY, "serve"]
    assert exec_start[2] == "--config"
    if "@" in name:
        assert exec_start[3] == "/etc/kvrelay/%i.toml"
        assert cache == "kvrelay/%i"
        assert _one(unit, "StateDirectory") == "kvrelay/%i"  # one state per shard
    else:
        assert exec_start[3] == "/etc/kvrelay/kvrelay.toml"
        assert cache == "kvrelay"
    assert _one(unit, "ExecStartPre") == f"{VENV_KVRELAY} check-config {exec_start[3]}"
    # systemctl reload validates the same file, then signals the main process
    assert _one(unit, "ExecReload") == (
        f"{VENV_KVRELAY} reload --config {exec_start[3]} --pid $MAINPID"
    )
    readme = (DEPLOY / "README.md").read_text()
    assert f"python3 -m venv {VENV_KVRELAY.removesuffix('/bin/kvrelay')}" in readme


def test_template_differs_from_the_plain_unit_only_in_instance_bits() -> None:
    plain, tmpl = _unit("kvrelay.service"), _unit("kvrelay@.service")
    differing = {
        k for k in set(plain["Service"]) | set(tmpl["Service"])
        if plain["Service"].get(k) != tmpl["Service"].get(k)
    }
    assert differing == {"ExecStartPre", "ExecStart", "ExecReload", "CacheDirectory",
                         "StateDirectory", "RuntimeDirectory", "Environment", "SyslogIdentifier"}


def _verify_with_systemd(src: Path, tmp_path: Path) -> list[str]:
    """Run `systemd-analyze verify` on copies (the template through an instance name).

    verify insists that ExecStart's program exists: the copies point at this test run's own
    `kvrelay` script instead of /opt/kvrelay/venv (the path itself is checked above)."""
    here = str(Path(sys.executable).parent / "kvrelay")
    for name in UNITS:
        (tmp_path / name).write_text((src / name).read_text().replace(VENV_KVRELAY, here))
    (tmp_path / "kvrelay@shard0.service").symlink_to(tmp_path / "kvrelay@.service")
    targets = [tmp_path / "kvrelay.service", tmp_path / "kvrelay@shard0.service"]
    res = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", *map(str, targets)],
        capture_output=True, text=True, timeout=120,
    )
    assert res.returncode == 0, res.stderr
    # unknown keys / bad values are only warnings for systemd: treat any mention of our units
    # as a failure
    return [ln for ln in res.stderr.splitlines() if "kvrelay" in ln]


def _verify_with_parser(src: Path) -> list[str]:
    problems = []
    for name in UNITS:
        unit = _unit(name, src)
        for section, keys in unit.items():
            for key in keys:
                if key not in KNOWN.get(section, set()):
                    problems.append(f"{name}: unknown directive [{section}] {key}")
    return problems


def test_units_verify(tmp_path: Path) -> None:
    assert _verify_with_parser(DEPLOY) == []
    if shutil.which("systemd-analyze"):
        assert _verify_with_systemd(DEPLOY, tmp_path) == []


def test_checkers_catch_a_misspelt_directive(tmp_path: Path) -> None:
    """Neither checker is vacuous: a misspelt directive is reported by both."""
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in UNITS:
        text = (DEPLOY / name).read_text().replace("WatchdogSec=30", "WatchDogSec=30")
        (bad / name).write_text(text)
    assert len(_verify_with_parser(bad)) == 2
    with pytest.raises(ValueError):
        parse_unit("[Service]\nthis is not a directive\n")
    if shutil.which("systemd-analyze"):
        work = tmp_path / "work"
        work.mkdir()
        problems = _verify_with_systemd(bad, work)
        assert any("WatchDogSec" in p for p in problems), problems


def test_sandbox_exposure(tmp_path: Path) -> None:
    if shutil.which("systemd-analyze"):
        shutil.copy(DEPLOY / "kvrelay.service", tmp_path / "kvrelay.service")
        res = subprocess.run(
            ["systemd-analyze", "security", "--offline=yes", str(tmp_path / "kvrelay.service")],
            capture_output=True, text=True, timeout=120,
        )
        m = re.search(r"Overall exposure level for kvrelay\.service: ([0-9.]+)", res.stdout)
        assert m is not None, res.stdout + res.stderr
        assert float(m.group(1)) <= 2.5  # "OK" band; MemoryDenyWriteExecute is off for numba
    else:
        service = _unit("kvrelay.service")["Service"]
        for key in ("PrivateDevices", "ProtectKernelTunables", "ProtectKernelModules",
                    "RestrictNamespaces", "LockPersonality", "RestrictSUIDSGID"):
            assert service[key] == ["yes"], key
        assert service["CapabilityBoundingSet"] == [""]


# ---- example config ------------------------------------------------------------------------------


def test_example_config_is_valid_and_builds() -> None:
    cfg, problems = cfgmod.check_file(DEPLOY / "kvrelay.example.toml", env={})
    assert problems == []
    assert cfg is not None
    assert [p.triple for p in cfg.relay.pools] == [
        ("dynamo", "backend", "generate"), ("dynamo", "prefill", "generate"),
    ]
    static = cfg.relay.pools[1].engines[0].static
    assert static is not None and static.dp_ranks == (0, 1)
    assert cfg.metrics.enabled and (cfg.metrics.host, cfg.metrics.port) == ("127.0.0.1", 50162)
    assert not cfg.tls.enabled


def test_example_config_documents_every_key() -> None:
    """Every schema key appears (set or commented out) with a comment block for each section."""
    text = (DEPLOY / "kvrelay.example.toml").read_text()
    present = set(re.findall(r"^#?\s*([a-z_]+)\s*=", text, flags=re.M))
    schemas = {
        "relay": cfgmod.RELAY_KEYS, "relay.limits": cfgmod.LIMITS_KEYS,
        "pools": cfgmod.POOL_KEYS, "pools.engines": cfgmod.ENGINE_KEYS,
        "pools.engines.static": cfgmod.STATIC_KEYS, "pools.connect": cfgmod.CONNECT_KEYS,
        "logging": cfgmod.LOGGING_KEYS,
        "metrics": cfgmod.METRICS_KEYS, "tls": cfgmod.TLS_KEYS,
    }
    for section, schema in schemas.items():
        missing = set(schema) - present
        assert not missing, f"[{section}] keys not in the example: {sorted(missing)}"
    for header in ("[relay]", "[relay.limits]", "[[pools]]", "[[pools.engines]]",
                   "[pools.engines.static]", "[pools.connect]", "[logging]", "[metrics]",
                   "[tls]"):
        i = text.index(header)
        before = text[:i].rstrip().splitlines()[-1]
        assert before.startswith("#"), f"{header} has no comment right above it"


@pytest.mark.parametrize("name", ASSETS)
def test_deploy_copies_equal_the_packaged_assets(name: str) -> None:
    """`kvrelay example-config` / `systemd-unit` print the packaged files; deploy/ must match."""
    assert (DEPLOY / name).read_text() == asset_text(name)


def test_deploy_readme_exists_and_mentions_units() -> None:
    readme = (DEPLOY / "README.md").read_text()
    for needle in ("kvrelay.service", "kvrelay@.service", "kvrelay.example.toml",
                   "check-config", "NUMBA_CACHE_DIR", "LoadCredential"):
        assert needle in readme, needle
    assert not (DEPLOY / ".gitkeep").exists()


def test_units_give_workers_a_private_runtime_directory() -> None:
    """``workers >= 2`` needs a writable directory for its internal socket; under the sandbox
    (``ProtectSystem=strict``) only the unit's own directories are writable."""
    for name, expect in (("kvrelay.service", "kvrelay"), ("kvrelay@.service", "kvrelay/%i")):
        unit = _unit(name)
        assert unit["Service"]["RuntimeDirectory"] == [expect], name
        assert unit["Service"]["RuntimeDirectoryMode"] == ["0700"], name


@pytest.mark.parametrize("name", UNITS)
def test_units_leave_the_daemons_own_processes_to_the_daemon(name: str) -> None:
    """The main process supervises processes of its own in the unit's control group (fan-out
    workers, kernel warm-up workers, a scrub's forked child, a hot upgrade's new process):

    * ``NotifyAccess=all``: a hot upgrade's new process notifies before it is the main PID, and
      the old one hands it over with ``MAINPID=`` (``main`` would drop both);
    * ``KillMode=mixed``: SIGTERM reaches the main process alone, which drains its workers
      within ``shutdown_timeout_s``; only what is left after it gets SIGKILL;
    * ``OOMPolicy=continue``: a worker the kernel's OOM killer takes is restarted by the
      daemon (docs/fault-matrix.md), a failed upgrade leaves the old process serving; systemd's
      default, ``DefaultOOMPolicy=stop``, would stop the whole relay for either. The main
      process killed still ends the unit, and ``Restart=on-failure`` starts it again.
    """
    unit = _unit(name)
    assert _one(unit, "NotifyAccess") == "all"
    assert _one(unit, "KillMode") == "mixed"
    assert _one(unit, "OOMPolicy") == "continue"
    assert _one(unit, "Restart") == "on-failure"
