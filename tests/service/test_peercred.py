"""The internal UNIX socket refuses peers of another user (``SO_PEERCRED``), and its daemon
directory is private.

A real second user: the hostile client runs as ``nobody`` (uid 65534) in a child process started
through ``setpriv``, which needs root (skipped otherwise). The socket is put in a world-writable
directory with mode 0777 on purpose, so only the credential check stands between that user and
the relay.
Oracle: whether the client reads the server's HTTP/2 SETTINGS frame (the start of any reply).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvrelay.service.server import RelayServer
from tests.support.mem_relay import MemRelayView

NOBODY = 65534
SETPRIV = shutil.which("setpriv")
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
CLIENT = r"""
import socket, sys
s = socket.socket(socket.AF_UNIX)
s.settimeout(10)
s.connect(sys.argv[1])
data = b""
try:
    s.sendall(bytes.fromhex(sys.argv[2]))
    while len(data) < 9:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
except (ConnectionError, socket.timeout):
    pass
# the server's first frame: 9-byte header, type at offset 3 (4 = SETTINGS)
print("settings" if len(data) >= 9 and data[3] == 4 else "refused")
"""


def _client(path: str, user: int | None) -> str:
    # Another user through setpriv, not subprocess's ``user=``: that forces a plain fork(), which
    # runs the pytest process's atfork handlers (grpcio's, once an earlier test loaded it) in the
    # child before exec, and those crashed it now and then (SIGSEGV). Without ``user=`` the child
    # is started with vfork and runs no handler.
    as_user = [] if user is None else [SETPRIV, f"--reuid={user}", f"--regid={user}",
                                       "--clear-groups", "/usr/bin/python3"]
    run = subprocess.run(
        [*(as_user or [sys.executable]), "-c", CLIENT, path, PREFACE.hex()],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


@pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/usr/bin/python3") or SETPRIV is None,
    reason="needs root and setpriv (util-linux) to run a client as another user",
)
async def test_a_peer_of_another_user_is_refused_before_http2_starts() -> None:
    view = MemRelayView()
    server = RelayServer(view)
    d = tempfile.mkdtemp(prefix="kvrelay-peercred-")
    os.chmod(d, 0o777)  # deliberately open: the check alone must refuse
    path = str(Path(d) / "ingest.sock")
    await server.start_unix(path)
    os.chmod(path, 0o777)
    try:
        import asyncio

        assert await asyncio.to_thread(_client, path, None) == "settings"  # same user
        assert await asyncio.to_thread(_client, path, NOBODY) == "refused"
        assert server.peer_check is not None and server.peer_check.refused == 1
    finally:
        await server.close(grace_s=0.5)
        shutil.rmtree(d, ignore_errors=True)  # the socket file outlives the server's close


LOOP = r"""
import socket, sys
for _ in range(int(sys.argv[2])):
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    s.connect(sys.argv[1])
    try:
        s.recv(1)  # b"": closed by the server
    except ConnectionError:
        pass
    s.close()
"""


@pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/usr/bin/python3") or SETPRIV is None,
    reason="needs root and setpriv (util-linux) to run a client as another user",
)
async def test_a_peer_of_another_user_reconnecting_in_a_loop_is_logged_once() -> None:
    """Each refusal is counted; ``internal_peer_refused`` comes at most once per 10 s."""
    import asyncio

    import structlog

    server = RelayServer(MemRelayView())
    d = tempfile.mkdtemp(prefix="kvrelay-peercred-")
    os.chmod(d, 0o777)
    path = str(Path(d) / "ingest.sock")
    await server.start_unix(path)
    os.chmod(path, 0o777)
    cmd = [SETPRIV, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
           "/usr/bin/python3", "-c", LOOP, path, "50"]  # fmt: skip
    try:
        with structlog.testing.capture_logs() as logs:
            run = await asyncio.to_thread(
                subprocess.run, cmd, capture_output=True, text=True, timeout=60
            )
        assert run.returncode == 0, run.stderr
        assert server.peer_check is not None and server.peer_check.refused == 50
        refused = [e for e in logs if e["event"] == "internal_peer_refused"]
        assert len(refused) == 1 and refused[0]["uid"] == NOBODY, refused[:3]
    finally:
        await server.close(grace_s=0.5)
        shutil.rmtree(d, ignore_errors=True)  # the socket file outlives the server's close


async def test_the_daemons_internal_socket_directory_is_private(tmp_path: Path) -> None:
    """``WorkerFront`` makes its directory with mode 0700 (under ``$RUNTIME_DIRECTORY``)."""
    from kvrelay.ops.front import private_runtime_dir

    d = private_runtime_dir(str(tmp_path))
    try:
        assert stat.S_IMODE(os.stat(d.path).st_mode) == 0o700 and Path(d.path).parent == tmp_path
    finally:
        d.remove()
    assert list(tmp_path.iterdir()) == []
