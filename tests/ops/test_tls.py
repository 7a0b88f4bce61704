"""TLS / mTLS on the relay's gRPC listener with certificates generated at test time.

Peers: grpclib (our own client stack) and grpcio + official protobuf stubs (independent, BoringSSL).
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType

import grpc
import pytest
from grpclib.exceptions import StreamTerminatedError

from kvrelay.ops.tls import TlsConfigError, client_ssl_context, is_loopback, server_ssl_context
from kvrelay.relay.relay import Relay
from kvrelay.relay.settings import RelaySettings
from kvrelay.service.server import RelayServer
from tests.support.certs import Pki, make_dated_leaf, make_pki
from tests.support.fleet import eventually
from tests.support.rig import relay_info_at as _info_grpclib
from tests.support.timing import scaled

MARKER = 0x4B565231
# How grpclib surfaces a server-side mTLS refusal: with TLS 1.3 the client's handshake finishes
# first and the server's "certificate required" alert kills the connection under the stream.
REFUSED = (StreamTerminatedError, ssl.SSLError, ConnectionError)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


async def _serve(ctx: ssl.SSLContext | None) -> tuple[Relay, RelayServer]:
    relay = Relay(RelaySettings(dc_name="dc-tls"))
    await relay.start()
    server = RelayServer(relay, relay.limits)
    await server.start("127.0.0.1", 0, ssl=ctx)
    return relay, server


@pytest.fixture
async def tls_relay(pki: Pki) -> AsyncIterator[tuple[Relay, RelayServer]]:
    ctx = server_ssl_context(str(pki.server_cert), str(pki.server_key), None)
    relay, server = await _serve(ctx)
    yield relay, server
    await server.close(grace_s=0.5)
    await relay.stop()


@pytest.fixture
async def mtls_relay(pki: Pki) -> AsyncIterator[tuple[Relay, RelayServer]]:
    ctx = server_ssl_context(str(pki.server_cert), str(pki.server_key), str(pki.client_ca))
    relay, server = await _serve(ctx)
    yield relay, server
    await server.close(grace_s=0.5)
    await relay.stop()


async def _info_grpcio(
    pb2: dict[str, ModuleType], port: int, creds: grpc.ChannelCredentials
) -> object:
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", creds) as ch:
        stub = pb2["relay_grpc"].KvEventRelayStub(ch)
        return await stub.GetRelayInfo(
            pb2["relay"].RelayInfoRequest(contract_marker=MARKER), timeout=10
        )


def _creds(pki: Pki, *, client: tuple[Path, Path] | None = None) -> grpc.ChannelCredentials:
    key = chain = None
    if client is not None:
        chain, key = client[0].read_bytes(), client[1].read_bytes()
    return grpc.ssl_channel_credentials(
        root_certificates=pki.server_ca.read_bytes(), private_key=key, certificate_chain=chain
    )


# ---- TLS (server auth only) ----


async def test_grpclib_client_gets_relay_info_over_tls(
    pki: Pki, tls_relay: tuple[Relay, RelayServer]
) -> None:
    relay, server = tls_relay
    info = await _info_grpclib(server.port, client_ssl_context(str(pki.server_ca)))
    assert info.relay is not None
    assert info.relay.relay_incarnation == relay.relay_incarnation
    assert info.contract_marker == MARKER


async def test_grpcio_peer_gets_relay_info_over_tls(
    pki: Pki, tls_relay: tuple[Relay, RelayServer], official_pb2: dict[str, ModuleType]
) -> None:
    relay, server = tls_relay
    info = await _info_grpcio(official_pb2, server.port, _creds(pki))
    assert info.relay.relay_incarnation == relay.relay_incarnation  # type: ignore[attr-defined]
    assert info.relay.drt_instance_id == relay.relay_identity.drt_instance_id  # type: ignore[attr-defined]


async def test_tls_handshake_negotiates_h2_and_tls12_plus(
    pki: Pki, tls_relay: tuple[Relay, RelayServer]
) -> None:
    _relay, server = tls_relay
    ctx = client_ssl_context(str(pki.server_ca))
    _r, w = await asyncio.open_connection("127.0.0.1", server.port, ssl=ctx,
                                          server_hostname="localhost")
    try:
        obj = w.get_extra_info("ssl_object")
        assert obj.selected_alpn_protocol() == "h2"
        assert obj.version() in ("TLSv1.2", "TLSv1.3")
    finally:
        w.close()


async def test_client_that_does_not_trust_the_server_ca_is_refused(
    pki: Pki, tls_relay: tuple[Relay, RelayServer]
) -> None:
    _relay, server = tls_relay
    wrong = client_ssl_context(str(pki.client_ca))  # a CA that did not sign the server cert
    with pytest.raises(ssl.SSLCertVerificationError):
        await _info_grpclib(server.port, wrong)


async def test_plaintext_client_cannot_talk_to_tls_listener(
    tls_relay: tuple[Relay, RelayServer], official_pb2: dict[str, ModuleType]
) -> None:
    _relay, server = tls_relay
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = official_pb2["relay_grpc"].KvEventRelayStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await stub.GetRelayInfo(
                official_pb2["relay"].RelayInfoRequest(contract_marker=MARKER), timeout=5
            )
    assert ei.value.code() == grpc.StatusCode.UNAVAILABLE


# ---- mTLS ----


async def test_mtls_client_with_cert_from_client_ca_succeeds(
    pki: Pki, mtls_relay: tuple[Relay, RelayServer], official_pb2: dict[str, ModuleType]
) -> None:
    relay, server = mtls_relay
    ctx = client_ssl_context(str(pki.server_ca), str(pki.client_cert), str(pki.client_key))
    info = await _info_grpclib(server.port, ctx)
    assert info.relay is not None and info.relay.relay_incarnation == relay.relay_incarnation
    gi = await _info_grpcio(
        official_pb2, server.port, _creds(pki, client=(pki.client_cert, pki.client_key))
    )
    assert gi.relay.relay_incarnation == relay.relay_incarnation  # type: ignore[attr-defined]


async def test_mtls_refuses_client_without_certificate(
    pki: Pki, mtls_relay: tuple[Relay, RelayServer], official_pb2: dict[str, ModuleType]
) -> None:
    _relay, server = mtls_relay
    with pytest.raises(REFUSED):
        await _info_grpclib(server.port, client_ssl_context(str(pki.server_ca)))
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await _info_grpcio(official_pb2, server.port, _creds(pki))
    assert ei.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_mtls_refuses_client_cert_from_another_ca(
    pki: Pki, mtls_relay: tuple[Relay, RelayServer], official_pb2: dict[str, ModuleType]
) -> None:
    _relay, server = mtls_relay
    ctx = client_ssl_context(str(pki.server_ca), str(pki.rogue_cert), str(pki.rogue_key))
    with pytest.raises(REFUSED):
        await _info_grpclib(server.port, ctx)
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await _info_grpcio(
            official_pb2, server.port, _creds(pki, client=(pki.rogue_cert, pki.rogue_key))
        )
    assert ei.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_mtls_raw_handshake_without_cert_gets_alert(
    pki: Pki, mtls_relay: tuple[Relay, RelayServer]
) -> None:
    """The refusal is the TLS layer's (certificate required), not an RPC-level error."""
    _relay, server = mtls_relay
    ctx = client_ssl_context(str(pki.server_ca))
    with pytest.raises((ssl.SSLError, ConnectionError, asyncio.IncompleteReadError)):
        r, w = await asyncio.open_connection(
            "127.0.0.1", server.port, ssl=ctx, server_hostname="localhost"
        )
        try:
            w.write(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            await w.drain()
            data = await asyncio.wait_for(r.read(1), scaled(5))  # TLS 1.3: the alert arrives here
            if not data:
                raise ConnectionError("closed by server")
        finally:
            w.close()


def _stamp(t: float) -> str:
    return time.strftime("%Y%m%d%H%M%SZ", time.gmtime(t))


def _h2_hello(port: int, ctx: ssl.SSLContext, session: ssl.SSLSession | None) -> tuple[bool, bool]:
    """One TLS connection that sends HTTP/2's preface: (whether it resumed ``session``, whether
    the relay answered with its SETTINGS); its session stays in ``ctx`` for the next one."""
    raw = socket.create_connection(("127.0.0.1", port), timeout=scaled(10))
    with ctx.wrap_socket(raw, server_hostname="localhost", session=session) as tls:
        try:
            tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes(9))  # preface, SETTINGS
            answered = len(tls.recv(9)) > 0
        except (ConnectionError, ssl.SSLError, TimeoutError):
            answered = False
        _last_session[0] = tls.session
        return bool(tls.session_reused), answered


