"""CLI via ``main([...])`` against the scripted server and a real kvrelay (output captured)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.client import cli
from kvrelay.relay.relay import Relay
from kvrelay.relay.settings import RelaySettings
from kvrelay.service.server import RelayServer
from kvrelay.sim.config import SimConfig
from tests.support.client_stack import eventually, query_set, stack, truth_depth
from tests.support.commands import clean_env, sigint_as_at_a_shell
from tests.support.scripted_relay import (
    Script,
    ScriptedRelay,
    delta,
    descriptor,
    port_of,
    producer,
    serve,
    snapshot,
)


@contextlib.asynccontextmanager
async def scripted(*scripts: Script) -> AsyncIterator[str]:
    relay = ScriptedRelay()
    relay.scripts.extend(scripts)
    server = await serve(relay)
    try:
        yield f"127.0.0.1:{port_of(server)}"
    finally:
        server.close()
        await server.wait_closed()


async def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``cli.main`` in a worker thread (it owns its own event loop), output captured."""
    rc = await asyncio.to_thread(cli.main, list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def jsonl(text: str) -> list[dict[str, object]]:
    """JSON lines of the CLI (the in-process relay's own log lines are skipped)."""
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


async def test_watch_catalog_json(capsys: pytest.CaptureFixture[str]) -> None:
    async with scripted() as addr:
        rc, out, _ = await run_cli(capsys, "watch", "catalog", "--relay", addr, "--json",
                                   "--count", "1")  # fmt: skip
    assert rc == 0
    (msg,) = jsonl(out)
    assert msg["plane"] == "catalog" and msg["relay"] == addr and msg["relay_incarnation"] == 1001
    (pool,) = msg["pools"]  # type: ignore[misc]
    assert pool["pool"] == "ns/be/gen" and pool["block_size"] == 4
    assert pool["hash_format"] == "STANDARD" and pool["bucket_count"] == 1024
    assert pool["models"] == ["m"] and pool["roles"] == ["AGGREGATED"]


async def test_watch_readiness_table_and_load_json(capsys: pytest.CaptureFixture[str]) -> None:
    async with scripted() as addr:
        rc, out, _ = await run_cli(capsys, "watch", "readiness", "--relay", addr, "--count", "1")
        assert rc == 0
        assert "readiness revision 1" in out and "READY" in out and "ns/be/gen" in out
        rc, out, _ = await run_cli(capsys, "watch", "load", "--relay", addr, "--json",
                                   "--count", "1")  # fmt: skip
    assert rc == 0
    (msg,) = jsonl(out)
    (entry,) = msg["pools"]  # type: ignore[misc]
    assert entry["authoritative"] is True and entry["utilization"] == pytest.approx(0.25)


async def test_watch_duration_stops(capsys: pytest.CaptureFixture[str]) -> None:
    async with scripted() as addr:
        rc, out, _ = await run_cli(capsys, "watch", "catalog", "--relay", addr,
                                   "--duration", "0.3")  # fmt: skip
    assert rc == 0
    assert out.count("catalog revision") == 1


async def test_subscribe_verify_reports_violation_and_recovers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    bad = Script([*snapshot(5), delta(6, 7)], hold=True)
    async with scripted(bad) as addr:
        rc, out, _ = await run_cli(capsys, "subscribe", "ns/be/gen", "--relay", addr, "--verify",
                                   "--json", "--count", "3")  # fmt: skip
    assert rc == 1  # a violation was seen
    lines = jsonl(out)
    violations = [x for x in lines if "violation" in x]
    assert [v["violation"] for v in violations] == ["sequence_gap"]
    frames = [x for x in lines if "kind" in x]
    assert [f["kind"] for f in frames] == ["SNAPSHOT_CHUNK", "SNAPSHOT_CHUNK", "DELTA"]
    assert frames[1]["installed"] is True and frames[1]["sequence"] == 10
    assert frames[2]["base_sequence"] == 10 and frames[2]["sequence"] == 11
    assert frames[2]["images"] == 1 and frames[2]["occupancy"] == 3 * 2 + 4
    assert isinstance(frames[2]["checksum"], int)
    assert lines[-1]["verdict"] == "fail" and lines[-1]["violations"] == 1  # the last line


async def test_subscribe_verify_ends_with_a_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    async with scripted() as addr:
        rc, out, _ = await run_cli(capsys, "subscribe", "gen", "--relay", addr, "--verify",
                                   "--count", "2")  # fmt: skip
    assert rc == 0
    last = out.splitlines()[-1]
    assert last.startswith("verify: PASS") and "0 violation(s)" in last, out


async def test_subscribe_verify_fails_a_stream_that_goes_silent(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A relay that installs a snapshot and then sends nothing, not even a heartbeat: the
    stream is ended ``silent`` after ``--silence-s`` (the SDK's rule) and reopened, and the
    verdict is FAIL, never a PASS over a relay that broke its heartbeat obligation."""
    async with scripted(Script(snapshot(5), hold=True)) as addr:
        rc, out, _ = await run_cli(capsys, "subscribe", "gen", "--relay", addr, "--verify",
                                   "--json", "--silence-s", "0.2", "--duration", "1")  # fmt: skip
    lines = jsonl(out)
    assert [x["stream_end"] for x in lines if "stream_end" in x][:1] == ["silent"], out
    assert lines[-1]["verdict"] == "fail" and lines[-1]["violations"] == 0, out
    assert lines[-1]["problems"] >= 1 and rc == 1, out


def _closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"  # nothing listens once it is closed


async def test_a_relay_that_is_down_is_reported_not_waited_for(
    capsys: pytest.CaptureFixture[str],
) -> None:
    addr = _closed_port()
    t0 = time.monotonic()
    rc, out, err = await run_cli(capsys, "query", "--relay", addr, "--model", "m",
                                 "--tokens", "1,2", "--wait", "60")  # fmt: skip
    assert rc == 1 and out == ""  # no "0 pool(s)" that reads like a wrong model name
    assert f"[{addr}] catalog stream ended: connection" in err and "Error" in err, err
    assert time.monotonic() - t0 < 50, "waited out --wait instead of reporting the error"
    rc, _, err = await run_cli(capsys, "subscribe", "gen", "--relay", addr, "--count", "1")
    assert rc == 1 and "catalog stream ended: connection (" in err
    assert "is a relay listening there?" in err, err


async def test_an_empty_catalog_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    relay = Relay(RelaySettings(dc_name="dc-empty"))
    await relay.start()
    server = RelayServer(relay)
    await server.start("127.0.0.1", 0)
    try:
        rc, out, _ = await run_cli(capsys, "watch", "catalog", "--relay",
                                   f"127.0.0.1:{server.port}", "--count", "1")  # fmt: skip
    finally:
        await server.close(grace_s=0.5)
        await relay.stop()
    assert rc == 0 and "0 pool(s)" in out
    assert "with every engine unreachable the catalog is empty" in out


async def test_subscribe_table_without_verify(capsys: pytest.CaptureFixture[str]) -> None:
    async with scripted() as addr:
        rc, out, _ = await run_cli(capsys, "subscribe", "gen", "--relay", addr, "--count", "2")
    assert rc == 0
    first, second = out.splitlines()
    assert "SNAPSHOT_CHUNK" in first and "chunk 1/1" in first and "[installed]" in first
    assert "DELTA" in second and "10->11" in second and "images 1" in second
    assert "occupancy 10" in second


async def test_subscribe_bounds_the_catalog_wait_by_its_silence_limit(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A relay that takes the catalog call and never answers: ``subscribe`` waited for ever
    (``--silence-s`` bounded the pool stream only). Its catalog's first message now comes
    within that bound too, or the run ends with the reason and exit 1."""
    async def mute(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while await r.read(65536):
                pass
        w.close()

    server = await asyncio.start_server(mute, "127.0.0.1", 0)
    try:
        addr = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
        t0 = time.monotonic()
        rc, _, err = await run_cli(capsys, "subscribe", "gen", "--relay", addr,
                                   "--silence-s", "1")  # fmt: skip
        assert rc == 1 and "catalog stream ended: silent" in err, err
        assert time.monotonic() - t0 < 20
    finally:
        server.close()


async def test_subscribe_reports_a_catalog_entry_no_replica_can_use(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A pool whose producer has no CKF format: ``subscribe`` ended with exit 0 and nothing
    said (the error was swallowed). It is a violation now, shown, exit 1, with and without
    ``--verify``."""
    bad = descriptor(pb.ProducerIdentity(pool_id=producer().pool_id, layout_generation=1))
    relay = ScriptedRelay(catalog=[bad])
    server = await serve(relay)
    try:
        addr = f"127.0.0.1:{port_of(server)}"
        for verify in ((), ("--verify",)):
            rc, out, _ = await run_cli(capsys, "subscribe", "gen", "--relay", addr,
                                       "--count", "1", *verify)  # fmt: skip
            assert rc == 1 and "VIOLATION catalog_entry: expected_producer: ckf_format is " \
                "missing" in out, (verify, out)
    finally:
        server.close()
        await server.wait_closed()


async def test_subscribe_unknown_pool_fails(capsys: pytest.CaptureFixture[str]) -> None:
    async with scripted() as addr:
        rc, _, err = await run_cli(capsys, "subscribe", "nope/x/y", "--relay", addr,
                                   "--count", "1")  # fmt: skip
    assert rc == 1 and "not in the catalog" in err


async def test_query_against_a_real_relay(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    async with stack([SimConfig(name="c0", seed=9, dp_size=1, capacity_blocks=96)]) as st:
        for _ in range(5):
            await st.engines[0].step(4)
            await asyncio.sleep(0.01)
        await eventually(st.in_sync, what="relay in sync")
        await eventually(lambda: st.producer_table() is not None, what="published")
        tokens, _lora = next(
            (t, lo) for t, lo in query_set(st.engines, random.Random(3), 200)
            if lo is None and truth_depth(t, None, st.truth()) >= 2
        )
        want = truth_depth(tokens, None, st.truth())
        rc, out, _ = await run_cli(capsys, "query", "--relay", st.address, "--model",
                                   "sim-model", "--tokens", ",".join(map(str, tokens)), "--json")
        assert rc == 0
        (msg,) = jsonl(out)
        pool = f"{st.address}/ns/backend/generate"
        assert msg["overlap"][pool] >= want  # type: ignore[index]
        assert msg["pools"][0]["depth_tokens"] == 16 * msg["overlap"][pool]  # type: ignore[index]
        f = tmp_path / "tokens.json"
        f.write_text(json.dumps(tokens))
        rc, out, _ = await run_cli(capsys, "query", "--relay", st.address, "--model",
                                   "sim-model-alias", "--tokens-file", str(f))  # fmt: skip
        assert rc == 0 and pool in out and "ROUTABLE" in out
        rc, out, _ = await run_cli(capsys, "query", "--relay", st.address, "--model", "nope",
                                   "--tokens", "1,2,3", "--wait", "2")  # fmt: skip
        assert rc == 1 and "0 pool(s)" in out
        assert "no pool serves 'nope'; the catalog's models: sim-model, sim-model-alias" in out
        rc, out, _ = await run_cli(capsys, "query", "--relay", st.address, "--model",
                                   "sim-model", "--lora", "nosuch", "--tokens", "1,2,3",
                                   "--wait", "2")  # fmt: skip
        assert rc == 1  # the base is served: the adapter is what no pool serves
        assert "no pool serves LoRA 'nosuch' on 'sim-model'; the catalog's models" in out


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["watch", "catalog", "--relay", "no-port"],
        ["query", "--relay", "127.0.0.1:1", "--model", "m", "--tokens", "1,x"],
        ["watch", "catalog", "--relay", "127.0.0.1:1", "--count", "0"],
        ["watch", "catalog", "--relay", "127.0.0.1:1", "--subscriber-id", "a\tb"],
    ],
)
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(argv) == 2


def test_mountable_into_another_parser() -> None:
    parser = argparse.ArgumentParser(prog="kvrelay")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("serve")
    cli.add_subcommands(sub)
    args = parser.parse_args(["query", "--relay", "h:1", "--model", "m", "--tokens", "1 2 3"])
    assert args.command == "query" and args.client_command == "query"
    assert cli._tokens(args) == [1, 2, 3]
    args = parser.parse_args(["serve"])
    assert getattr(args, "client_command", None) is None


def test_relay_defaults_to_the_environment_then_kvrelays_port() -> None:
    assert cli.relay_addresses(["a:1"], env={"KVRELAY_RELAY": "b:2"}) == ["a:1"]
    assert cli.relay_addresses(None, env={"KVRELAY_RELAY": "b:2, c:3"}) == ["b:2", "c:3"]
    assert cli.relay_addresses(None, env={}) == ["127.0.0.1:50161"]


@pytest.mark.parametrize(
    "argv",
    [
        ["watch", "catalog", "--cert", "c.pem"],  # --cert without --key
        ["watch", "catalog", "--ca", "ca.pem"],  # --ca without --tls
        ["watch", "catalog", "--cert", "/nonexistent.pem", "--key", "/nonexistent.key"],
    ],
)
def test_tls_option_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(argv) == 2
    assert "kvrelay-client watch: error:" in capsys.readouterr().err  # the subcommand named


async def test_the_documented_hit_query_hits_the_simulator(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """docs/client.md's `kvrelay query` line, run as printed against `kvrelay sim`'s default
    engine (what `kvrelay sim` prints at start): depth 2."""
    from kvrelay.sim.cli import build_parser, configs_from_args, hot_tokens

    doc = (Path(__file__).resolve().parents[2] / "docs" / "client.md").read_text()
    (line,) = [x for x in doc.splitlines() if x.startswith("kvrelay query --model sim-model ")]
    cfg = configs_from_args(build_parser().parse_args(
        ["--pub-port", "0", "--replay-port", "0", "--grpc-port", "0", "--metrics-port", "-1"]
    ))[0]  # fmt: skip
    async with stack([cfg]) as st:
        engine = st.engines[0]
        printed = ",".join(map(str, hot_tokens(engine)))
        assert line.endswith(f"--tokens {printed}"), "docs/client.md's list is not the sim's"
        for _ in range(20):
            await engine.step(10)
            await asyncio.sleep(0.01)
        await eventually(st.in_sync, what="relay in sync")
        assert truth_depth(hot_tokens(engine), None, st.truth()) == 2  # the engine holds it
        argv = [*line.split()[1:], "--relay", st.address, "--json", "--wait", "20"]
        rc, out, _ = await run_cli(capsys, *argv)
        assert rc == 0, out
        (msg,) = jsonl(out)
        assert msg["overlap"] == {f"{st.address}/ns/backend/generate": 2}, msg


async def test_the_documented_sdk_example_runs(tmp_path: Path) -> None:
    """docs/client.md's SDK example, run as printed: depth 2 against the simulator's default
    engine; against a relay that is down, wait_ready() is False and it exits 1 saying so."""
    from kvrelay.sim.cli import build_parser, configs_from_args

    doc = (Path(__file__).resolve().parents[2] / "docs" / "client.md").read_text()
    code = doc.split("<!-- sdk-example -->\n```python\n", 1)[1].split("\n```\n", 1)[0]
    script = tmp_path / "example.py"
    script.write_text(code + "\n")
    cfg = configs_from_args(build_parser().parse_args(
        ["--pub-port", "0", "--replay-port", "0", "--grpc-port", "0", "--metrics-port", "-1"]
    ))[0]  # fmt: skip

    async def run(relay: str) -> tuple[int, str, str]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(script), env=clean_env(KVRELAY_RELAY=relay),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode is not None
        return proc.returncode, out.decode(), err.decode()

    async with stack([cfg]) as st:
        for _ in range(20):
            await st.engines[0].step(10)
            await asyncio.sleep(0.01)
        await eventually(st.in_sync, what="relay in sync")
        rc, out, err = await run(st.address)
    assert rc == 0, err[-2000:]
    assert f"{st.address}/ns/backend/generate: 2 cached block(s)" in out, out
    assert "ServingLoadViews(" in out
    # the same script, waiting 2 s instead of 10 for a relay that never answers
    assert "client.wait_ready(timeout=10)" in code
    script.write_text(code.replace("client.wait_ready(timeout=10)", "client.wait_ready(timeout=2)"))
    rc, out, err = await run(_closed_port())
    assert rc == 1 and "not ready" in err and "cached block" not in out, (out, err)


# ------------------------------------------------------------------ as a process: pipes, Ctrl-C

CLI = [sys.executable, "-m", "kvrelay"]


async def test_a_closed_stdout_ends_quietly_with_141() -> None:
    """``kvrelay watch … | head -1``: once the reader is gone the command stops, with the status
    of a tool that SIGPIPE ended and nothing on stderr (not a 'stream ended: connection
    BrokenPipeError' that blames the relay, nor Python's 'Exception ignored')."""
    async with scripted() as addr:
        for argv in (["watch", "catalog", "--json"], ["subscribe", "gen"]):
            read_end, write_end = os.pipe()
            os.close(read_end)  # the reader has left before the first line
            try:
                proc = await asyncio.create_subprocess_exec(
                    *CLI, *argv, "--relay", addr, stdout=write_end,
                    stderr=asyncio.subprocess.PIPE, env=clean_env(),
                )  # fmt: skip
            finally:
                os.close(write_end)
            _, err = await asyncio.wait_for(proc.communicate(), 60)
            assert proc.returncode == 141 and err == b"", (argv, proc.returncode, err)


async def _interrupt_once_connected(*argv: str) -> tuple[int, str, str]:
    """Run ``kvrelay ARGV`` against a listener that accepts and never answers, send SIGINT once
    it has connected (so the command is waiting for the relay, not importing)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        addr = f"127.0.0.1:{listener.getsockname()[1]}"
        proc = await asyncio.create_subprocess_exec(
            *CLI, *argv, "--relay", addr, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=clean_env(), preexec_fn=sigint_as_at_a_shell,
        )  # fmt: skip
        loop = asyncio.get_running_loop()
        conn, _ = await asyncio.wait_for(loop.sock_accept(listener), 60)
        try:
            proc.send_signal(signal.SIGINT)
            out, err = await asyncio.wait_for(proc.communicate(), 60)
        finally:
            conn.close()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_ctrl_c_interrupts_query_with_130() -> None:
    rc, out, err = await _interrupt_once_connected("query", "--model", "m", "--tokens", "1",
                                                   "--wait", "60")  # fmt: skip
    assert rc == 130 and out == "" and "Traceback" not in err, (rc, out, err)


async def test_ctrl_c_ends_subscribe_verify_with_its_verdict() -> None:
    """Ctrl-C ends ``subscribe --verify`` as ``--duration`` does: the verdict is printed and is
    the exit status (here nothing was checked: FAIL, 1), never a silent 0."""
    rc, out, err = await _interrupt_once_connected("subscribe", "gen", "--verify", "--json")
    assert "Traceback" not in err, err
    assert json.loads(out.splitlines()[-1])["verdict"] == "fail", out
    assert rc == 1, (rc, out, err)


def test_nan_and_negative_durations_are_usage_errors() -> None:
    for argv in (["watch", "catalog", "--duration", "nan"],
                 ["query", "--model", "m", "--tokens", "1", "--wait", "-1"]):  # fmt: skip
        res = subprocess.run([*CLI, *argv, "--relay", _closed_port()], capture_output=True,
                             text=True, env=clean_env(), timeout=60)  # fmt: skip
        assert res.returncode == 2, (argv, res)
        assert res.stderr.startswith(f"kvrelay {argv[0]}: error: --"), res.stderr


def test_the_standalone_client_tells_its_version(capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m kvrelay.client --version`` (``kvrelay --version``'s counterpart) names the
    installed version and the contract it speaks, and exits 0."""
    from importlib.metadata import version

    assert cli.main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"kvrelay-client {version('kvrelay')} (") and "dynamo.kvrelay.v1" in out
