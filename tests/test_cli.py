"""CLI surface: help text, version, exit codes, delegation to ``kvrelay sim``, the demo."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvrelay import __version__
from kvrelay.cli import build_parser, main
from kvrelay.ops import early_signals
from tests.support.commands import MINIMAL, kvrelay, sigint_as_at_a_shell
from tests.support.timing import scaled


def test_help_lists_commands_examples_and_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for word in ("serve", "check-config", "sim", "demo", "examples:", "exit codes:"):
        assert word in out, word
    assert "2  usage or configuration error" in out and "KVRELAY_<SECTION>_<KEY>" in out


@pytest.mark.parametrize("command", ["serve", "check-config", "demo"])
def test_subcommand_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert f"usage: kvrelay {command}" in out and "example" in out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith(f"kvrelay {__version__} ")


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["bogus"],
        ["serve", "--bogus"],
        ["demo", "--bind", "nowhere"],
        ["demo", "--duration", "0"],
        ["check-config"],
    ],
)
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2


@pytest.mark.parametrize(
    ("argv", "usage"),
    [
        (["serve", "--confg", "x.toml"], "usage: kvrelay serve "),
        (["watch", "catalog", "--bogus"], "usage: kvrelay watch "),
        (["check-config", "a.toml", "--bogus"], "usage: kvrelay check-config "),
    ],
)
def test_a_subcommands_unknown_option_shows_that_subcommands_usage(
    argv: list[str], usage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """argparse handed a subcommand's unknown options to the top-level parser, which printed
    ``kvrelay [-h] [--version] COMMAND ...``: the subcommand's options were not shown."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(usage) and "unrecognized arguments" in err, err


def test_serve_without_config_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("KVRELAY_CONFIG", raising=False)
    kept = {sig: signal.getsignal(sig) for sig in (*early_signals.KEPT, signal.SIGTERM)}
    try:
        assert main(["serve"]) == 2
    finally:  # a daemon command takes these from its first line (``ops/early_signals.py``)
        for sig, handler in kept.items():
            signal.signal(sig, handler)
    assert "--config FILE is required" in capsys.readouterr().err


