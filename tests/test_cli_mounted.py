"""The SDK's inspection commands are mounted on the main ``kvrelay`` CLI."""

from __future__ import annotations

import asyncio
import json
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


def test_client_commands_are_listed_in_help(capsys: object) -> None:
    from kvrelay.cli import main

    assert main(["--help"]) == 0
    text = capsys.readouterr().out  # type: ignore[attr-defined]
    for command in ("watch", "subscribe", "query"):
        assert f"    {command}" in text
