"""``SubscribeServingLoad`` under ``[[authorization]]``, as an independent router sees it: grpcio
with protobuf classes generated from the repo's proto, mutual TLS on loopback, a real relay over
simulated engines whose ``/metrics`` pages mimic vLLM's.

A model's view sums every frontend of the model's configured pools, published or withdrawn
(``expected_frontends`` counts them, its totals add them up), while ``serving_pools`` lists only
the published ones. So a model whose withdrawn pool a client may not see must stay hidden from
it, as it was while that pool was published. The oracle is the rules, written out by hand: the
client sees pool ``ns/a/generate`` only; the model also has ``ns/b/generate``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc

from kvrelay.ops.tls import server_ssl_context
from kvrelay.relay.settings import EngineSpec, PoolSpec
from kvrelay.service.authz import Authorization, AuthorizationRule
from kvrelay.service.server import RelayServer
from kvrelay.sim.config import SimConfig
from kvrelay.sim.engine import SimEngine
from tests.support.certs import make_ca, make_leaf
from tests.support.fleet import fleet_and_relay
from tests.support.timing import scaled

MARKER = 0x4B565231
RULES = (
    AuthorizationRule(dns=("router-a.svc",), pools=("ns/a/*",)),  # one pool of the model
    AuthorizationRule(dns=("router-all.svc",), pools=("ns/*",)),  # every pool, by key
    AuthorizationRule(dns=("router-ns.svc",), namespaces=("ns",)),
)


def _pools(engines: list[SimEngine]) -> tuple[PoolSpec, ...]:
    return tuple(
        PoolSpec(
            namespace="ns", component=comp, endpoint="generate", expected_blocks=8192,
            engines=(EngineSpec(name=e.cfg.name, host="127.0.0.1", grpc_port=e.grpc_port,
                                metrics_port=e.metrics_port),),
        )
        for comp, e in zip(("a", "b"), engines, strict=True)
    )  # fmt: skip


class _Router:
    """One router: an mTLS grpcio channel and a SubscribeServingLoad stream."""

    def __init__(self, port: int, ca: Path, leaf: tuple[Path, Path], R: Any, RG: Any) -> None:
        creds = grpc.ssl_channel_credentials(
            ca.read_bytes(), leaf[1].read_bytes(), leaf[0].read_bytes()
        )
        self.channel = grpc.aio.secure_channel(f"localhost:{port}", creds)
        self.call = RG.KvEventRelayStub(self.channel).SubscribeServingLoad(
            R.SubscribeServingLoadRequest(subscriber_id="router", contract_marker=MARKER)
        )

    async def read(self) -> Any:
        return await asyncio.wait_for(self.call.read(), scaled(10))

    async def close(self) -> None:
        self.call.cancel()
        await self.channel.close()


async def test_a_model_whose_withdrawn_pool_is_hidden_stays_hidden(
    tmp_path: Path, official_pb2: dict[str, ModuleType]
) -> None:
    R, RG = official_pb2["relay"], official_pb2["relay_grpc"]
    sca, cca = make_ca(tmp_path, "server-ca"), make_ca(tmp_path, "client-ca")
    server_leaf = make_leaf(tmp_path, "relay", sca, server=True)
    leaves = {
        who: make_leaf(tmp_path, f"r-{who}", cca, server=False, sans=(f"DNS:router-{who}.svc",))
        for who in ("a", "all", "ns")
    }
    configs = [SimConfig(name="e0", seed=41), SimConfig(name="e1", seed=42)]
    async with fleet_and_relay(configs, pools=_pools) as (engines, relay, _plain):
        server = RelayServer(relay, relay.settings.limits)
        server.service.set_authorization(Authorization(RULES))
        ctx = server_ssl_context(str(server_leaf[0]), str(server_leaf[1]), str(cca[0]))
        await server.start("127.0.0.1", 0, ssl=ctx)
        routers = {w: _Router(server.port, sca[0], leaf, R, RG)
                   for w, leaf in leaves.items()}  # fmt: skip
        try:
            for e in engines:
                await e.step(10)

            async def until(who: str, check: Any) -> Any:
                loop = asyncio.get_running_loop()
                deadline = loop.time() + scaled(20)
                while True:
                    m = await routers[who].read()
                    if check(m):
                        return m
                    assert loop.time() < deadline, (who, m)

            # Both pools published: router-a sees pool a, not the model (it sums pool b too).
            full = await until("ns", lambda m: len(m.pools) == 2 and len(m.models) == 1)
            assert full.models[0].deployment.expected_frontends == 2
            m = await until("a", lambda m: len(m.pools) == 1)
            assert list(m.models) == []
            await until("all", lambda m: len(m.pools) == 2 and len(m.models) == 1)

            # Pool b withdrawn (its engine stopped, then declared down): its frontend has
            # departed, but the model's totals still hold what it counted.
            await engines[1].stop()

            def b_withdrawn(m: Any) -> bool:
                return len(m.pools) == 1 and (
                    len(m.models) == 1 and len(m.models[0].deployment.serving_pools) == 1
                    and m.models[0].deployment.expected_frontends == 1
                )

            m = await until("ns", b_withdrawn)
            model = m.models[0]
            assert model.deployment.observed_frontends == 1
            assert model.load.status == R.DATA_STATUS_COMPLETE
            # router-a may see pool a but not b: the model, which sums b's frontend, stays hidden.
            for _ in range(3):
                m = await until("a", lambda m: len(m.pools) == 1)
                assert list(m.models) == [], m.models
            # A router that sees every pool of the model, by pool key, still sees the model.
            m = await until("all", lambda m: len(m.pools) == 1 and len(m.models) == 1)
            assert m.models[0].deployment.expected_frontends == 1
        finally:
            for r in routers.values():
                await r.close()
            await server.close(grace_s=1.0)

