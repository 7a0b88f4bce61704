"""Certificate rotation, check-config loading the PEM files, and the expiry gauge.

Certificates are generated at test time (``tests/support/certs.py``); handshakes are real
(grpclib over loopback). The rotation race is made deterministic with a FIFO as the key file:
each open reads the next key a writer thread hands it, exactly as if a rotation landed between
two reads of one reload. Oracles: a client trusting the new CA completes a call; ``openssl x509
-enddate`` for the expiry.
"""

from __future__ import annotations

import asyncio
import calendar
import os
import shutil
import ssl
import subprocess
import threading
import time
from pathlib import Path

import pytest

from kvrelay.ops.config import check_file
from kvrelay.ops.tls import (
    ReloadableServerContext,
    ServerTlsFiles,
    TlsConfigError,
    client_ssl_context,
)
from kvrelay.relay.relay import Relay
from kvrelay.relay.settings import RelaySettings
from kvrelay.service.server import RelayServer
from tests.support.certs import Pki, make_pki
from tests.support.rig import relay_info_at

MARKER = 0x4B565231


@pytest.fixture(scope="module")
def pkis(tmp_path_factory: pytest.TempPathFactory) -> tuple[Pki, Pki]:
    d = tmp_path_factory.mktemp("rot")
    (d / "old").mkdir()
    (d / "new").mkdir()
    return make_pki(d / "old"), make_pki(d / "new")


class _KeyFifo:
    """A FIFO at ``path`` whose n-th open reads ``keys[n]`` (then the writer stops)."""

    def __init__(self, path: Path, keys: list[bytes]) -> None:
        self.path = path
        os.mkfifo(path)
        self.opens = 0
        self._keys = keys
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        for key in self._keys:
            try:
                with open(self.path, "wb") as f:  # blocks until a reader opens it
                    self.opens += 1
                    f.write(key)
            except BrokenPipeError:
                return  # release(): nobody reads any more
            # the reader is this process: the next open is another read only once it closed
            while self._held():
                time.sleep(0.005)

    def _held(self) -> bool:
        for fd in os.listdir("/proc/self/fd"):
            try:
                if os.readlink(f"/proc/self/fd/{fd}") == str(self.path):
                    return True
            except OSError:
                continue
        return False

    def release(self) -> None:
        """Unblock a writer still waiting for a reader, and wait for the thread."""
        while self._thread.is_alive():
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
            try:
                time.sleep(0.05)
                with open(fd, "rb", closefd=False) as f:
                    f.read()
            finally:
                os.close(fd)
            self._thread.join(0.5)


async def test_a_rotation_between_two_reads_never_breaks_the_live_context(
    pkis: tuple[Pki, Pki], tmp_path: Path
) -> None:
    old, new = pkis
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    shutil.copy(old.server_cert, cert)
    shutil.copy(old.server_key, key)
    tls = ReloadableServerContext(ServerTlsFiles(str(cert), str(key)))
    relay = Relay(RelaySettings(dc_name="dc-rot"))
    await relay.start()
    server = RelayServer(relay, relay.limits)
    await server.start("127.0.0.1", 0, ssl=tls.in_use)
    fifo: _KeyFifo | None = None
    trusting_old = client_ssl_context(str(old.server_ca))
    trusting_new = client_ssl_context(str(new.server_ca))
    try:
        assert (await relay_info_at(server.port, trusting_old)).relay is not None
        # the rotation: new certificate in place, and the key file changes under the reload
        shutil.copy(new.server_cert, cert)
        key.unlink()
        fifo = _KeyFifo(key, [new.server_key.read_bytes(), old.server_key.read_bytes()])
        await asyncio.to_thread(tls.reload, ServerTlsFiles(str(cert), str(key)))
        assert fifo.opens == 1  # one read of the key: the pair it loaded matches
        assert (await relay_info_at(server.port, trusting_new)).relay is not None
        with pytest.raises(ssl.SSLCertVerificationError):
            await relay_info_at(server.port, trusting_old)
        # a reload whose files do not load leaves the live context as it was
        with pytest.raises(TlsConfigError):
            tls.reload(ServerTlsFiles(str(cert), str(old.server_key)))
        assert (await relay_info_at(server.port, trusting_new)).relay is not None
    finally:
        if fifo is not None:
            fifo.release()
        await server.close(grace_s=0.5)
        await relay.stop()


def _config(tmp_path: Path, cert: Path, key: Path) -> Path:
    p = tmp_path / "kvrelay.toml"
    p.write_text(
        '[relay]\ndc_name = "dc"\n[[pools]]\nnamespace = "ns"\ncomponent = "c"\n'
        'endpoint = "e"\n[[pools.engines]]\nname = "e0"\nhost = "127.0.0.1"\n'
        "grpc_port = 50051\n"
        f'[tls]\ncert = "{cert}"\nkey = "{key}"\n'
    )
    return p


def test_check_config_loads_the_pem_files(pkis: tuple[Pki, Pki], tmp_path: Path) -> None:
    old, new = pkis
    cfg, problems = check_file(_config(tmp_path, old.server_cert, old.server_key), env={})
    assert cfg is not None, problems
    der = tmp_path / "server.der"  # readable, but not PEM
    subprocess.run(["openssl", "x509", "-in", str(old.server_cert), "-outform", "DER",
                    "-out", str(der)], check=True, capture_output=True, timeout=60)  # fmt: skip
    for cert, key in ((der, old.server_key), (old.server_cert, new.server_key)):
        cfg, problems = check_file(_config(tmp_path, cert, key), env={})
        assert cfg is None
        assert [p.path for p in problems if p.severity == "error"] == ["tls.cert"], problems


def test_expiry_of_each_loaded_certificate_matches_openssl(pkis: tuple[Pki, Pki]) -> None:
    old, _new = pkis
    tls = ReloadableServerContext(
        ServerTlsFiles(str(old.server_cert), str(old.server_key), str(old.client_ca))
    )

    def enddate(path: Path) -> float:
        out = subprocess.run(["openssl", "x509", "-in", str(path), "-noout", "-enddate"],
                             check=True, capture_output=True, text=True, timeout=60).stdout
        when = time.strptime(out.strip().partition("=")[2], "%b %d %H:%M:%S %Y GMT")
        return float(calendar.timegm(when))

    got = {(c.role, c.subject): c.not_after_unix for c in tls.certificates}
    assert got == {
        ("server", "relay"): enddate(old.server_cert),
        ("client_ca", "client-ca"): enddate(old.client_ca),
    }
