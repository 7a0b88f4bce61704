"""Parity of the three ways kvrelay serves a router: a relay directly, a mirror in front of a
relay, and a ``workers = N`` fan-out worker (a mirror of the ingest process over its UNIX
socket, accepting on a shared listener). A router must not be able to tell them apart: the
per-plane stream limits (the refusal over a limit, its shares, a freed place taken again) and
``[[authorization]]`` (what each client's planes list, what every RPC answers) and a restart
of the relay (how each stream ends, what the old and the new key get) must give the same
answers in all three.

One module-scoped setup serves every mode at once (``start_served``, the contract tests'
three-mode rig, and ``start_worker``, the worker's own ``run_worker``, each with mutual TLS
and rules on the serving server), so each case asks all three the same questions and compares
the answers with each other and with the oracle written out by hand below. The upstream of a
mirror has no rules: the mirror's own apply to its clients. The restart case starts its own
plaintext setups, since it replaces the relay.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from grpclib.client import Channel, Stream
from grpclib.const import Cardinality, Status
from grpclib.exceptions import GRPCError
from grpclib.protocol import H2Protocol

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.contract.limits import PermitCounter, RelayLimits
from kvrelay.ops.tls import ServerTlsFiles, client_ssl_context, server_ssl_context
from kvrelay.service.authz import Authorization, AuthorizationRule
from kvrelay.service.server import RelayServer
from tests.service.conftest import SERVED
from tests.support.certs import make_ca, make_leaf
from tests.support.fleet import eventually
from tests.support.mem_relay import (
    MARKER,
    SVC,
    Generation,
    MemRelayView,
    StreamResult,
    add_team_pools,
    endpoint,
    grpclib_collect,
    make_producer,
    pool_call,
    sub_request,
)
from tests.support.mirror_rig import (
    close_served,
    restart_source,
    settle,
    start_served,
    start_worker,
)
from tests.support.timing import scaled

pytestmark = pytest.mark.asyncio(loop_scope="module")

TEAM_A = "spiffe://cluster.local/ns/team-a/sa/router"
RULES = (
    AuthorizationRule(uri=("spiffe://cluster.local/ns/team-a/*",), namespaces=("team-a",)),
    AuthorizationRule(dns=("router.team-b.svc",), pools=("team-b/router/*",)),
)
#: client → the pools its rules select (the oracle); "nobody" matches no rule
SEES = {"a": {"a1", "a2"}, "b": {"b1"}, "nobody": set()}
#: each plane's limit in every mode (the relay-wide one; shares: 50 % per connection, 75 % per
#: peer address, so one loopback connection holds at most 1 of 2 once full, one address 2)
LIMIT = 2
LIMITS = RelayLimits(
    max_catalog_subscribers=LIMIT,
    max_readiness_subscribers=LIMIT,
    max_load_subscribers=LIMIT,
)

#: plane → (RPC, request, reply, the permit counter's name in the service)
PLANES: dict[str, tuple[str, type, type, str]] = {
    "catalog": ("WatchKvPoolCatalog", pb.WatchKvPoolCatalogRequest, pb.KvPoolCatalogUpdate,
                "catalog_permits"),
    "readiness": ("SubscribeServingReadiness", pb.SubscribeServingReadinessRequest,
                  pb.ServingReadinessUpdate, "readiness_permits"),
    "load": ("SubscribeKvPoolLoad", pb.SubscribeKvPoolLoadRequest, pb.KvPoolLoadUpdate,
             "load_permits"),
    "serving_load": ("SubscribeServingLoad", pb.SubscribeServingLoadRequest,
                     pb.ServingLoadUpdate, "serving_load_permits"),
}  # fmt: skip
REASON = "kv-relay-error-reason"
#: The window planes' stated period: the views publish no further window, and a mirror drops an
#: upstream window stream silent for three periods (then refuses its readers until it is back)
QUIET_WINDOW_MS = 600_000


def _quiet_windows(view: MemRelayView) -> None:
    """The next load and serving-load windows, stating ``QUIET_WINDOW_MS``."""
    for plane, make in ((view.load, view.load_msg), (view.serving_load, view.serving_load_msg)):
        window = plane.current()[0] + 1
        msg = make(window)
        msg.window_ms = QUIET_WINDOW_MS
        plane.publish(msg, window)  # type: ignore[arg-type]


@dataclass
class Served:
    mode: str
    view: MemRelayView
    server: RelayServer
    pools: dict[str, Generation]
    contexts: dict[str, ssl.SSLContext]

    def channel(self, who: str, source: str | None = None) -> Channel:
        """A client's channel; ``source``: from that loopback address (another peer)."""
        if source is None:
            return Channel("127.0.0.1", self.server.port, ssl=self.contexts[who])
        return _From(source, "127.0.0.1", self.server.port, ssl=self.contexts[who])

    def permits(self, plane: str) -> PermitCounter:
        counter: PermitCounter = getattr(self.server.service, PLANES[plane][3])
        return counter


