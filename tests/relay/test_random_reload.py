"""Seeded random audit of configuration reloads under traffic (docs/operations.md "Reload").

Real vLLM-format publishers (XPUB live, ROUTER replay: ``tests/support/vllm_publisher.py``) stand
for four static engines; the seeded generator of ``test_random_differential.py`` writes their
traffic. A real ``Relay`` with a ``RelayServer`` serves up to three pools of them, and a real SDK
client (``kvrelay.client.RelayClient``) stays subscribed to every pool throughout. At random
points, some while a batch is in flight, the configuration is reloaded: engines added, removed
or moved to another pool, pools added and removed, pool options that re-materialize
(``cache_salt_namespacing``, ``multimodal_hashing``, ``engine_reports``, ``hash_format``), the
filter's shape (``expected_blocks``, ``ckf_seed``: rebuilt from the exact state), options that
do not (``role``, ``max_member_blocks``), pools and engines reordered, no-op reloads, several at
once, and settings that fail validation (nothing may change).

After each reload settles, every pool's members (lineage, copies), shared owners and filter
entries must equal the pure-Python reference model (``tests/support``) fed each configured
engine's full history under the pool's options, as a fresh relay would build it; the catalog
(as the client reads it over gRPC) must list exactly the configured pools; a pool whose filter
settings did not change keeps its generation (routers see no re-snapshot); and the client's
replica of each pool must end equal to the relay's filter (after a re-materialization its stream
ended with a status and its resubscribe converged).

Long run: ``KVRELAY_RELOAD_SEEDS=100:400 [KVRELAY_RELOAD_STEPS=60]`` (about 0.4 s a seed).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import zmq
import zmq.asyncio

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.client import ClientConfig, RelayClient
from kvrelay.discovery.endpoints import StaticSourceConfig
from kvrelay.hashing.identity import DEFAULT_CKF_SEED
from kvrelay.ingest.kinds import EngineKind
from kvrelay.ingest.options import DecodeOptions
from kvrelay.pool.ckf import DEFAULT_MAX_KICKS
from kvrelay.relay.pool_runtime import PoolRuntime
from kvrelay.relay.relay import Relay
from kvrelay.relay.settings import EngineSpec, PoolSpec, RelaySettings
from kvrelay.service.server import RelayServer
from tests.relay.test_random_differential import TOPIC, B, Case, Gen, Member, _entries, _free_base
from tests.support import vllm_wire as W
from tests.support.decoder_model import Ref
from tests.support.pool_model import Counts, RefPool
from tests.support.timing import scaled
from tests.support.vllm_publisher import TestPublisher

#: engine → its DP ranks
ENGINES = {"ra": (0, 1), "rb": (0,), "rc": (0,), "rd": (0,)}
POOLS = ("p0", "p1", "p2")
#: what the generator writes: extra keys with salts and media, hybrid groups (every pool's
#: decode options then have something to read differently)
GEN_CASE = Case(namespacing=True, multimodal=True, hybrid=True)
SIZES = (1024, 2048, 4096)  # expected_blocks: room for every block the traffic stores
SEEDS = (DEFAULT_CKF_SEED, 7, 0xC0FFEE)
ROLES = (pb.WorkerRole.AGGREGATED, pb.WorkerRole.DECODE)
BASE = RelaySettings(dc_name="dc-rr", discovery_interval_s=0.1)


@dataclass(frozen=True)
class PoolConf:
    """One pool's settings as the audit varies them."""

    engines: tuple[str, ...]
    namespacing: bool = False
    multimodal: bool = False
    reports: bool = False
    eagle: bool = False
    expected: int = 2048
    seed: int = DEFAULT_CKF_SEED
    role: int = pb.WorkerRole.AGGREGATED
    cap: int = 1 << 22

    def filter_key(self) -> tuple[object, ...]:
        """What re-materializes the pool when it changes (``reconfigure.FILTER_FIELDS``)."""
        return (self.namespacing, self.multimodal, self.reports, self.eagle, self.expected,
                self.seed)  # fmt: skip

    def ref(self) -> Ref:
        return Ref(B, eagle=self.eagle, namespacing=self.namespacing, multimodal=self.multimodal)