def test_sim_is_delegated(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:  # the sim parser's own --help
        main(["sim", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "usage: kvrelay sim" in out and "--dp-size" in out
    assert main(["sim", "--engines", "0"]) == 2


def test_serve_refuses_invalid_config_with_the_check_config_problems(tmp_path: Path) -> None:
    f = tmp_path / "bad.toml"
    f.write_text(MINIMAL.replace('dc_name = "dc-test"', 'dc_name = ""').replace("50051", "0"))
    served = kvrelay("serve", "--config", str(f))
    checked = kvrelay("check-config", str(f))
    assert served.returncode == 2 and checked.returncode == 2
    problems = [line for line in checked.stdout.splitlines() if line.startswith("error: ")]
    assert problems == [
        "error: relay.dc_name: must be non-empty without surrounding whitespace",
        "error: pools[0].engines[0].grpc_port: must be in 1..65535, got 0",
    ]
    for line in problems:
        assert line in served.stderr
    assert "refusing to start" in served.stderr


def test_demo_headless_runs_and_reports(tmp_path: Path) -> None:
    # five seconds of traffic on a quiet machine is enough for every pool's snapshot, deltas and
    # READY; a busy one needs proportionally longer to get there (the report is taken at the
    # end). Below 15 s: a longer demo puts the prefill engine to sleep mid-run.
    duration = f"{min(scaled(5.0), 14.0):.1f}"
    run = kvrelay("demo", "--headless", "--duration", duration, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["deltas_total"] > 0 and summary["consumer_errors"] == {}, summary
    hit = summary["hit_query"]  # the query the demo prints: its tokens are held
    assert hit["command"].startswith("kvrelay query --relay 127.0.0.1:"), hit
    assert "--model demo-llama-8b --tokens " in hit["command"]
    assert hit["depth_blocks"] == 1, hit
    pools = {p["pool"]: p for p in summary["pools"]}
    assert set(pools) == {
        "demo/backend/generate", "demo-pd/prefill/generate", "demo-pd/decode/generate",
    }
    for p in pools.values():
        assert p["subscribers"] == 1 and p["snapshots"] >= 1 and p["deltas"] > 0, p
        assert 0 < p["fingerprints"] <= p["capacity"]
        assert p["latency_p50_ms"] is not None and p["latency_p50_ms"] <= p["latency_p99_ms"]
    assert "demo-sql-lora (lora)" in pools["demo/backend/generate"]["registrations"]
    assert pools["demo-pd/decode/generate"]["roles"] == ["DECODE"]
    models = {(m["namespace"], m["model"]): m for m in summary["models"]}
    assert summary["ready_models"] >= 1, summary
    agg = models[("demo", "demo-llama-8b")]
    assert agg["state"] == "READY" and agg["adapters"] == {"demo-sql-lora": "READY"}, summary
    assert models[("demo-pd", "demo-qwen-7b")]["state"] == "READY", summary


def test_demo_exits_1_when_its_port_is_taken() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        run = kvrelay("demo", "--headless", "--duration", "1", "--bind", f"127.0.0.1:{port}")
    assert run.returncode == 1 and "kvrelay demo:" in run.stderr, run.stderr[-2000:]


def test_example_config_and_units_are_printed_from_the_package(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A pip user has them without the repository; they are the files deploy/ documents."""
    deploy = Path(__file__).resolve().parents[1] / "deploy"
    for argv, name in (
        (["example-config"], "kvrelay.example.toml"),
        (["systemd-unit"], "kvrelay.service"),
        (["systemd-unit", "--template"], "kvrelay@.service"),
    ):
        assert main(argv) == 0
        assert capsys.readouterr().out == (deploy / name).read_text(), argv


def test_help_imports_nothing_heavy() -> None:
    """`kvrelay --help` stays instant: no numba, numpy, grpclib, zmq or SDK import behind it."""
    probe = (
        "import sys, contextlib, io\n"
        "from kvrelay.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert main(['--help']) == 0\n"
        "heavy = ('numba', 'numpy', 'grpclib', 'zmq', 'kvrelay.client', 'kvrelay._proto')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy or m in heavy))\n"
    )
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


def test_client_commands_are_delegated_with_kvrelay_as_prog(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["watch", "--help"]) == 0
    out = capsys.readouterr().out
    assert "usage: kvrelay watch" in out and "KVRELAY_RELAY" in out and "--cert" in out
    assert main(["query", "--model", "m"]) == 2  # neither --tokens nor --tokens-file


def test_warm_prints_progress_and_exits_0() -> None:
    """The session already compiled the kernels into the default cache: this loads them."""
    res = kvrelay("warm", timeout=300)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith("kvrelay warm: numba kernel cache: ")
    for step in ("hashing", "ingest", "pool"):  # one line when a step starts, one when done
        assert sum(line.startswith(f"  {step}: ") for line in lines) == 2, lines
    assert any(line.startswith("  pool: apply, cuckoo filter") for line in lines), lines
    assert lines[-1].startswith("kvrelay warm: every kernel ready in ")


def test_the_demo_view_clears_what_a_shorter_line_leaves() -> None:
    from kvrelay.demo.view import CLEAR_DOWN, CLEAR_LINE, HOME, redraw

    frame = redraw("a long first line\nshort")
    assert frame == f"{HOME}a long first line{CLEAR_LINE}\nshort{CLEAR_LINE}\n{CLEAR_DOWN}"


def test_warm_progress_lines_are_never_glued_together() -> None:
    """Progress comes from the workers' reader threads and the warming thread at once; a caller
    that writes the text and then its newline (print) gets whole lines only."""
    import io
    import threading
    import time

    from kvrelay.ops.warmup import WarmEvent, serialized

    out = io.StringIO()

    def printer(ev: WarmEvent) -> None:  # what print() does: the text, then the newline
        out.write(ev.text)
        time.sleep(0.001)
        out.write("\n")

    report = serialized(printer)
    assert report is not None

    def worker(i: int) -> None:
        for j in range(20):
            report(WarmEvent("pool", "compiling", f"t{i}-{j}"))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines = out.getvalue().splitlines()
    assert sorted(lines) == sorted(f"t{i}-{j}" for i in range(4) for j in range(20))


#: A stand-in relay, run as ``python DIR/kvrelay serve ...`` (what a console script's command
#: line is, so ``reload`` and ``upgrade`` take it for a kvrelay daemon). Writes its pid into its
#: ``--pid-file`` once its handlers are set, notes each SIGHUP in ``DIR/sighup``, and on SIGUSR2
#: (``$STAND_IN``): ``note``s it in ``DIR/usr2``, ``exit``s (a relay killed mid-upgrade, no
#: successor), or ``hand-over``: starts itself again, which writes its own pid, then exits.
STAND_IN = r"""
import os, pathlib, signal, subprocess, sys, time
here = pathlib.Path(sys.argv[0]).parent
args = sys.argv[1:]
pid_file = args[args.index("--pid-file") + 1] if "--pid-file" in args else None
mode = os.environ.get("STAND_IN", "note")
if mode == "listen":  # a metrics endpoint that takes connections and never answers them
    import socket
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", int(os.environ["STAND_IN_PORT"])))
    sock.listen(16)

def write_pid():
    tmp = pathlib.Path(pid_file + ".tmp")
    tmp.write_text(f"{os.getpid()}\n")
    tmp.rename(pid_file)

def usr2(*_):
    if mode == "exit":
        os._exit(0)
    if mode == "hand-over":
        new = subprocess.Popen([sys.executable, *sys.orig_argv[1:]],
                               env={**os.environ, "STAND_IN": "note"})
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if pathlib.Path(pid_file).read_text().strip() == str(new.pid):
                os._exit(0)
            time.sleep(0.02)
        os._exit(3)
    (here / "usr2").touch()

signal.signal(signal.SIGUSR2, usr2)
signal.signal(signal.SIGHUP, lambda *_: (here / "sighup").touch())
if pid_file is not None:
    write_pid()
(here / f"ready-{os.getpid()}").touch()
time.sleep(120)
"""


def _stand_in(tmp_path: Path, *args: str, mode: str = "note", cwd: Path | None = None,
              env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start the stand-in relay (``STAND_IN``) and wait until its handlers are set."""
    script = tmp_path / "kvrelay"
    script.write_text(STAND_IN)
    proc = subprocess.Popen([sys.executable, str(script), *args], cwd=cwd,
                            env={**os.environ, **(env or {}), "STAND_IN": mode})  # fmt: skip
    _wait_for(tmp_path / f"ready-{proc.pid}")
    return proc


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + scaled(60)
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert path.exists(), path


def _end(*procs: subprocess.Popen[bytes], pids: tuple[int, ...] = ()) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_ctrl_c_while_upgrade_waits_exits_130_without_a_traceback(tmp_path: Path) -> None:
    """A stand-in relay that only notes its SIGUSR2: ``kvrelay upgrade`` then waits for it to
    hand over, and Ctrl-C there is an interruption (130), not a KeyboardInterrupt traceback."""
    relay = _stand_in(tmp_path, "serve")
    try:
        upgrade = subprocess.Popen(
            [sys.executable, "-m", "kvrelay", "upgrade", "--pid", str(relay.pid), "--timeout",
             "120"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            preexec_fn=sigint_as_at_a_shell,
        )  # fmt: skip
        _wait_for(tmp_path / "usr2")  # signalled: kvrelay upgrade is in its waiting loop now
        upgrade.send_signal(signal.SIGINT)
        _, err = upgrade.communicate(timeout=scaled(60))
    finally:
        _end(relay)
    assert upgrade.returncode == 130 and "Traceback" not in err, (upgrade.returncode, err)


@pytest.mark.parametrize("command", ["upgrade", "reload"])
def test_a_pid_that_is_not_a_kvrelay_daemon_is_not_signalled(
    tmp_path: Path, command: str
) -> None:
    """A pid file naming another process (its pid given to a ``sleep`` since): SIGUSR2 or
    SIGHUP used to kill it, and the tool said "handed over" or "SIGHUP sent" (exit 0). Refused
    now, exit 2, the process untouched; a ``kvrelay`` that is no daemon alike."""
    cfg = tmp_path / "kvrelay.toml"
    cfg.write_text(MINIMAL + "[metrics]\nenabled = false\n")
    sleeper = subprocess.Popen(["sleep", "300"])
    pid_file = tmp_path / "foreign.pid"
    pid_file.write_text(f"{sleeper.pid}\n")
    extra = ["--config", str(cfg)] if command == "reload" else []
    try:
        run = kvrelay(command, "--pid-file", str(pid_file), "--timeout", "10", *extra)
        assert run.returncode == 2, (run.stdout, run.stderr)
        assert f"process {sleeper.pid} is not kvrelay: sleep 300" in run.stderr, run.stderr
        assert "refusing to signal it" in run.stderr
        time.sleep(0.2)
        assert sleeper.poll() is None, "the foreign process was signalled"
        gone = kvrelay(command, "--pid", "999999999", *extra)  # no such process: nothing sent
        assert gone.returncode == 1 and "no process 999999999" in gone.stderr, gone.stderr
    finally:
        _end(sleeper)
    watcher = _stand_in(tmp_path, "watch", "catalog")  # kvrelay, but not a daemon
    try:
        run = kvrelay(command, "--pid", str(watcher.pid), "--timeout", "10", *extra)
        assert run.returncode == 2 and "not a kvrelay daemon (serve or mirror)" in run.stderr
        assert not (tmp_path / "usr2").exists() and not (tmp_path / "sighup").exists()
    finally:
        _end(watcher)


def test_upgrade_reports_a_relay_that_exits_without_a_hand_over(tmp_path: Path) -> None:
    """The relay exits on its SIGUSR2 and nothing takes over (killed mid-upgrade): its pid file
    still names it. ``kvrelay upgrade`` used to print "handed over to pid <that dead pid>" and
    exit 0 while nothing served."""
    pid_file = tmp_path / "kvrelay.pid"
    relay = _stand_in(tmp_path, "serve", "--pid-file", str(pid_file), mode="exit")
    try:
        run = kvrelay("upgrade", "--pid-file", str(pid_file), "--timeout", "30")
    finally:
        _end(relay)
    assert run.returncode == 1, (run.stdout, run.stderr)
    assert "handed over" not in run.stdout, run.stdout
    assert (f"the relay exited without a hand-over: process {relay.pid} is gone and its pid "
            f"file {pid_file} names the old process still") in run.stderr, run.stderr  # fmt: skip


def test_upgrade_names_the_process_that_took_over_from_the_relays_own_pid_file(
    tmp_path: Path,
) -> None:
    """``--pid`` alone: the pid file the new process rewrites is the one the relay's command
    line names, and the hand-over is reported only once it names a new, live kvrelay."""
    pid_file = tmp_path / "kvrelay.pid"
    relay = _stand_in(tmp_path, "serve", "--pid-file", "kvrelay.pid", mode="hand-over",
                      cwd=tmp_path)  # fmt: skip
    new: int | None = None
    try:
        run = kvrelay("upgrade", "--pid", str(relay.pid), "--timeout", "60")
        new = int(pid_file.read_text())
        assert new != relay.pid
        assert run.returncode == 0, (run.stdout, run.stderr)
        assert run.stdout.strip() == f"kvrelay upgrade: handed over to pid {new}", run.stdout
    finally:
        _end(relay, pids=() if new is None else (new,))


def test_reload_refuses_a_file_the_relay_does_not_read(tmp_path: Path) -> None:
    """A SIGHUP makes the relay read its own ``--config`` again: checking another file said
    nothing of what it applies, yet ``kvrelay reload`` reported success. Refused (exit 2,
    nothing signalled); the relay's own file, however it is spelled, is signalled."""
    (tmp_path / "etc").mkdir()
    own = tmp_path / "etc" / "kvrelay.toml"
    own.write_text(MINIMAL + "[metrics]\nenabled = false\n")
    other = tmp_path / "other.toml"
    other.write_text(own.read_text())
    relay = _stand_in(tmp_path, "serve", "--config", "etc/kvrelay.toml", cwd=tmp_path)
    try:
        run = kvrelay("reload", "--config", str(other), "--pid", str(relay.pid))
        assert run.returncode == 2, (run.stdout, run.stderr)
        assert (f"{other} is not the file process {relay.pid} reads ({own})") in run.stderr
        assert "it was not signalled" in run.stderr
        time.sleep(0.2)
        assert not (tmp_path / "sighup").exists()
        link = tmp_path / "link.toml"
        link.symlink_to(own)  # the same file by another name (relative in the relay: its cwd)
        run = kvrelay("reload", "--config", str(link), "--pid", str(relay.pid))
        assert run.returncode == 0, (run.stdout, run.stderr)
        assert "outcome is in its log" in run.stdout  # metrics disabled: nothing to read
        _wait_for(tmp_path / "sighup")
    finally:
        _end(relay)
    started_bare = _stand_in(tmp_path, "mirror", "--upstream", "127.0.0.1:1")
    try:  # a mirror without --config has no file to read again
        run = kvrelay("reload", "--config", str(own), "--pid", str(started_bare.pid))
        assert run.returncode == 2 and "without a configuration file" in run.stderr, run.stderr
    finally:
        _end(started_bare)


def test_reload_does_not_signal_a_relay_whose_metrics_endpoint_does_not_answer(
    tmp_path: Path,
) -> None:
    """The metrics endpoint takes the connection and never answers (a relay stopped with
    SIGSTOP, a wedged loop): the tool used to take that for "not readable", send the SIGHUP and
    exit 0 "the outcome is in its log". Exit 1 now, nothing signalled; a port nobody listens on
    (the endpoint moved, or off) is still sent the signal with that message (exit 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = tmp_path / "kvrelay.toml"
    cfg.write_text(MINIMAL + f'[metrics]\nbind = "127.0.0.1:{port}"\n')
    relay = _stand_in(tmp_path, "serve", "--config", str(cfg), mode="listen",
                      env={"STAND_IN_PORT": str(port)})  # fmt: skip
    try:
        t0 = time.monotonic()
        run = kvrelay("reload", "--config", str(cfg), "--pid", str(relay.pid), "--timeout", "1")
        assert run.returncode == 1, (run.stdout, run.stderr)
        assert (f"the relay's metrics endpoint (127.0.0.1:{port}) accepted the connection but "
                "did not answer within 1 s") in run.stderr, run.stderr  # fmt: skip
        assert f"process {relay.pid} was not signalled" in run.stderr
        assert time.monotonic() - t0 < scaled(30)
        time.sleep(0.2)
        assert not (tmp_path / "sighup").exists()
    finally:
        _end(relay)
    relay = _stand_in(tmp_path, "serve", "--config", str(cfg))  # nothing on the port now
    try:
        run = kvrelay("reload", "--config", str(cfg), "--pid", str(relay.pid), "--timeout", "1")
        assert run.returncode == 0, (run.stdout, run.stderr)
        assert f"metrics endpoint (127.0.0.1:{port}) is not readable" in run.stdout
        _wait_for(tmp_path / "sighup")
    finally:
        _end(relay)


def test_mirror_with_a_metrics_key_that_is_not_a_table_is_a_usage_error(tmp_path: Path) -> None:
    f = tmp_path / "mirror.toml"
    f.write_text('metrics = "x"\n[mirror]\nupstream = "127.0.0.1:1"\n')
    run = kvrelay("mirror", "--config", str(f), "--metrics-bind", "off")
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert "[metrics] must be tables" in run.stderr, run.stderr


def test_demo_into_a_closed_pipe_stops_quietly_with_141() -> None:
    """``kvrelay demo | head -1``: no 'kvrelay demo: [Errno 32] Broken pipe' failure (exit 1)."""
    import os

    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the summary line
    try:
        run = subprocess.run(
            [sys.executable, "-m", "kvrelay", "demo", "--headless", "--duration", "1"],
            stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=scaled(120),
        )  # fmt: skip
    finally:
        os.close(write_end)
    assert run.returncode == 141, run.stderr[-2000:]
    assert "Broken pipe" not in run.stderr and "Traceback" not in run.stderr, run.stderr


@pytest.mark.parametrize("command", ["upgrade", "reload"])
@pytest.mark.parametrize("timeout", ["nan", "-1", "0"])
def test_a_timeout_that_is_not_positive_is_refused_before_any_signal(
    command: str, timeout: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A NaN or negative ``--timeout`` used to signal the relay, then report 'no outcome' or
    'still serves' (exit 1) at once; now argparse refuses it (2) and nothing is signalled."""
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args([command, "--pid", "1", "--timeout", timeout])
    assert info.value.code == 2
    assert "argument --timeout: must be a number of seconds > 0" in capsys.readouterr().err
    run = kvrelay(command, "--pid", "999999999", "--timeout", timeout)  # a process: exit 2
    assert run.returncode == 2 and "--timeout" in run.stderr, run.stderr


def test_the_config_is_read_on_a_thread_that_takes_no_signal(tmp_path: Path) -> None:
    """``early_signals.read_bytes`` gives what ``Path.read_bytes`` gives, raises what it raises,
    and reads on a thread that blocks the daemon's signals while the main thread waits in short
    steps (a FIFO nobody writes: the main thread still returns to Python, here to a timer's
    handler, well before the read would end)."""
    f = tmp_path / "a.toml"
    f.write_bytes(b"x = 1\n")
    assert early_signals.read_bytes(f) == b"x = 1\n"
    with pytest.raises(FileNotFoundError):
        early_signals.read_bytes(tmp_path / "missing.toml")
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)

    class Woken(Exception):
        pass

    def wake(signum: int, frame: object) -> None:
        raise Woken()

    old = signal.signal(signal.SIGALRM, wake)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        t0 = time.monotonic()
        with pytest.raises(Woken):
            early_signals.read_bytes(fifo)
        assert time.monotonic() - t0 < 5.0
        reader = next(t for t in threading.enumerate() if t.name == "kvrelay-read-file")
        mask = 0
        status = Path(f"/proc/self/task/{reader.native_id}/status").read_text()
        for line in status.splitlines():
            if line.startswith("SigBlk:"):
                mask = int(line.split()[1], 16)
        assert mask >> (signal.SIGTERM - 1) & 1 and mask >> (signal.SIGHUP - 1) & 1, hex(mask)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        with contextlib.suppress(OSError):  # let the reader's open and read end
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
