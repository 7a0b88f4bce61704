"""Client certificate revocation (``[tls] client_crl``) with real CRLs and real handshakes.

The PKI and the CRLs come from the ``openssl`` CLI at test time (``tests/support/certs.py``).
Peers: grpclib and grpcio over loopback. Oracles: the call's outcome, OpenSSL's own verify
result (a revoked client is refused, an unrevoked one of the same CA served), the relay's
counters, and ``check-config``'s problems.
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import grpc
import pytest
from grpclib.client import Channel
from h2.config import H2Configuration
from h2.connection import H2Connection

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.ops.config import check_file
from kvrelay.ops.tls import ReloadableServerContext, ServerTlsFiles, client_ssl_context
from kvrelay.ops.worker import TLS_LINE, WorkerControl
from kvrelay.relay.relay import Relay
from kvrelay.relay.settings import RelaySettings
from kvrelay.service.server import RelayServer
from tests.support.certs import Pki, make_ca_twin, make_crl, make_leaf, make_pki
from tests.support.rig import relay_info_at as _info
from tests.support.timing import scaled

MARKER = 0x4B565231


@dataclass(frozen=True)
class Crls:
    pki: Pki
    other: tuple[Path, Path]  # a second client of the client CA, never revoked
    none: Path  # the client CA's CRL revoking nothing
    router: Path  # ... revoking pki.client_cert
    expired: Path  # ... past its nextUpdate
    rogue: Path  # issued by the rogue CA


@pytest.fixture(scope="module")
def crls(tmp_path_factory: pytest.TempPathFactory) -> Crls:
    d = tmp_path_factory.mktemp("crl")
    pki = make_pki(d)
    cca = (pki.client_ca, d / "client-ca.key")
    other = make_leaf(d, "router-b", cca, server=False)
    return Crls(
        pki, other,
        none=make_crl(d, "none", cca),
        router=make_crl(d, "router", cca, [pki.client_cert]),
        expired=make_crl(d, "expired", cca, last_update="20200101000000Z",
                         next_update="20200102000000Z"),
        rogue=make_crl(d, "rogue", (d / "rogue-ca.crt", d / "rogue-ca.key")),
    )  # fmt: skip


def _ctx(c: Crls, client: tuple[Path, Path]) -> ssl.SSLContext:
    return client_ssl_context(str(c.pki.server_ca), str(client[0]), str(client[1]))


async def _until(what: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + scaled(timeout)
    while not what():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


def _files(c: Crls, crl: Path) -> ServerTlsFiles:
    p = c.pki
    return ServerTlsFiles(str(p.server_cert), str(p.server_key), str(p.client_ca), str(crl))


async def _serving(
    c: Crls, crl: Path, body: Callable[[RelayServer, ReloadableServerContext], Awaitable[None]]
) -> None:
    """A relay served over mTLS with ``crl``, checked as the daemon and the workers check it."""
    tls = ReloadableServerContext(_files(c, crl))
    relay = Relay(RelaySettings(dc_name="dc-crl"))
    await relay.start()
    server = RelayServer(relay, relay.limits)
    try:
        await server.start("127.0.0.1", 0, ssl=tls.in_use)
        server.revoke(tls.is_revoked)
        await body(server, tls)
    finally:
        await server.close(grace_s=0.5)
        await relay.stop()


async def test_a_revoked_client_is_refused_at_the_handshake_and_counted(
    crls: Crls, official_pb2: dict[str, ModuleType]
) -> None:
    p = crls.pki

    async def body(server: RelayServer, _tls: ReloadableServerContext) -> None:
        counted = server.service.h2_counters.closed
        assert (await _info(server.port, _ctx(crls, crls.other))).relay is not None
        with pytest.raises((Exception,)):
            await _info(server.port, _ctx(crls, (p.client_cert, p.client_key)))
        await _until(lambda: counted.get("tls_revoked_handshake") == 1)
        creds = grpc.ssl_channel_credentials(
            root_certificates=p.server_ca.read_bytes(), private_key=p.client_key.read_bytes(),
            certificate_chain=p.client_cert.read_bytes(),
        )  # fmt: skip
        async with grpc.aio.secure_channel(f"127.0.0.1:{server.port}", creds) as ch:
            stub = official_pb2["relay_grpc"].KvEventRelayStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.GetRelayInfo(
                    official_pb2["relay"].RelayInfoRequest(contract_marker=MARKER),
                    timeout=scaled(10),
                )
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        await _until(lambda: counted.get("tls_revoked_handshake") == 2)
        assert counted["tls_handshake"] == 2
        assert (await _info(server.port, _ctx(crls, crls.other))).relay is not None

    await _serving(crls, crls.router, body)


async def test_a_reload_that_revokes_a_client_ends_its_streams_unauthenticated(
    crls: Crls, official_pb2: dict[str, ModuleType]
) -> None:
    """The worker's reload line (the daemon's reload does the same): the new CRL is loaded and
    every stream of the connection whose certificate it revokes ends UNAUTHENTICATED with the
    reason (a relay stream and a health watch, on one grpcio connection), before the close;
    another client's connection stays."""
    from grpclib.health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse

    p = crls.pki
    creds = grpc.ssl_channel_credentials(
        root_certificates=p.server_ca.read_bytes(), private_key=p.client_key.read_bytes(),
        certificate_chain=p.client_cert.read_bytes(),
    )  # fmt: skip

    async def body(server: RelayServer, tls: ReloadableServerContext) -> None:
        control = WorkerControl(None, server=server, tls=tls)
        relay = official_pb2["relay"]
        request = relay.WatchKvPoolCatalogRequest(subscriber_id="crl", contract_marker=MARKER)
        async with grpc.aio.secure_channel(f"127.0.0.1:{server.port}", creds) as revoked, \
                Channel("127.0.0.1", server.port, ssl=_ctx(crls, crls.other)) as kept:  # fmt: skip
            catalog = official_pb2["relay_grpc"].KvEventRelayStub(revoked).WatchKvPoolCatalog(
                request
            )
            watch = revoked.unary_stream(
                "/grpc.health.v1.Health/Watch",
                request_serializer=HealthCheckRequest.SerializeToString,
                response_deserializer=HealthCheckResponse.FromString,
            )(HealthCheckRequest())
            for stream in (catalog, watch):
                assert await asyncio.wait_for(stream.read(), scaled(10)) is not None
            control.line(TLS_LINE + json.dumps(_files(crls, crls.router).as_json()))
            for stream in (catalog, watch):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    while True:
                        await asyncio.wait_for(stream.read(), scaled(10))
                assert (err.value.code(), err.value.details()) == (
                    grpc.StatusCode.UNAUTHENTICATED, "client certificate revoked"
                )
            assert server.service.h2_counters.closed.get("tls_revoked_open") == 1
            info = await asyncio.wait_for(
                pb.KvEventRelayStub(kept).get_relay_info(
                    pb.RelayInfoRequest(contract_marker=MARKER)
                ),
                scaled(10),
            )
            assert info.relay is not None

    await _serving(crls, crls.none, body)


