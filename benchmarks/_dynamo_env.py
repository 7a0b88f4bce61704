"""What both side-by-side modes need to run Dynamo's reference relay: its own virtual
environment, a private network namespace, and the runtime environment that pins every advertised
address to loopback.

Dynamo (``ai-dynamo`` 1.6.1) is never a kvrelay dependency: it lives in ``.venv-dynamo`` at the
repository root, installed on first use (~226 MB from PyPI; its ``aisimulate`` dependency is not
installable, so ``ai-dynamo`` goes in with ``--no-deps`` plus the few packages its relay, mocker
and runtime client import). Dynamo's processes bind some sockets on all interfaces with no
setting to change that, so everything runs in a namespace whose only interface is ``lo``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks._common import ROOT

VENV = ROOT / ".venv-dynamo"
DPY = str(VENV / "bin" / "python")


def netns_name(base: str) -> str:
    """``base`` plus a short digest of this checkout's path: two checkouts on one machine (git
    worktrees) can run side by side at once without one deleting the other's namespace, while a
    namespace left by an earlier, killed run of the same checkout is still found and removed."""
    import zlib

    return f"{base}-{zlib.crc32(str(ROOT).encode()):08x}"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] side-by-side: {msg}", flush=True)


def sh(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)


def ensure_venv() -> str | None:
    """None when .venv-dynamo imports Dynamo, else the reason it could not be made to."""
    check = "import dynamo.mocker, dynamo.kv_dc_relay, dynamo.runtime, dynamo.llm, tokenizers"
    if Path(DPY).exists() and sh(DPY, "-c", check).returncode == 0:
        return None
    log("installing ai-dynamo-runtime==1.6.1 / ai-dynamo==1.6.1 into .venv-dynamo (~226 MB)")
    steps = [
        [sys.executable, "-m", "venv", str(VENV)],
        [DPY, "-m", "pip", "install", "-q", "ai-dynamo-runtime==1.6.1"],
        [DPY, "-m", "pip", "install", "-q", "--no-deps", "ai-dynamo==1.6.1"],
        [DPY, "-m", "pip", "install", "-q", "aiohttp", "msgspec", "prometheus-client", "pyzmq",
         "uvloop", "tokenizers"],
    ]
    for st in steps:
        try:
            r = sh(*st, timeout=1200)
        except (OSError, subprocess.SubprocessError) as exc:
            return f"install step {st[2:]} failed: {exc}"
        if r.returncode != 0:
            return f"install step {' '.join(st[2:])} failed: {r.stderr.strip()[-400:]}"
    r = sh(DPY, "-c", check)
    return None if r.returncode == 0 else f"Dynamo import failed: {r.stderr.strip()[-400:]}"


def ensure_netns(ns: str) -> str | None:
    """Create ``ns`` with only ``lo`` up; None on success, else why not."""
    if os.geteuid() != 0:
        return "needs root for a private network namespace (ip netns add)"
    if shutil.which("ip") is None:
        return "iproute2 'ip' not found"
    delete_netns(ns)  # a namespace left by an earlier, killed run
    r = sh("ip", "netns", "add", ns)
    if r.returncode != 0:
        return f"ip netns add failed: {r.stderr.strip()}"
    r = sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
    return None if r.returncode == 0 else f"lo up failed: {r.stderr.strip()}"


def _netns_pids(ns: str) -> list[int]:
    try:
        return [int(p) for p in sh("ip", "netns", "pids", ns).stdout.split()]
    except (OSError, subprocess.SubprocessError, ValueError):
        return []


def delete_netns(ns: str) -> None:
    """End what still runs in ``ns`` (only this benchmark starts processes there), then drop it."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = _netns_pids(ns)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + 3.0
        while _netns_pids(ns) and time.monotonic() < deadline:
            time.sleep(0.1)
    sh("ip", "netns", "del", ns)


def dyn_env(kv_dir: Path) -> dict[str, str]:
    """File discovery in ``kv_dir``, ZMQ event plane, TCP request plane, all on 127.0.0.1."""
    return {
        "DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(kv_dir), "DYN_EVENT_PLANE": "zmq",
        "DYN_REQUEST_PLANE": "tcp", "DYN_EVENT_PLANE_HOST": "127.0.0.1",
        "DYN_TCP_RPC_HOST": "127.0.0.1", "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
        "DYN_SYSTEM_HOST": "127.0.0.1",
    }


def sigterm_as_exit() -> None:
    """SIGTERM and SIGINT unwind as KeyboardInterrupt, so ``finally`` blocks stop processes and
    drop the netns (SIGINT too: a shell starts background jobs with it ignored)."""
    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