Config = dict[str, PoolConf]  # pool endpoint → settings, in the file's order


def _describe(cfg: Config) -> str:
    out = []
    for name, c in cfg.items():
        opts = [k for k in ("namespacing", "multimodal", "reports", "eagle") if getattr(c, k)]
        out.append(f"{name}[{','.join(c.engines)}] {c.expected}/{c.seed:x} {'+'.join(opts)}")
    return "; ".join(out)


@dataclass
class Rig:
    relay: Relay
    server: RelayServer
    client: RelayClient
    members: list[Member]
    specs: dict[str, EngineSpec]
    gen: Gen
    #: the generator's own view of what each member holds (it picks hashes to remove from it)
    held_model: RefPool
    cfg: Config
    #: per member, the events of every message it published, as the model reads them
    history: list[list[list[dict[str, Any]]]] = field(default_factory=list)
    log: list[str] = field(default_factory=list)
    reloads: int = 0
    checks: int = 0

    def settings(self, cfg: Config) -> RelaySettings:
        pools = tuple(self.pool_spec(name, c) for name, c in cfg.items())
        return dataclasses.replace(BASE, pools=pools)

    def pool_spec(self, name: str, c: PoolConf) -> PoolSpec:
        fmt = pb.KvQueryHashFormat.DYNAMO_EAGLE_V1 if c.eagle else (
            pb.KvQueryHashFormat.DYNAMO_STANDARD_V1)  # fmt: skip
        return PoolSpec(
            namespace="ns", component="backend", endpoint=name,
            engines=tuple(self.specs[e] for e in c.engines), expected_blocks=c.expected,
            ckf_seed=c.seed, model="rr-model", kv_block_size=B, role=pb.WorkerRole(c.role),
            decode=DecodeOptions(cache_salt_namespacing=c.namespacing,
                                 multimodal_hashing=c.multimodal),
            engine_reports=c.reports, max_member_blocks=c.cap, hash_format=fmt,
        )  # fmt: skip

    def runtime(self, name: str) -> PoolRuntime:
        (p,) = [p for p in self.relay.pools if p.spec.endpoint == name]
        return p

    # ---- traffic ---------------------------------------------------------------------------------

    async def publish(self, m: Member, events: list[dict[str, Any]], *, live: bool = True) -> None:
        i = self.members.index(m)
        wire, seen = [], []
        for ev in events:
            w, s = self.gen.wire(ev)
            wire.append(w)
            seen.append(s)
        payload = W.batch(wire, dp=m.rank, ts=time.time())  # type: ignore[arg-type]
        seq = await m.pub.publish(payload, live=live)
        self.history[i].append(seen)
        self.held_model.apply(i, m.ref.build(seen))
        self.log.append(f"{m.engine}/{m.rank} seq={seq} live={live} n={len(seen)}")

    async def traffic(self) -> None:
        r = self.gen.rng
        m = r.choice(self.members)
        held = self.held_model.lineage.get(self.members.index(m), {})
        q = r.random()
        if q < 0.04:
            await self.restart(m)
            return
        if q < 0.12:  # a gap: batches only the replay has, then a live one
            for _ in range(r.randrange(1, 3)):
                await self.publish(m, self.gen.events(m, held), live=False)
        await self.publish(m, self.gen.events(m, held))

    async def restart(self, m: Member) -> None:
        """A new incarnation of ``m``'s engine: sequence from 0, history gone, some batches
        only in the replay (never exactly the old next number: no signal without instance
        ids, as in the differential audit)."""
        i = self.members.index(m)
        old_next = m.pub.seq
        assert isinstance(m.pub, TestPublisher)
        m.pub.restart()
        self.history[i] = []
        self.held_model.clear(i, Counts())
        m.ref = GEN_CASE.ref()
        hidden = self.gen.rng.choice((0, 0, 1, 2))
        if hidden == old_next and hidden > 0:
            hidden += 1
        self.log.append(f"{m.engine}/{m.rank} restart (hidden {hidden})")
        for _ in range(hidden):
            await self.publish(m, self.gen.events(m, {}), live=False)
        await self.publish(m, self.gen.events(m, self.held_model.lineage.get(i, {})))

    async def traffic_while(self, task: asyncio.Task[Any]) -> None:
        """Batches (a few, spaced by loop turns or short sleeps) while ``task`` runs."""
        r = self.gen.rng
        for _ in range(r.choice((0, 1, 1, 2, 4))):
            if r.random() < 0.5:
                await asyncio.sleep(0)
            else:
                await asyncio.sleep(r.random() * 0.01)
            await self.traffic()
        await task

    # ---- settling and checks ---------------------------------------------------------------------

    def configured(self) -> list[tuple[str, Member]]:
        return [(name, m) for name, c in self.cfg.items() for m in self.members
                if m.engine in c.engines]  # fmt: skip

    def _caught_up(self, name: str, m: Member) -> bool:
        rt = self.runtime(name)
        sub = rt.subscribers.get(m.key)
        return (
            rt.generation is not None
            and sub is not None
            and sub.state == "live"
            and sub.next_seq == m.pub.seq
        )

    async def settle(self, what: str) -> None:
        """Until every configured member is live, has applied all its engine published, and the
        pools equal the model (``check``). Caught up by sequence alone is not enough: an engine
        restarted with as many batches as it had before reads as caught up until the relay has
        read the new incarnation's first live batch. A live batch sent while a (re)subscription
        was being set up may be lost to ZMQ's slow joiner: an empty batch (which changes
        nothing) then shows the relay the gap."""
        deadline = time.monotonic() + scaled(20)
        nudge = time.monotonic() + 0.5
        failed: AssertionError | None = None
        while True:
            behind = [(n, m) for n, m in self.configured() if not self._caught_up(n, m)]
            if not behind:
                try:
                    self.check(what)
                    return
                except AssertionError as exc:
                    failed = exc
            now = time.monotonic()
            if now > deadline:
                if failed is not None and not behind:
                    raise failed
                state = {
                    f"{n}:{m.engine}/{m.rank}": (None if s is None else (s.state, s.next_seq),
                                                 m.pub.seq)
                    for n, m in behind
                    for s in [self.runtime(n).subscribers.get(m.key)]
                }  # fmt: skip
                raise AssertionError(f"not settled after {what}: {state}\n  "
                                     + "\n  ".join(self.log[-10:]))  # fmt: skip
            if now > nudge:
                nudge = now + 0.5
                for n, m in behind:
                    rt = self.runtime(n)
                    sub = rt.subscribers.get(m.key)
                    if sub is not None and sub.state == "live":
                        await self.publish(m, [])
            await asyncio.sleep(0.005)

    def model(self, c: PoolConf, bucket_count: int) -> RefPool:
        """The pool a fresh relay builds from every configured engine's whole history."""
        ref = RefPool(bucket_count, c.seed, B, 2 if c.eagle else 1, DEFAULT_MAX_KICKS, c.reports)
        for i, m in enumerate(self.members):
            if m.engine not in c.engines:
                continue
            dec = c.ref()
            for seen in self.history[i]:
                ref.apply(i, dec.build(seen))
        return ref

    def check(self, what: str) -> None:
        self.checks += 1
        ctx = f"after {what}; config {_describe(self.cfg)}\n  " + "\n  ".join(self.log[-8:])
        assert sorted(p.spec.endpoint for p in self.relay.pools) == sorted(self.cfg), ctx
        assert self.relay.settings.pools == self.settings(self.cfg).pools, ctx
        for name, c in self.cfg.items():
            rt = self.runtime(name)
            gen = rt.generation
            assert gen is not None and not gen.retired, f"{name} has no generation {ctx}"
            assert rt.descriptor() is not None, f"{name} not in the catalog {ctx}"
            pool = gen.pool
            assert pool.bucket_count == rt.spec.bucket_count and pool.seed == c.seed, ctx
            model = self.model(c, pool.bucket_count)
            ids = {v: k for k, v in pool.members().items()}
            mine = {(m.key.worker_id, m.rank) for m in self.members if m.engine in c.engines}
            stray = set(ids) - mine
            assert not stray, f"{name} holds members of engines it no longer has {stray} {ctx}"
            for i, m in enumerate(self.members):
                if m.engine not in c.engines:
                    continue
                mid = ids.get((m.key.worker_id, m.rank))
                got = {} if mid is None else pool.lineage(mid)
                who = f"{name}: {m.engine}/{m.rank}"
                assert got == model.lineage.get(i, {}), f"lineage of {who} {ctx}"
                got_c = {} if mid is None else pool.copies(mid)
                assert got_c == model.copies.get(i, {}), f"copies of {who} {ctx}"
            want_o = {h: (n, bool(res)) for h, (n, res) in model.owners.items()}
            assert pool.owners() == want_o, f"{name}: owners {ctx}"
            ckf = model.ckf
            assert _entries(pool.table, ckf) == _entries(ckf.words(), ckf), f"{name}: filter {ctx}"
            assert pool.invariant_violations == 0, ctx

    async def client_matches(self, what: str) -> None:
        """The client's catalog lists exactly the configured pools, and its replica of each
        ends equal to the relay's filter."""
        deadline = time.monotonic() + scaled(20)
        while True:
            slots = {s.key.endpoint: s for _, s in self.client._slots()}
            ok = sorted(slots) == sorted(self.cfg)
            for name in self.cfg if ok else ():
                gen = self.runtime(name).generation
                inst = slots[name].installed
                ok = ok and (
                    gen is not None
                    and inst is not None
                    and inst.table is not None
                    and bytes(inst.producer) == bytes(gen.producer)
                    and np.array_equal(inst.table, gen.pool.table)
                )
            if ok:
                return
            if time.monotonic() > deadline:
                seen = {k: (s.installed is not None, s.subscribes) for k, s in slots.items()}
                raise AssertionError(f"the client never matched after {what}: {seen} "
                                     f"config {_describe(self.cfg)}")  # fmt: skip
            await asyncio.sleep(0.02)


