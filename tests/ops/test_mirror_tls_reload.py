"""A mirror's reload rotates its certificates without a restart, with real certificates.

A mirror (``kvrelay serve`` with a ``[mirror]`` section) rejected every reload but one of its
``[[authorization]]`` rules: a rotated listener certificate, a fresh client CRL or a renewed
upstream client certificate waited for a restart, which ends every router's streams. Now its
reload reads the listener's files as a relay's does (workers too), ends the connections a new
CRL revokes, and reads the upstream client files for its next upstream connection.

The PKI and CRLs come from the ``openssl`` CLI at test time (``tests/support/certs.py``); the
upstream is a real ``RelayServer`` on loopback; the routers are grpclib channels over TLS.
Oracles: which CA verifies the listener's certificate, whether open streams still receive the
upstream's catalog changes, which client certificate the upstream saw at each handshake.
"""

from __future__ import annotations

import asyncio
import shutil
import ssl
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from grpclib.client import Channel
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from benchmarks._common import free_port
from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.client import rpc
from kvrelay.ops.config import load_config
from kvrelay.ops.daemon import Daemon
from kvrelay.ops.sdnotify import Notifier
from kvrelay.ops.tls import ReloadableServerContext, ServerTlsFiles, client_ssl_context
from kvrelay.service.server import RelayServer
from tests.support.certs import make_ca, make_crl, make_leaf
from tests.support.mem_relay import MemRelayView
from tests.support.mirror_rig import QUIET_WINDOW_MS
from tests.support.rig import relay_info_at as _info
from tests.support.timing import scaled

MARKER = 0x4B565231
Pair = tuple[Path, Path]


@dataclass(frozen=True)
class Certs:
    server_ca_old: Path
    server_old: Pair
    server_ca_new: Path
    server_new: Pair
    client_ca: Path
    router: Pair  # revoked by ``crl_router``
    router_b: Pair
    crl_none: Path
    crl_router: Path
    mirror_old: Pair  # the mirror's upstream client certificate, then its renewals
    mirror_new: Pair
    mirror_third: Pair


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    d = tmp_path_factory.mktemp("mirror-tls")
    sca_old, sca_new, cca = make_ca(d, "sca-old"), make_ca(d, "sca-new"), make_ca(d, "cca")
    router = make_leaf(d, "router", cca, server=False)
    return Certs(
        sca_old[0], make_leaf(d, "relay-old", sca_old, server=True),
        sca_new[0], make_leaf(d, "relay-new", sca_new, server=True),
        cca[0], router, make_leaf(d, "router-b", cca, server=False),
        make_crl(d, "none", cca), make_crl(d, "router", cca, [router[0]]),
        make_leaf(d, "mirror-old", cca, server=False),
        make_leaf(d, "mirror-new", cca, server=False),
        make_leaf(d, "mirror-third", cca, server=False),
    )  # fmt: skip


def _ctx(ca: Path, client: Pair | None = None) -> ssl.SSLContext:
    if client is None:
        return client_ssl_context(str(ca))
    return client_ssl_context(str(ca), str(client[0]), str(client[1]))