_last_session: list[ssl.SSLSession | None] = [None]


@pytest.mark.parametrize("version", ["1.2", "1.3"])
async def test_a_resumed_session_whose_client_certificate_expired_since_is_refused(
    pki: Pki, mtls_relay: tuple[Relay, RelayServer], tmp_path: Path, version: str
) -> None:
    """A resumed handshake (a TLS 1.3 ticket, a TLS 1.2 session id) skips OpenSSL's checks of
    the client's certificate: one that expired since its session began was admitted again for
    the ticket's lifetime (two hours). It is refused and counted as a failed handshake."""
    _relay, server = mtls_relay
    life = scaled(4)
    now = time.time()
    ca = (pki.client_ca, pki.client_ca.with_suffix(".key"))
    crt, key = make_dated_leaf(tmp_path, "brief", ca, _stamp(now - 60), _stamp(now + life))
    ctx = client_ssl_context(str(pki.server_ca), str(crt), str(key))
    ctx.maximum_version = ctx.minimum_version = ssl.TLSVersion[f"TLSv{version.replace('.', '_')}"]
    assert await asyncio.to_thread(_h2_hello, server.port, ctx, None) == (False, True)
    session = _last_session[0]
    assert session is not None
    assert await asyncio.to_thread(_h2_hello, server.port, ctx, session) == (True, True)
    failed = server.service.guard_stats()[2].get("tls_handshake", 0)
    await asyncio.sleep(max(0.0, now + life + 1.5 - time.time()))  # expired now
    reused, answered = await asyncio.to_thread(_h2_hello, server.port, ctx, session)
    assert reused and not answered  # resumed by OpenSSL, refused by the relay
    assert server.service.guard_stats()[2].get("tls_handshake", 0) == failed + 1