# ---- random reloads ------------------------------------------------------------------------------


def _free_engines(cfg: Config) -> list[str]:
    used = {e for c in cfg.values() for e in c.engines}
    return [e for e in ENGINES if e not in used]


def _mutate(cfg: Config, r: random.Random) -> tuple[Config, str]:
    """One random change of ``cfg`` (a copy), and its name."""
    new = dict(cfg)
    names = list(new)
    kind = r.choice(("noop", "add_engine", "remove_engine", "move_engine", "add_pool",
                     "remove_pool", "remat", "shape", "plain", "reorder"))  # fmt: skip
    name = r.choice(names)
    c = new[name]
    free = _free_engines(new)
    if kind == "add_engine" and free:
        es = list(c.engines)
        es.insert(r.randrange(len(es) + 1), r.choice(free))
        new[name] = dataclasses.replace(c, engines=tuple(es))
    elif kind == "remove_engine" and len(c.engines) > 1:
        gone = r.choice(c.engines)
        new[name] = dataclasses.replace(c, engines=tuple(e for e in c.engines if e != gone))
    elif kind == "move_engine" and len(names) > 1 and len(c.engines) > 1:
        moved = r.choice(c.engines)
        to = r.choice([n for n in names if n != name])
        new[name] = dataclasses.replace(c, engines=tuple(e for e in c.engines if e != moved))
        new[to] = dataclasses.replace(new[to], engines=(*new[to].engines, moved))
    elif kind == "add_pool" and len(names) < len(POOLS):
        if not free:  # take one from a pool that has two
            donors = [n for n in names if len(new[n].engines) > 1]
            if not donors:
                return new, "noop (no engine to spare)"
            d = r.choice(donors)
            took = r.choice(new[d].engines)
            new[d] = dataclasses.replace(new[d], engines=tuple(e for e in new[d].engines
                                                               if e != took))  # fmt: skip
            free = [took]
        added = r.choice([p for p in POOLS if p not in new])
        new[added] = PoolConf(engines=tuple(r.sample(free, r.randint(1, len(free)))),
                              expected=r.choice(SIZES), reports=r.random() < 0.3)  # fmt: skip
        kind = f"add_pool {added}"
    elif kind == "remove_pool" and len(names) > 1:
        del new[name]
        kind = f"remove_pool {name}"
    elif kind == "remat":
        opt = r.choice(("namespacing", "multimodal", "reports", "eagle"))
        flipped: dict[str, Any] = {opt: not getattr(c, opt)}
        new[name] = dataclasses.replace(c, **flipped)
        kind = f"remat {name}.{opt}"
    elif kind == "shape":
        if r.random() < 0.5:
            new[name] = dataclasses.replace(c, expected=r.choice([s for s in SIZES
                                                                  if s != c.expected]))  # fmt: skip
        else:
            new[name] = dataclasses.replace(c, seed=r.choice([s for s in SEEDS if s != c.seed]))
        kind = f"shape {name}"
    elif kind == "plain":
        if r.random() < 0.5:
            new[name] = dataclasses.replace(c, role=r.choice([x for x in ROLES if x != c.role]))
        else:
            new[name] = dataclasses.replace(c, cap=(1 << 22) if c.cap != 1 << 22 else 1 << 21)
        kind = f"plain {name}"
    elif kind == "reorder":
        if r.random() < 0.5:
            r.shuffle(names)
            new = {n: new[n] for n in names}
        else:
            es = list(c.engines)
            r.shuffle(es)
            new[name] = dataclasses.replace(c, engines=tuple(es))
    else:
        kind = "noop"
    return new, kind


