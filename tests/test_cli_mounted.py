"""The SDK's inspection commands are mounted on the main ``kvrelay`` CLI."""

from __future__ import annotations

import asyncio
import json
import os
import sys

from kvrelay.relay.relay import Relay
from kvrelay.relay.settings import RelaySettings
from kvrelay.service.server import RelayServer
from tests.support.timing import scaled


async def test_kvrelay_watch_catalog_json_against_a_live_relay() -> None:
    relay = Relay(RelaySettings(dc_name="dc-cli"))
    await relay.start()
    server = RelayServer(relay)
    await server.start("127.0.0.1", 0)
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvrelay", "watch", "catalog",
            "--relay", f"127.0.0.1:{server.port}", "--count", "1", "--json",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), scaled(60))
        assert proc.returncode == 0, err.decode()
        lines = [json.loads(line) for line in out.decode().splitlines() if line.strip()]
        assert len(lines) == 1
        text = json.dumps(lines[0])
        assert str(relay.relay_incarnation) in text or hex(relay.relay_incarnation) in text
    finally:
        await server.close(grace_s=1.0)
        await relay.stop()


async def test_kvrelay_watch_stops_when_its_reader_goes_while_nothing_changes() -> None:
    """``kvrelay watch catalog | head -1`` on a relay whose catalog does not change: nothing is
    written after the first update, so a closed pipe was never noticed and the command never
    exited. It ends as on a failed write now, quietly, with 141."""
    relay = Relay(RelaySettings(dc_name="dc-cli"))
    await relay.start()
    server = RelayServer(relay)
    await server.start("127.0.0.1", 0)
    read_end, write_end = os.pipe()
    proc = None
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvrelay", "watch", "catalog",
            "--relay", f"127.0.0.1:{server.port}",
            stdout=write_end, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        os.close(write_end)
        write_end = -1
        with os.fdopen(read_end, "rb") as head:  # `head -1`: one line, then its exit
            read_end = -1
            first = await asyncio.wait_for(asyncio.to_thread(head.readline), scaled(60))
            assert b"catalog revision 0: 0 pool(s)" in first, first
        rc = await asyncio.wait_for(proc.wait(), scaled(15))
        assert proc.stderr is not None
        err = (await proc.stderr.read()).decode()
        assert rc == 141, err
        assert "Broken pipe" not in err and "Traceback" not in err, err
    finally:
        for fd in (read_end, write_end):
            if fd >= 0:
                os.close(fd)
        if proc is not None and proc.returncode is None:
            proc.kill()
            await proc.wait()
        await server.close(grace_s=1.0)
        await relay.stop()


def test_client_commands_are_listed_in_help(capsys: object) -> None:
    from kvrelay.cli import main

    assert main(["--help"]) == 0
    text = capsys.readouterr().out  # type: ignore[attr-defined]
    for command in ("watch", "subscribe", "query"):
        assert f"    {command}" in text