# ---- context construction & helpers ----


def test_server_context_properties(pki: Pki) -> None:
    plain = server_ssl_context(str(pki.server_cert), str(pki.server_key), None)
    assert plain.verify_mode == ssl.CERT_NONE
    assert plain.minimum_version >= ssl.TLSVersion.TLSv1_2
    mutual = server_ssl_context(str(pki.server_cert), str(pki.server_key), str(pki.client_ca))
    assert mutual.verify_mode == ssl.CERT_REQUIRED
    # only the configured client CA is trusted (no system bundle)
    assert [c["subject"] for c in mutual.get_ca_certs()] == [((("commonName", "client-ca"),),)]


def test_bad_files_raise_typed_errors(pki: Pki, tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.pem")
    with pytest.raises(TlsConfigError):
        server_ssl_context(missing, str(pki.server_key), None)
    with pytest.raises(TlsConfigError):  # key does not match the certificate
        server_ssl_context(str(pki.server_cert), str(pki.client_key), None)
    with pytest.raises(TlsConfigError):
        server_ssl_context(str(pki.server_cert), str(pki.server_key), missing)
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    with pytest.raises(TlsConfigError):
        client_ssl_context(str(garbage))
    with pytest.raises(TlsConfigError):
        client_ssl_context(str(pki.server_ca), key_file=str(pki.client_key))


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("127.0.0.1", True), ("127.8.9.10", True), ("::1", True), ("[::1]", True),
        ("localhost", True), ("LOCALHOST.", True), ("relay.localhost", True),
        ("::ffff:127.0.0.1", True),
        ("0.0.0.0", False), ("::", False), ("", False), ("10.0.0.5", False),
        ("192.168.1.1", False), ("::ffff:10.0.0.1", False), ("relay.example.com", False),
        ("localhost.example.com", False), ("[::]", False),
    ],
)
def test_is_loopback(host: str, expected: bool) -> None:
    assert is_loopback(host) is expected


async def test_inspection_cli_speaks_mtls_with_cert_and_key(
    pki: Pki, mtls_relay: tuple[Relay, RelayServer], capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvrelay watch --ca --cert --key` reaches an mTLS relay; without a certificate it cannot."""
    from kvrelay.client import cli

    relay, server = mtls_relay
    base = ["watch", "catalog", "--relay", f"127.0.0.1:{server.port}", "--json",
            "--ca", str(pki.server_ca)]  # fmt: skip
    rc = await asyncio.to_thread(
        cli.main, [*base, "--count", "1", "--cert", str(pki.client_cert),
                   "--key", str(pki.client_key)],
    )  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    line = next(x for x in out.splitlines() if x.startswith("{"))
    assert f'"relay_incarnation": {relay.relay_incarnation}' in line
    rc = await asyncio.to_thread(cli.main, [*base, "--tls", "--duration", "3"])
    out = capsys.readouterr().out
    assert rc == 1 and '"relay_incarnation"' not in out


def _open_sockets(port: int) -> int:
    """The relay's accepted TCP sockets on ``port`` it has not closed (ESTABLISHED or
    CLOSE_WAIT), from the kernel's table: what a client cannot see of a socket the relay holds."""
    rows = Path("/proc/net/tcp").read_text().splitlines()[1:]
    return sum(
        1 for row in rows
        if int(row.split()[1].split(":")[1], 16) == port and row.split()[3] in ("01", "08")
    )  # fmt: skip


async def test_a_stop_does_not_wait_for_a_tls_client_that_never_closes(pki: Pki) -> None:
    """A stop closes each connection and aborts those still there after ``close_wait_s``. A TLS
    client that never answers the relay's TLS close (grpcio's idle connection after its GOAWAY
    does not) had its socket held by the relay for the TLS layer's 30 s after the stop returned,
    and on Python 3.12, whose asyncio waits for every connection, the stop never returned."""
    ctx = server_ssl_context(str(pki.server_cert), str(pki.server_key), None)
    relay, server = await _serve(ctx)
    server._server.close_wait_s = 0.3
    ctx = client_ssl_context(str(pki.server_ca))  # (the server's is taken by then)

    def connect() -> ssl.SSLSocket:  # handshake, HTTP/2 preface and SETTINGS; then nothing read
        import socket

        tls = ctx.wrap_socket(socket.create_connection(("127.0.0.1", server.port)),
                              server_hostname="localhost")  # fmt: skip
        tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes(3) + b"\x04" + bytes(5))
        return tls

    client = await asyncio.to_thread(connect)
    try:
        await eventually(lambda: _open_sockets(server.port) > 0, 4, "the relay accepts")
        await asyncio.wait_for(server.close(grace_s=0.2), scaled(10))
        await eventually(lambda: _open_sockets(server.port) == 0, 3, "no socket left")
    finally:
        client.close()
        await relay.stop()