def _random_reload(cfg: Config, r: random.Random) -> tuple[Config, str]:
    """One change, or (sometimes) several in one reload."""
    new, what = _mutate(cfg, r)
    if r.random() < 0.25:
        for _ in range(r.randint(1, 3)):
            new, more = _mutate(new, r)
            what += " + " + more
    return new, what


def _invalid(cfg: Config, r: random.Random) -> Config | None:
    """A configuration the settings refuse: an engine in two pools (None: one pool only)."""
    names = list(cfg)
    if len(names) < 2:
        return None
    a, b = r.sample(names, 2)
    new = dict(cfg)
    new[b] = dataclasses.replace(new[b], engines=(*new[b].engines, new[a].engines[0]))
    return new


def _subscribes(rig: Rig) -> dict[str, int]:
    return {s.key.endpoint: s.subscribes for _, s in rig.client._slots()}


async def _reload(rig: Rig, step: int, seed: int) -> None:
    """One reload with traffic meanwhile, or a burst of them with no settling in between; then
    settled, checked against the model, and the client's replicas compared."""
    r = rig.gen.rng
    burst = r.choice((1, 1, 1, 1, 2, 3))
    subscribes = _subscribes(rig)
    untouched = set(rig.cfg)  # pools every reload of the burst kept
    for _ in range(burst):
        new, what = _random_reload(rig.cfg, r)
        before = {name: rig.runtime(name).generation for name in rig.cfg}
        kept = {name for name, c in new.items()
                if name in rig.cfg and c.filter_key() == rig.cfg[name].filter_key()}  # fmt: skip
        untouched &= kept
        task = asyncio.create_task(rig.relay.reconfigure(rig.settings(new)))
        await rig.traffic_while(task)
        rig.reloads += 1
        rig.cfg = new
        tag = f"reload {rig.reloads} ({what}) at step {step}, seed {seed}"
        rig.log.append(tag)
        for name in kept:  # (a pool a reload of the burst added may not have materialized yet)
            assert before[name] is None or rig.runtime(name).generation is before[name], (
                f"{name} changed generation though its filter settings did not: {tag}"
            )
    tag = f"reload {rig.reloads} (a burst of {burst}) at step {step}, seed {seed}"
    await rig.settle(tag)
    await rig.client_matches(tag)
    now = _subscribes(rig)
    for name in untouched:  # routers reading a pool whose filter did not change see nothing
        assert now[name] == subscribes[name], f"the client re-subscribed to {name}: {tag}"