def _silent_client(port: int, ctx: ssl.SSLContext, done: threading.Event) -> None:
    """A client that opens a catalog stream and then reads nothing, not even the TLS close."""
    with socket.create_connection(("127.0.0.1", port)) as raw, \
            ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:  # fmt: skip
        h2 = H2Connection(H2Configuration(client_side=True))
        h2.initiate_connection()
        h2.send_headers(1, [(":method", "POST"), (":scheme", "https"), (":authority", "relay"),
                            (":path", "/dynamo.kvrelay.v1.KvEventRelay/WatchKvPoolCatalog"),
                            ("content-type", "application/grpc"), ("te", "trailers")])  # fmt: skip
        body = bytes(pb.WatchKvPoolCatalogRequest(subscriber_id="mute", contract_marker=MARKER))
        h2.send_data(1, b"\x00" + len(body).to_bytes(4, "big") + body)
        tls.sendall(h2.data_to_send())
        done.wait(30)


async def test_a_revoked_client_that_reads_nothing_does_not_hold_its_connection(
    crls: Crls,
) -> None:
    """The revoked connection of a client that reads nothing (so it never answers the TLS
    close) is aborted ``revoked_close_s`` after the reload, not held for the TLS layer's 30 s."""
    p = crls.pki

    async def body(server: RelayServer, tls: ReloadableServerContext) -> None:
        server._server.revoked_close_s = 0.3
        caps = server._server.connection_caps
        assert caps is not None
        done = threading.Event()
        client = asyncio.ensure_future(asyncio.to_thread(
            _silent_client, server.port, _ctx(crls, (p.client_cert, p.client_key)), done
        ))  # fmt: skip
        try:
            await _until(lambda: server.service.catalog_permits.in_use == 1)
            tls.reload(_files(crls, crls.router))
            assert server.revoke(tls.is_revoked) == 1
            await _until(lambda: caps.open == 0, timeout=3)
        finally:
            done.set()
            await client

    await _serving(crls, crls.none, body)


