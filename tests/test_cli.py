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


def test_ctrl_c_while_upgrade_waits_exits_130_without_a_traceback(tmp_path: Path) -> None:
    """A stand-in relay that only notes its SIGUSR2: ``kvrelay upgrade`` then waits for it to
    hand over, and Ctrl-C there is an interruption (130), not a KeyboardInterrupt traceback."""
    import signal
    import time

    ready, flag = tmp_path / "ready", tmp_path / "usr2"
    relay = subprocess.Popen([sys.executable, "-c", (
        "import pathlib, signal, sys, time\n"
        "signal.signal(signal.SIGUSR2, lambda *_: pathlib.Path(sys.argv[2]).touch())\n"
        "pathlib.Path(sys.argv[1]).touch()\n"
        "time.sleep(120)\n"
    ), str(ready), str(flag)])  # fmt: skip

    def wait_for(path: Path) -> None:
        deadline = time.monotonic() + scaled(60)
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert path.exists(), path

    try:
        wait_for(ready)  # its handler is set: the upgrade's signal cannot end it
        upgrade = subprocess.Popen(
            [sys.executable, "-m", "kvrelay", "upgrade", "--pid", str(relay.pid), "--timeout",
             "120"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            preexec_fn=sigint_as_at_a_shell,
        )  # fmt: skip
        wait_for(flag)  # signalled: kvrelay upgrade is in its waiting loop now
        upgrade.send_signal(signal.SIGINT)
        _, err = upgrade.communicate(timeout=scaled(60))
    finally:
        relay.kill()
        relay.wait()
    assert upgrade.returncode == 130 and "Traceback" not in err, (upgrade.returncode, err)


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