# ---- the rig -------------------------------------------------------------------------------------


def _initial(r: random.Random) -> Config:
    engines = list(ENGINES)
    r.shuffle(engines)
    n = r.randint(1, 3)
    cfg: Config = {}
    for i, name in enumerate(r.sample(POOLS, n)):
        es = engines[i::n]
        cfg[name] = PoolConf(engines=tuple(es[: r.randint(1, len(es))]),
                             expected=r.choice(SIZES), namespacing=r.random() < 0.3,
                             reports=r.random() < 0.3)  # fmt: skip
    return cfg


@contextlib.asynccontextmanager
async def reload_rig(seed: int) -> AsyncIterator[Rig]:
    ctx = zmq.asyncio.Context()
    members: list[Member] = []
    specs: dict[str, EngineSpec] = {}
    gen = Gen(seed, GEN_CASE)
    relay: Relay | None = None
    server: RelayServer | None = None
    client: RelayClient | None = None
    try:
        for name, ranks in ENGINES.items():
            made: list[TestPublisher] = []
            for _ in range(50):
                base, rbase = _free_base(len(ranks)), _free_base(len(ranks))
                made = []
                try:
                    for rk in ranks:
                        made.append(TestPublisher(ctx, topic=TOPIC, port=base + rk,
                                                  replay_port=rbase + rk))  # fmt: skip
                except zmq.ZMQError:
                    for p in made:
                        await p.close()
                    continue
                break
            assert len(made) == len(ranks), "no free ports for the publishers"
            members += [Member(name, rk, p, GEN_CASE.ref())
                        for rk, p in zip(ranks, made, strict=True)]  # fmt: skip
            specs[name] = EngineSpec(name=name, kind=EngineKind.VLLM, static=StaticSourceConfig(
                endpoint=f"tcp://127.0.0.1:{base}", replay_endpoint=f"tcp://127.0.0.1:{rbase}",
                dp_ranks=ranks, topic="kv"))  # fmt: skip
        held = RefPool(4096, DEFAULT_CKF_SEED, B, 1, DEFAULT_MAX_KICKS)
        cfg = _initial(gen.rng)
        rig = Rig(None, None, None, members, specs, gen, held, cfg,  # type: ignore[arg-type]
                  history=[[] for _ in members])  # fmt: skip
        settings = rig.settings(cfg)
        relay = rig.relay = Relay(settings)
        await relay.start()
        server = rig.server = RelayServer(relay, settings.limits)
        await server.start("127.0.0.1", 0)
        client = rig.client = RelayClient(
            [f"127.0.0.1:{server.port}"],
            config=ClientConfig(backoff_initial_s=0.02, backoff_max_s=0.2),
        )
        await client.start()
        yield rig
    finally:
        if client is not None:
            await client.close()
        if server is not None:
            await server.close(grace_s=1.0)
        if relay is not None:
            await asyncio.wait_for(relay.stop(), scaled(30))
        for m in members:
            await m.pub.close()
        ctx.destroy(linger=0)