async def _eventually(check: Callable[[], Any], what: str, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + scaled(timeout)
    while True:
        try:
            if await check():
                return
        except Exception:
            pass
        assert asyncio.get_running_loop().time() < deadline, f"timed out: {what}"
        await asyncio.sleep(0.05)


def _catalog(ch: Channel, who: str) -> AsyncIterator[pb.KvPoolCatalogUpdate]:
    request = pb.WatchKvPoolCatalogRequest(subscriber_id=who, contract_marker=MARKER)
    stream: AsyncIterator[pb.KvPoolCatalogUpdate]
    stream = pb.KvEventRelayStub(ch).watch_kv_pool_catalog(request)
    return stream


async def _pools(stream: AsyncIterator[pb.KvPoolCatalogUpdate], n: int) -> None:
    """Read the stream until its catalog lists ``n`` pools (the upstream's changes reach it)."""
    async with asyncio.timeout(scaled(10)):
        while True:
            msg = await anext(stream)
            if msg.snapshot is not None and len(msg.snapshot.pools) == n:
                return


def _mirror_file(path: Path, body: str) -> Path:
    path.write_text(f"""
[relay]
bind = "127.0.0.1:0"
{body}
[metrics]
enabled = false
""")
    return path


@pytest.mark.parametrize("workers", [1, 2])
async def test_a_mirror_reload_rotates_its_listener_certificate_and_applies_a_new_crl(
    certs: Certs, tmp_path: Path, workers: int
) -> None:
    """cert-manager style: new files at the same paths, then a reload. A new client gets the
    new certificate while the routers' open streams go on; then a new CRL ends the revoked
    router's connection, the other router's stream still following the upstream. With
    ``workers = 2`` the fan-out worker, which terminates the clients' TLS, does it."""
    cert, key, crl = tmp_path / "tls.crt", tmp_path / "tls.key", tmp_path / "clients.crl"
    shutil.copy(certs.server_old[0], cert)
    shutil.copy(certs.server_old[1], key)
    shutil.copy(certs.crl_none, crl)
    view = MemRelayView(window_ms=QUIET_WINDOW_MS)
    view.add_pool("p1", 4096)
    upstream = RelayServer(view)
    await upstream.start("127.0.0.1", 0)
    path = _mirror_file(tmp_path / "mirror.toml", f"""
workers = {workers}
[mirror]
upstream = "127.0.0.1:{upstream.port}"
[tls]
cert = "{cert}"
key = "{key}"
client_ca = "{certs.client_ca}"
client_crl = "{crl}"
""")
    daemon = Daemon(load_config(path), Notifier({}), config_path=path)
    try:
        await daemon.start()
        port = daemon.grpc_port
        assert daemon.mirror is not None and port is not None
        async with Channel("127.0.0.1", port, ssl=_ctx(certs.server_ca_old, certs.router)) as a, \
                Channel("127.0.0.1", port,
                        ssl=_ctx(certs.server_ca_old, certs.router_b)) as b:  # fmt: skip
            stream_a, stream_b = _catalog(a, "router-a"), _catalog(b, "router-b")
            await _pools(stream_a, 1)
            await _pools(stream_b, 1)
            shutil.copy(certs.server_new[0], cert)
            shutil.copy(certs.server_new[1], key)
            result = await daemon.reload(path)
            assert result.result == "applied" and result.restart_required == ()
            assert daemon.reloads.applied == 1 and daemon.reloads.last_successful
            new = _ctx(certs.server_ca_new, certs.router_b)
            await _eventually(lambda: _info(port, new), "the new certificate served")
            with pytest.raises(ssl.SSLCertVerificationError):
                await _info(port, _ctx(certs.server_ca_old, certs.router_b))
            view.add_pool("p2", 4096)  # the open streams go on: they see the upstream change
            await _pools(stream_a, 2)
            await _pools(stream_b, 2)
            assert {c.subject for c in daemon.tls_certificates() if c.role == "server"} == {
                "relay-new"
            }

            shutil.copy(certs.crl_router, crl)
            assert (await daemon.reload(path)).result == "applied"
            with pytest.raises(GRPCError) as ended:  # its status, before the close
                async with asyncio.timeout(scaled(10)):
                    async for _ in stream_a:
                        pass
            assert (ended.value.status, ended.value.message) == (
                Status.UNAUTHENTICATED, "client certificate revoked"
            )
            view.add_pool("p3", 4096)
            await _pools(stream_b, 3)  # the other router's stream is untouched
            with pytest.raises(Exception):  # noqa: B017 (refused at the handshake)
                await _info(port, _ctx(certs.server_ca_new, certs.router))
    finally:
        await daemon.stop()
        await upstream.close(grace_s=0.5)


async def test_a_mirror_reload_reads_its_upstream_client_files_for_the_next_connection(
    certs: Certs, tmp_path: Path
) -> None:
    """The renewed client certificate is read by the reload; the running upstream connection
    goes on with the old one; once the upstream revokes the old certificate (closing that
    connection), the mirror's next handshake presents the new one and it follows again. A
    change the mirror cannot take live is kept as it runs and named (restart required)."""
    cert, key = tmp_path / "client.crt", tmp_path / "client.key"
    shutil.copy(certs.mirror_old[0], cert)
    shutil.copy(certs.mirror_old[1], key)
    der = {
        ssl.PEM_cert_to_DER_cert(p[0].read_text()): p[0].stem
        for p in (certs.mirror_old, certs.mirror_new)
    }
    seen: list[str] = []  # the upstream's handshakes: whose client certificate

    def record(peer: bytes) -> bool:
        seen.append(der.get(peer, "?"))
        return False

    upstream, view = await _mtls_upstream(certs, record, "p1")
    body = _upstream_section(upstream, certs, cert, key)
    path = _mirror_file(tmp_path / "mirror.toml", body)
    daemon = Daemon(load_config(path), Notifier({}), config_path=path)
    try:
        await daemon.start()
        port = daemon.grpc_port
        assert port is not None and set(seen) == {"mirror-old"}
        async with Channel("127.0.0.1", port) as ch:
            stream = _catalog(ch, "router")
            await _pools(stream, 1)
            shutil.copy(certs.mirror_new[0], cert)
            shutil.copy(certs.mirror_new[1], key)
            _mirror_file(path, body.replace("[mirror]", "[mirror]\nsync_wait_s = 3.0"))
            result = await daemon.reload(path)
            assert result.result == "applied"
            assert result.restart_required == ("mirror.sync_wait_s",)
            assert daemon.cfg.mirror is not None and daemon.cfg.mirror.sync_wait_s == 10.0
            roles = {c.role: c.subject for c in daemon.tls_certificates()}
            assert roles["upstream_client"] == "mirror-new"
            view.add_pool("p2", 4096)  # the running upstream connection goes on
            await _pools(stream, 2)
            assert set(seen) == {"mirror-old"}
            old_der = next(d for d, n in der.items() if n == "mirror-old")
            closed = upstream.revoke(lambda peer: record(peer) or peer == old_der)
            assert closed >= 1
            view.add_pool("p3", 4096)

            async def follows() -> bool:  # (its planes are down until it has reconnected)
                async with Channel("127.0.0.1", port) as again:
                    await _pools(_catalog(again, "router-2"), 3)
                return True

            await _eventually(follows, "the mirror following its upstream again")
            assert "mirror-new" in seen  # (its channel replaced, or reconnected: either way)
    finally:
        await daemon.stop()
        await upstream.close(grace_s=0.5)


async def _mtls_upstream(
    certs: Certs, check: Any, *pools: str
) -> tuple[RelayServer, MemRelayView]:
    """An upstream relay over mTLS serving ``pools`` (its view, to add more), whose client
    certificates ``check`` says are revoked (asked at each handshake, and of the open
    connections at each ``revoke``)."""
    view = MemRelayView(window_ms=QUIET_WINDOW_MS)
    for pool in pools:
        view.add_pool(pool, 4096)
    upstream = RelayServer(view)
    tls = ReloadableServerContext(
        ServerTlsFiles(str(certs.server_old[0]), str(certs.server_old[1]), str(certs.client_ca))
    )
    await upstream.start("127.0.0.1", 0, ssl=tls.in_use)
    upstream.revoke(check)
    return upstream, view


def _upstream_section(upstream: RelayServer, certs: Certs, cert: Path, key: Path) -> str:
    return f"""
[mirror]
upstream = "127.0.0.1:{upstream.port}"
tls_ca = "{certs.server_ca_old}"
tls_cert = "{cert}"
tls_key = "{key}"
"""


async def test_a_mirror_reconnecting_in_the_same_channel_presents_its_renewed_certificate(
    certs: Certs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two renewals, each followed by the upstream revoking the certificate it replaced (which
    ends the connection). The mirror's pool streams, live long enough to resubscribe at once,
    reconnect the channel they ran on before any other stream could replace it (after the
    first renewal they are its first streams, so the first to learn the connection ended).
    That handshake presented the certificate of the channel's creation, revoked, and was
    refused (the pools failed once more); now every handshake presents the one in use."""
    monkeypatch.setattr(rpc, "LIVE_RESUBSCRIBE_S", 0.3)  # (the rule, sooner: a faster test)
    cert, key = tmp_path / "client.crt", tmp_path / "client.key"
    shutil.copy(certs.mirror_old[0], cert)
    shutil.copy(certs.mirror_old[1], key)
    chain = (certs.mirror_old, certs.mirror_new, certs.mirror_third)
    der = {ssl.PEM_cert_to_DER_cert(p[0].read_text()): p[0].stem for p in chain}
    revoked: set[bytes] = set()
    refused: list[str] = []  # handshakes that presented a revoked certificate
    sweeping = False  # (``revoke`` also asks about the open connections: not handshakes)

    def check(peer: bytes) -> bool:
        if peer in revoked and not sweeping:
            refused.append(der.get(peer, "?"))
        return peer in revoked

    upstream, _view = await _mtls_upstream(certs, check, "p1", "p2")
    path = _mirror_file(tmp_path / "mirror.toml", _upstream_section(upstream, certs, cert, key))
    daemon = Daemon(load_config(path), Notifier({}), config_path=path)

    def installs() -> int:
        assert daemon.mirror is not None
        pools = daemon.mirror.stats()["pools"].values()
        return sum(p["installs"] for p in pools) if len(pools) == 2 else 0

    async def live_again(before: int) -> None:
        """Both pools installed a snapshot since ``before``, and lived long enough that their
        streams resubscribe at once when they end (``rpc.lived``)."""
        await _eventually(lambda: _true(installs() >= before + 2), "the pools live again")
        await asyncio.sleep(rpc.LIVE_RESUBSCRIBE_S + 0.1)

    try:
        await daemon.start()
        assert daemon.mirror is not None
        await live_again(0)
        for renewed, replaced in ((certs.mirror_new, certs.mirror_old),
                                  (certs.mirror_third, certs.mirror_new)):  # fmt: skip
            shutil.copy(renewed[0], cert)
            shutil.copy(renewed[1], key)
            assert (await daemon.reload(path)).result == "applied"
            revoked.add(ssl.PEM_cert_to_DER_cert(replaced[0].read_text()))
            before, sweeping = installs(), True
            try:
                assert upstream.revoke(check) >= 1  # the mirror's connection, closed
            finally:
                sweeping = False
            await live_again(before)
        assert refused == []
    finally:
        await daemon.stop()
        await upstream.close(grace_s=0.5)


async def _true(value: bool) -> bool:
    return value


async def test_a_relay_whose_file_became_a_mirrors_keeps_its_pools(tmp_path: Path) -> None:
    """A relay turned into a mirror waits for a restart: a reload of such a file (a ``[mirror]``
    section, so no ``[[pools]]``) used to apply its empty pool list, withdrawing every pool of
    the running relay; now the relay keeps them and names ``mirror`` as restart-required."""
    closed = free_port()  # an engine that never answers: its pool is configured, not served
    path = tmp_path / "kvrelay.toml"
    path.write_text(f"""
[relay]
dc_name = "dc"
bind = "127.0.0.1:0"
[metrics]
enabled = false
[[pools]]
namespace = "ns"
component = "c"
endpoint = "e"
[[pools.engines]]
name = "e0"
host = "127.0.0.1"
grpc_port = {closed}
""")
    daemon = Daemon(load_config(path), Notifier({}), config_path=path)
    try:
        await daemon.start()
        pools = [p.name for p in daemon.relay.pools]
        assert len(pools) == 1
        _mirror_file(path, f'[mirror]\nupstream = "127.0.0.1:{closed}"\n')
        result = await daemon.reload(path)
        assert result.result == "applied" and "mirror" in result.restart_required
        assert [p.name for p in daemon.relay.pools] == pools
        assert daemon.cfg.mirror is None and len(daemon.cfg.relay.pools) == 1
    finally:
        await daemon.stop()
