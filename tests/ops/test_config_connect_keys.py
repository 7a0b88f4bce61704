"""``[pools.connect] curve_client_keys_file`` (the publishers' CURVE public keys) as the loader and
``kvrelay check-config`` read it, and the warning for a connect bind anyone may publish to.

The oracle for a good file is the keys ``zmq.curve_keypair()`` made; for a bad one, the error
names the key path, the file and the line, so an operator can fix it without guessing."""

from __future__ import annotations

from pathlib import Path

import pytest
import zmq

from kvrelay.cli import main
from kvrelay.ops.config import ConfigProblem, DaemonConfig, check_file
from kvrelay.relay.settings import ConnectConfig

BASE = (
    '[relay]\ndc_name = "dc"\n[[pools]]\nnamespace = "ns"\ncomponent = "c"\nendpoint = "e"\n'
    'model = "m"\nkv_block_size = 16\n[pools.connect]\ntopic_pattern = "kv@{engine}@{model}"\n'
)
KEYS = "pools[0].connect.curve_client_keys_file"


def _check(
    tmp_path: Path, extra: str, bind: str = "tcp://127.0.0.1:5557"
) -> tuple[DaemonConfig | None, list[ConfigProblem]]:
    p = tmp_path / "kvrelay.toml"
    p.write_text(BASE + f'bind = "{bind}"\n' + extra)
    cfg, problems = check_file(p, env={})
    return cfg, [q for q in problems if q.path.startswith("pools[0].connect")]


@pytest.fixture
def secret(tmp_path: Path) -> str:
    f = tmp_path / "server.key"
    f.write_text(zmq.curve_keypair()[1].decode() + "\n")
    return f'curve_secret_key_file = "{f}"\n'


def _loaded(tmp_path: Path, secret: str, body: str) -> ConnectConfig:
    """The connect section a keys file of ``body`` loads into (no problem said)."""
    f = tmp_path / "publishers.keys"
    f.write_text(body)
    cfg, problems = _check(tmp_path, secret + f'curve_client_keys_file = "{f}"\n')
    assert problems == [] and cfg is not None
    connect = cfg.relay.pools[0].connect
    assert connect is not None
    return connect


def test_a_key_file_with_comments_gives_its_keys_in_order(tmp_path: Path, secret: str) -> None:
    """Blank lines and ``#`` lines (a 40-character one too: no Z85 key begins with ``#``) are
    skipped, a comment may follow a key, and a key listed twice is one key."""
    keys = [zmq.curve_keypair()[0].decode() for _ in range(4)]
    connect = _loaded(tmp_path, secret, (
        f"# publishers of pool ns/c/e\n\n{keys[0]}\n  {keys[1]}   # decode-1\n"
        f"#\n{'#' * 40}\n{keys[2]} engine-x\n\t{keys[3]}\n{keys[0]}\n"
    ))  # fmt: skip
    assert connect.curve_client_keys == tuple(keys) and connect.curve_key_engines == ()


def test_engines_after_a_key_bind_them_to_it(tmp_path: Path, secret: str) -> None:
    """``engines=a,b`` after a key names the engines only that key may publish (a line's later
    words stay a comment; a key listed twice adds its engines up); other keys bind none."""
    keys = [zmq.curve_keypair()[0].decode() for _ in range(3)]
    connect = _loaded(tmp_path, secret, (
        f"{keys[0]} engines=pod-a,pod-a2 # the first node\n{keys[1]}\n"
        f"{keys[2]} engines=pod-c\n{keys[0]} engines=pod-a3\n"
    ))  # fmt: skip
    assert connect.curve_client_keys == tuple(keys)
    assert connect.curve_key_engines == (
        (keys[0], ("pod-a", "pod-a2", "pod-a3")), (keys[2], ("pod-c",))
    )  # fmt: skip