class _From(Channel):
    """A grpclib channel whose connections come from ``source``."""

    def __init__(self, source: str, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._source = source

    async def _create_connection(self) -> H2Protocol:
        _, protocol = await self._loop.create_connection(
            self._protocol_factory, self._host, self._port, ssl=self._ssl,
            local_addr=(self._source, 0),
        )  # fmt: skip
        return protocol


def _populate(view: MemRelayView) -> dict[str, Generation]:
    """Pools a1, a2 of team A and b1 of team B, and a message on every plane that names them."""
    pools = add_team_pools(view)

    def entry(ns: str, *members: str) -> pb.TopologyEntry:
        return pb.TopologyEntry(
            namespace=ns, canonical_model_id="m", state=pb.ServingReadinessState.READY,
            present_roles=[pb.WorkerRole.AGGREGATED],
            members=[pb.TopologyMember(endpoint=endpoint(m), roles=[pb.WorkerRole.AGGREGATED])
                     for m in members],
        )  # fmt: skip

    view.readiness.publish(view.readiness_msg(3, [
        entry("team-a", "team-a/router/generate"), entry("team-b", "team-b/router/generate"),
    ]), 3)  # fmt: skip
    load = view.load_msg(4, used=9)
    load.window_ms = QUIET_WINDOW_MS
    view.load.publish(load, 4)
    sl = view.serving_load_msg(5)
    sl.window_ms = QUIET_WINDOW_MS
    sl.models = [
        pb.ModelServingLoad(
            namespace=ns, canonical_model_id=model, load=pb.LoadView(status=1),
            deployment=pb.ModelDeploymentStatus(
                serving_pools=[pools[p].producer.pool_id for p in of]  # type: ignore[misc]
            ),
        )
        for ns, model, of in (("team-a", "m", ("a1",)), ("team-a", "mixed", ("a1", "b1")),
                              ("team-b", "m", ("b1",)))
    ]  # fmt: skip
    view.serving_load.publish(sl, 5)
    return pools


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> tuple[ServerTlsFiles, dict[str, Any]]:
    """The serving server's TLS files, and each client's context."""
    d: Path = tmp_path_factory.mktemp("parity-pki")
    sca, cca = make_ca(d, "server-ca"), make_ca(d, "client-ca")
    leaves = {
        "a": make_leaf(d, "router-a", cca, server=False, sans=(f"URI:{TEAM_A}",)),
        "b": make_leaf(d, "router-b", cca, server=False, sans=("DNS:router.team-b.svc",)),
        "nobody": make_leaf(d, "nobody", cca, server=False),
    }
    crt, key = make_leaf(d, "relay", sca, server=True)
    return ServerTlsFiles(str(crt), str(key), str(cca[0])), {
        who: client_ssl_context(str(sca[0]), str(crt), str(key))
        for who, (crt, key) in leaves.items()
    }


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(
    pki: tuple[ServerTlsFiles, dict[str, ssl.SSLContext]],
) -> AsyncIterator[dict[str, Served]]:
    """Every mode at once, started once for the module; ``workers`` runs the worker's own code
    (``run_worker``, given its JSON spec) in this process."""
    files, clients = pki
    cleanup: list[Any] = []
    out: dict[str, Served] = {}
    try:
        for mode in SERVED:
            if mode == "workers":
                view, server = await start_worker(LIMITS, cleanup, tls=files, rules=RULES)
            else:
                view, server = await start_served(
                    mode, LIMITS, cleanup, authorization=Authorization(RULES),
                    ssl=server_ssl_context(files.cert, files.key, files.client_ca),
                )  # fmt: skip
            pools = _populate(view)
            await settle(view, server)
            out[mode] = Served(mode, view, server, pools, clients)
        yield out
    finally:
        await close_served(cleanup)


@pytest_asyncio.fixture(loop_scope="module")
async def idle(served: dict[str, Served]) -> AsyncIterator[dict[str, Served]]:
    """The setup with no plane stream held, before and after each case (they share it)."""

    def no_streams() -> bool:
        return all(s.permits(p).in_use == 0 for s in served.values() for p in PLANES)

    await eventually(no_streams, what="no plane stream held")
    yield served
    await eventually(no_streams, what="every plane stream released")


def _answer(res: StreamResult) -> tuple[Any, str | None, str | None]:
    """What a refused stream tells its router."""
    return res.status, res.message, res.trailers.get(REASON)


class Held:
    """Plane streams kept open, each past its first message."""

    def __init__(self, stack: contextlib.AsyncExitStack) -> None:
        self.stack = stack
        self.streams: list[Stream[Any, Any]] = []

    async def open(self, ch: Channel, plane: str) -> Any:
        method, request, reply, _ = PLANES[plane]
        st: Stream[Any, Any] = await self.stack.enter_async_context(
            ch.request(SVC + method, Cardinality.UNARY_STREAM, request, reply)
        )
        await st.send_message(request(subscriber_id="r", contract_marker=MARKER), end=True)
        self.stack.push_async_callback(self.close, st)  # (runs before the stream's own exit)
        first = await asyncio.wait_for(st.recv_message(), scaled(10))
        assert first is not None, plane
        self.streams.append(st)
        return first

    async def close(self, st: Stream[Any, Any]) -> None:
        """Reset the stream unless it ended (an open plane stream has no trailers to wait
        for)."""
        if not (st._cancel_done or st._recv_trailing_metadata_done
                or st._stream._transport.is_closing()):  # fmt: skip
            await st.cancel()


async def _refusal(ch: Channel, plane: str) -> tuple[Any, str | None, str | None]:
    method, request, reply, _ = PLANES[plane]
    res = await grpclib_collect(
        ch, method, request(subscriber_id="r", contract_marker=MARKER), reply, limit=1
    )
    assert not res.messages, (plane, res)
    return _answer(res)


async def _limits_seen(s: Served, plane: str) -> dict[str, Any]:
    """Fill ``plane`` from one connection, ask for more from it and from another connection of
    the same address, make room from another address, free one place and take it again."""
    out: dict[str, Any] = {}
    async with asyncio.timeout(scaled(30)), contextlib.AsyncExitStack() as stack:
        one = await stack.enter_async_context(s.channel("a"))
        other = await stack.enter_async_context(s.channel("b"))
        held = Held(stack)
        for _ in range(LIMIT):
            await held.open(one, plane)
        out["same connection"] = await _refusal(one, plane)
        out["same address"] = await _refusal(other, plane)
        # another address makes room: the newest stream of the connection furthest over its
        # share ends, the newcomer takes its place
        stranger = await stack.enter_async_context(s.channel("a", source="127.0.0.2"))
        await held.open(stranger, plane)
        out["preempted"] = await _end_of(held.streams[LIMIT - 1])
        if plane == "load":  # its own count under the same bound: serving-load still admits
            await held.open(other, "serving_load")
        await held.close(held.streams[0])
        await eventually(lambda: s.permits(plane).in_use < LIMIT, what=f"{plane} place freed")
        out["freed"] = type(await held.open(other, plane)).__name__
        out["full again"] = await _refusal(other, plane)
    return out


@pytest.mark.parametrize("plane", tuple(PLANES))
async def test_a_plane_over_its_limit_answers_alike_in_every_mode(
    idle: dict[str, Served], plane: str
) -> None:
    seen = {mode: await _limits_seen(s, plane) for mode, s in idle.items()}
    name = idle["direct"].permits(plane).name
    full = f"Relay {name} subscriber limit {LIMIT} reached"
    limit = (Status.RESOURCE_EXHAUSTED, "RELAY_ERROR_REASON_RESOURCE_LIMIT")
    expect = {
        "same connection": (limit[0], f"{full}; this connection already holds its share (1)",
                            limit[1]),
        "same address": (limit[0], f"{full}; this peer already holds its share (2)", limit[1]),
        "preempted": (limit[0], f"stream ended to make room for another client: relay {name} "
                                f"limit {LIMIT} reached and this connection held more than its "
                                "share", limit[1]),
        "freed": PLANES[plane][2].__name__,
        # the freeing connection now holds 1 of 2: its share
        "full again": (limit[0], f"{full}; this connection already holds its share (1)",
                       limit[1]),
    }  # fmt: skip
    for mode, got in seen.items():
        assert got == expect, (mode, got)


async def _every_answer(s: Served, who: str) -> dict[str, Any]:
    """What client ``who`` gets from each RPC, in a form to compare across modes: plane
    messages as parsed, a pool stream's first frame without its send time."""
    out: dict[str, Any] = {}
    req = {"subscriber_id": f"router-{who}", "contract_marker": MARKER}
    async with s.channel(who) as ch:
        info = ch.request(SVC + "GetRelayInfo", Cardinality.UNARY_UNARY, pb.RelayInfoRequest,
                          pb.RelayInfo)  # fmt: skip
        async with info as st:
            await st.send_message(pb.RelayInfoRequest(contract_marker=MARKER), end=True)
            out["GetRelayInfo"] = await st.recv_message()
        for method, request, reply, _ in PLANES.values():
            res = await grpclib_collect(ch, method, request(**req), reply, limit=1)
            assert res.status is None and len(res.messages) == 1, (s.mode, who, method, res)
            out[method] = _unstamped(res.messages[0])
        absent = make_producer("no-such-pool", bucket_count=4096)
        for name, producer in (*((n, g.producer) for n, g in s.pools.items()), ("-", absent)):
            res = await grpclib_collect(ch, "SubscribeKvPool", sub_request(producer, f"r-{who}"),
                                        pb.FilterUpdate, limit=1)  # fmt: skip
            first = res.messages[0] if res.messages else None
            out[f"SubscribeKvPool {name}"] = (
                _answer(res),
                None if first is None else (first.kind, first.sequence, first.producer),
            )
    return out


def _unstamped(message: Any) -> Any:
    """A plane message without the clock readings each mode's own upstream view took."""
    if hasattr(message, "observed_ms"):
        message.observed_ms = 0
    if isinstance(message, pb.ServingLoadUpdate):
        for entry in message.pools:
            if entry.load is not None:
                entry.load.source_observed_ms = 0
    return message


def _names(s: Served, producers: list[Any]) -> set[str]:
    by_id = {bytes(g.producer.pool_id): n for n, g in s.pools.items()}  # type: ignore[arg-type]
    return {by_id[bytes(p.pool_id)] for p in producers}


@pytest.mark.parametrize("who", tuple(SEES))
async def test_authorization_answers_alike_in_every_mode(
    idle: dict[str, Served], who: str
) -> None:
    seen = {mode: await _every_answer(s, who) for mode, s in idle.items()}
    direct = seen["direct"]
    s = idle["direct"]
    # the oracle, on the relay itself
    assert _names(s, [d.producer for d in direct["WatchKvPoolCatalog"].snapshot.pools]) == SEES[who]
    assert _names(s, [e.producer for e in direct["SubscribeKvPoolLoad"].pools]) == SEES[who]
    assert _names(s, [e.producer for e in direct["SubscribeServingLoad"].pools]) == SEES[who]
    models = {(m.namespace, m.canonical_model_id) for m in direct["SubscribeServingLoad"].models}
    assert models == {"a": {("team-a", "m")}, "b": {("team-b", "m")}, "nobody": set()}[who]
    ready = {e.namespace for e in direct["SubscribeServingReadiness"].entries}
    assert ready == {"a": {"team-a"}, "b": {"team-b"}, "nobody": set()}[who]
    absent = direct["SubscribeKvPool -"][0]
    assert absent[0] == Status.NOT_FOUND
    for name in s.pools:
        status, first = direct[f"SubscribeKvPool {name}"]
        if name in SEES[who]:
            assert first is not None and first[0] == pb.FilterUpdateKind.SNAPSHOT_CHUNK
        else:  # a hidden pool is answered exactly as an absent one
            assert (status, first) == (absent, None), name
    # and every mode answers every RPC as the relay does
    for mode in ("mirror", "workers"):
        diff = {k: (v, seen[mode][k]) for k, v in direct.items() if seen[mode][k] != v}
        assert not diff, (mode, diff)


async def _end_of(st: Stream[Any, Any]) -> tuple[Any, str | None, str | None]:
    """Read a stream to its end: how it ended."""
    try:
        async with asyncio.timeout(scaled(15)):
            while await st.recv_message() is not None:
                pass
            await st.recv_trailing_metadata()
    except GRPCError as exc:
        reason = dict(st.trailing_metadata or []).get(REASON)
        return exc.status, exc.message, None if reason is None else str(reason)
    return None, None, None


async def _restart_seen(mode: str) -> dict[str, Any]:
    """Open every stream, restart the relay (a mirror's upstream), see each end, then wait for
    the new relay through this mode and resubscribe: with the old key, and with the new one."""
    out: dict[str, Any] = {}
    cleanup: list[Any] = []
    try:
        view, server = await start_served(mode, None, cleanup)
        old = view.add_pool("p", 4096).producer
        _quiet_windows(view)
        await settle(view, server)
        async with contextlib.AsyncExitStack() as stack:
            ch = await stack.enter_async_context(Channel("127.0.0.1", server.port))
            held = Held(stack)
            for plane in PLANES:
                await held.open(ch, plane)
            pool = await stack.enter_async_context(pool_call(ch))
            await pool.send_message(sub_request(old, "r"), end=True)
            stack.push_async_callback(held.close, pool)
            assert (await pool.recv_message()) is not None
            # read while the restart happens (grpclib fails what a lost connection still held)
            ends = [asyncio.ensure_future(_end_of(st)) for st in (*held.streams, pool)]
            view, server = await restart_source(server, cleanup, incarnation=0x2222)
            new = view.add_pool("p", 4096, incarnation=0x3333).producer
            for name, end in zip((*PLANES, "pool"), ends, strict=True):
                out[f"{name} end"] = await end
        async with Channel("127.0.0.1", server.port) as ch:
            async with asyncio.timeout(scaled(15)):
                while True:
                    res = await grpclib_collect(
                        ch, "WatchKvPoolCatalog",
                        pb.WatchKvPoolCatalogRequest(subscriber_id="r", contract_marker=MARKER),
                        pb.KvPoolCatalogUpdate, limit=1,
                    )  # fmt: skip
                    pools = [d.producer for d in res.messages[0].snapshot.pools] if (
                        res.messages) else []  # fmt: skip
                    if pools == [new]:
                        break
                    await asyncio.sleep(0.02)
            for name, producer in (("old key", old), ("new key", new)):
                res = await grpclib_collect(ch, "SubscribeKvPool", sub_request(producer, "r"),
                                            pb.FilterUpdate, limit=1)  # fmt: skip
                first = res.messages[0] if res.messages else None
                out[name] = (_answer(res), None if first is None else (first.kind, first.sequence))
    finally:
        await close_served(cleanup)
    return out


async def test_a_restarted_relay_looks_alike_in_every_mode() -> None:
    """Every stream ends cleanly (a relay's drain; a mirror's upstream ending cleanly, and the
    new relay identity); the old key gets PRODUCER_CHANGED, the new one a snapshot."""
    seen = {mode: await _restart_seen(mode) for mode in SERVED}
    ok = (None, None, None)
    changed = seen["direct"]["old key"]
    assert changed[0][0] == Status.FAILED_PRECONDITION, changed
    assert changed[0][2] == "RELAY_ERROR_REASON_PRODUCER_CHANGED" and changed[1] is None
    expect = {f"{plane} end": ok for plane in PLANES} | {
        "pool end": ok, "old key": changed,
        "new key": (ok, (pb.FilterUpdateKind.SNAPSHOT_CHUNK, 0)),
    }  # fmt: skip
    for mode, got in seen.items():
        assert got == expect, (mode, got)