def test_a_name_encoded_otherwise_is_the_same_issuer(crls: Crls, tmp_path: Path) -> None:
    """OpenSSL matches names as RFC 5280 §7.1 does (string types, case and spaces aside): a CRL
    or a client certificate whose issuer names the client CA as a PrintableString of other case
    is the CA's. The relay compared the names' bytes: such a CRL's revocations never ended the
    open connections they name, and ``check-config`` refused such a CRL as issued by no CA."""
    p = crls.pki
    ca = (p.client_ca, p.client_ca.parent / "client-ca.key")
    twin = make_ca_twin(tmp_path, "twin", ca, "CLIENT-CA")
    erin = make_leaf(tmp_path, "erin", twin, server=False)  # issuer: PrintableString CLIENT-CA
    erin_der = ssl.PEM_cert_to_DER_cert(erin[0].read_text())
    by_ca = make_crl(tmp_path, "by-ca", ca, [erin[0]])  # issuer: the CA's own UTF8String
    tls = ReloadableServerContext(_files(crls, by_ca))
    assert tls.is_revoked(erin_der)  # what a reload asks of each open connection
    router_der = ssl.PEM_cert_to_DER_cert(p.client_cert.read_text())
    assert not tls.is_revoked(router_der)
    by_twin = make_crl(tmp_path, "by-twin", twin, [p.client_cert])
    assert ReloadableServerContext(_files(crls, by_twin)).is_revoked(router_der)
    cfg, problems = check_file(_config(tmp_path, p, f'client_ca = "{p.client_ca}"\n'
                                                    f'client_crl = "{by_twin}"\n'), env={})
    assert cfg is not None and [x for x in problems if x.path == "tls.client_crl"] == []


def _config(tmp_path: Path, p: Pki, tls: str) -> Path:
    path = tmp_path / "kvrelay.toml"
    path.write_text(
        '[relay]\ndc_name = "dc"\n[[pools]]\nnamespace = "ns"\ncomponent = "c"\n'
        'endpoint = "e"\n[[pools.engines]]\nname = "e0"\nhost = "127.0.0.1"\n'
        "grpc_port = 50051\n"
        f'[tls]\ncert = "{p.server_cert}"\nkey = "{p.server_key}"\n{tls}'
    )
    return path


def test_check_config_loads_the_crl_and_says_what_is_wrong_with_it(
    crls: Crls, tmp_path: Path
) -> None:
    p = crls.pki
    ca = f'client_ca = "{p.client_ca}"\n'

    def errors(tls: str, env: dict[str, str] | None = None) -> list[str]:
        cfg, problems = check_file(_config(tmp_path, p, tls), env=env or {})
        found = [f"{x.path}: {x.reason}" for x in problems if x.severity == "error"]
        assert (cfg is None) == bool(found), problems
        return found

    assert errors(ca + f'client_crl = "{crls.router}"\n') == []
    cfg, _ = check_file(_config(tmp_path, p, ca), env={"KVRELAY_TLS_CLIENT_CRL": str(crls.router)})
    assert cfg is not None and cfg.tls.client_crl == str(crls.router)
    [e] = errors(f'client_crl = "{crls.router}"\n')
    assert e.startswith("tls.client_crl: needs tls.client_ca")
    [e] = errors(ca + f'client_crl = "{crls.expired}"\n')
    assert e.startswith("tls.client_crl: CRL 1 (issuer CN 'client-ca') expired at 2020-01-02")
    [e] = errors(ca + f'client_crl = "{crls.rogue}"\n')
    assert "'rogue-ca') was not issued by any CA in client_ca" in e
    [e] = errors(ca + f'client_crl = "{p.client_ca}"\n')  # a certificate, not a CRL
    assert e.startswith("tls.client_crl:") and "no PEM CRL" in e
    # a CA of the bundle without a CRL: its clients would all be refused
    bundle = tmp_path / "bundle.crt"
    rogue_ca = p.client_ca.parent / "rogue-ca.crt"
    bundle.write_bytes(p.client_ca.read_bytes() + rogue_ca.read_bytes())
    cfg, problems = check_file(
        _config(tmp_path, p, f'client_ca = "{bundle}"\nclient_crl = "{crls.router}"\n'), env={}
    )
    assert cfg is not None
    [w] = [x for x in problems if x.path == "tls.client_crl"]
    assert w.severity == "warning" and "no CRL for client CA 'rogue-ca'" in w.reason