@pytest.mark.parametrize(
    ("body", "said"),
    [
        ("{good}\nnot-a-key\n", "line 2: not a Z85 CURVE public key (9 characters, not 40)"),
        ("{good}\n{good}x\n", "line 2: not a Z85 CURVE public key (41 characters, not 40)"),
        ("# ok\n" + "~" * 40 + "\n", "line 2: not a Z85 CURVE public key (not Z85"),
        ("%" * 40 + "\n", "line 1: not a Z85 CURVE public key (not Z85"),  # a group past 2^32
        ("{good} engines=a,,b\n", "line 1: '' is not an engine name"),
        ("{good} engines=\n", "line 1: '' is not an engine name"),
        ("# only comments\n\n", "lists no key"),
        ("", "lists no key"),
    ],
)
def test_a_bad_key_file_is_refused_naming_the_file_and_line(
    tmp_path: Path, secret: str, body: str, said: str
) -> None:
    f = tmp_path / "publishers.keys"
    f.write_text(body.format(good=zmq.curve_keypair()[0].decode()))
    cfg, problems = _check(tmp_path, secret + f'curve_client_keys_file = "{f}"\n')
    assert cfg is None
    (p,) = problems
    assert (p.path, p.severity) == (KEYS, "error")
    assert repr(str(f)) in p.reason and said in p.reason, p.reason


def test_a_missing_key_file_or_one_without_a_secret_key_is_refused(
    tmp_path: Path, secret: str
) -> None:
    cfg, problems = _check(tmp_path, secret + f'curve_client_keys_file = "{tmp_path}/none"\n')
    assert cfg is None and [(p.path, p.reason[:12]) for p in problems] == [(KEYS, "cannot read ")]
    f = tmp_path / "publishers.keys"
    f.write_text(zmq.curve_keypair()[0].decode() + "\n")
    cfg, problems = _check(tmp_path, f'curve_client_keys_file = "{f}"\n')
    assert cfg is None
    assert [(p.path, p.severity) for p in problems] == [(KEYS, "error")]
    assert "needs curve_secret_key_file" in problems[0].reason


def test_a_secret_key_file_that_is_not_z85_is_an_error_not_a_traceback(tmp_path: Path) -> None:
    """pyzmq's decoder raises ``struct.error`` for a group past 2^32 (it escaped the check)."""
    f = tmp_path / "server.key"
    f.write_text("%" * 40 + "\n")
    cfg, problems = _check(tmp_path, f'curve_secret_key_file = "{f}"\n')
    assert cfg is None
    assert [(p.path, p.severity) for p in problems] == [
        ("pools[0].connect.curve_secret_key_file", "error")
    ]


@pytest.mark.parametrize(
    ("bind", "guard", "warned"),
    [
        ("tcp://0.0.0.0:5557", "", True),
        ("tcp://*:5557", "", True),
        ("tcp://[::]:5557", "", True),
        ("tcp://10.1.2.3:5557", "secret", True),  # CURVE alone admits anyone with a keypair
        ("tcp://0.0.0.0:5557", "allow", False),
        ("tcp://0.0.0.0:5557", "keys", False),
        ("tcp://127.0.0.1:5557", "", False),
        ("tcp://[::1]:5557", "", False),
        ("ipc:///run/kvrelay/kv.sock", "", False),
    ],
)
def test_an_open_connect_bind_off_loopback_is_warned_about(
    tmp_path: Path, secret: str, bind: str, guard: str, warned: bool
) -> None:
    f = tmp_path / "publishers.keys"
    f.write_text(zmq.curve_keypair()[0].decode() + "\n")
    extra = {
        "": "", "secret": secret, "allow": 'allow = ["10.0.0.0/24"]\n',
        "keys": secret + f'curve_client_keys_file = "{f}"\n',
    }[guard]  # fmt: skip
    cfg, problems = _check(tmp_path, extra, bind)
    assert cfg is not None
    got = [(p.path, p.severity) for p in problems]
    assert got == ([("pools[0].connect.bind", "warning")] if warned else [])
    if warned:
        assert f"non-loopback address {bind} admits any publisher" in problems[0].reason


def test_check_config_prints_the_key_file_problems(
    tmp_path: Path, secret: str, capsys: pytest.CaptureFixture[str]
) -> None:
    good = zmq.curve_keypair()[0].decode()
    f = tmp_path / "publishers.keys"
    f.write_text(f"{good}\n{good[:-1]}\n")
    p = tmp_path / "kvrelay.toml"
    p.write_text(BASE + 'bind = "tcp://0.0.0.0:5557"\n' + secret
                 + f'curve_client_keys_file = "{f}"\n')  # fmt: skip
    assert main(["check-config", str(p)]) == 2
    out = capsys.readouterr().out
    assert f"error: {KEYS}: {str(f)!r} line 2: not a Z85 CURVE public key" in out
    f.write_text(f"{good}\n")
    assert main(["check-config", str(p)]) == 0
    out = capsys.readouterr().out
    assert "warning: pools[0].connect.bind" not in out and ": ok: " in out