async def run_reload_seed(seed: int, steps: int) -> Rig:
    async with reload_rig(seed) as rig:
        r = rig.gen.rng
        await rig.settle(f"start, seed {seed}")
        for step in range(steps):
            q = r.random()
            if q < 0.25:
                await _reload(rig, step, seed)
            elif q < 0.28:
                bad = _invalid(rig.cfg, r)
                if bad is None:
                    continue
                before = {p.name: p.generation for p in rig.relay.pools}
                settings = rig.relay.settings
                with pytest.raises(ValueError):  # (refused as the settings are built)
                    await rig.relay.reconfigure(rig.settings(bad))
                assert rig.relay.settings is settings
                assert {p.name: p.generation for p in rig.relay.pools} == before
                rig.log.append(f"invalid reload refused at step {step}")
            else:
                await rig.traffic()
        await rig.settle(f"the end, seed {seed}")
        await rig.client_matches(f"the end, seed {seed}")
        return rig


# ---- tests ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [2, 3])
async def test_random_reloads_match_the_reference_model(seed: int) -> None:
    rig = await run_reload_seed(seed, 40)
    assert rig.checks >= 2


@pytest.mark.skipif(
    not os.environ.get("KVRELAY_RELOAD_SEEDS"), reason="long audit: KVRELAY_RELOAD_SEEDS=first:end"
)
async def test_random_reloads_many_seeds() -> None:
    """The audit itself: ``KVRELAY_RELOAD_SEEDS=100:400`` (``KVRELAY_RELOAD_STEPS``, 60)."""
    lo, hi = (int(x) for x in os.environ["KVRELAY_RELOAD_SEEDS"].split(":"))
    steps = int(os.environ.get("KVRELAY_RELOAD_STEPS", "60"))
    for seed in range(lo, hi):
        await run_reload_seed(seed, steps)
