"""Membership that follows the fleet: engine entries naming a DNS name become one engine per
resolved address, re-resolved every ``dns_interval_s``.

An engine found by DNS is named ``<entry name>@<address>`` (``@<address>:<port>`` for SRV), so
its ``worker_id`` — derived from the name — is stable per address across resolutions and relay
restarts. A new address adds an engine (it is probed and subscribed like a configured one). DNS
absence is treated like an unreachable Control: the data plane decides. An address missing from
two consecutive successful answers is removed (its members are cleared) only once its engine's
ZMQ streams have also been disconnected for ``engine_down_grace_s`` (the relay's ``removable``
check); until then the engine is kept, counted once per absence, and its state stays exact. A
resolution that fails (timeout, SERVFAIL) changes nothing: a DNS outage is not a fleet change.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvrelay.discovery.dns import DnsError, Endpoint, resolve_engines
from kvrelay.discovery.endpoints import StaticSourceConfig, split_tcp
from kvrelay.logging import get_logger
from kvrelay.relay.settings import EngineSpec

if TYPE_CHECKING:
    import dns.asyncresolver

_log = get_logger(__name__)

#: Consecutive successful answers an address must be missing from before its engine is removed.
MISSING_ANSWERS_TO_REMOVE = 2

#: Adds an engine; where the relay already reaches an engine there, nothing is added and that
#: engine's ``pool/name`` is returned.
AddEngine = Callable[[str, EngineSpec], Awaitable[str | None]]
RemoveEngine = Callable[[str, str], Awaitable[None]]
Removable = Callable[[str, str], bool]


@dataclass(slots=True)
class DnsCounters:
    resolutions: int = 0
    failures: int = 0
    engines_added: int = 0
    engines_removed: int = 0
    removals_deferred: int = 0  # absences from DNS while the engine's stream was still live
    duplicates: int = 0  # addresses not added: another engine is reached there (once each)


def expand(template: EngineSpec, endpoint: Endpoint) -> EngineSpec:
    """The concrete engine a DNS template stands for at one address (and SRV port)."""
    address, port = endpoint
    host = address
    label = f"[{address}]" if ":" in address else address
    name = f"{template.name}@{address}" if port is None else f"{template.name}@{label}:{port}"
    static = template.static
    if static is not None:
        static = _static_at(static, label)
    return dataclasses.replace(
        template,
        name=name,
        host=host,
        grpc_port=template.grpc_port if port is None else port,
        static=static,
        dns=None,
        dns_srv=False,
    )


def _static_at(cfg: StaticSourceConfig, label: str) -> StaticSourceConfig:
    def at(endpoint: str | None) -> str | None:
        if endpoint is None or not endpoint.startswith("tcp://"):
            return endpoint
        _host, port = split_tcp(endpoint)
        return f"tcp://{label}:{port}"

    return dataclasses.replace(
        cfg, endpoint=at(cfg.endpoint) or cfg.endpoint, replay_endpoint=at(cfg.replay_endpoint)
    )


class DnsMembership:
    """Resolves every DNS engine template of every pool and applies the differences."""

    def __init__(
        self,
        templates: list[tuple[str, EngineSpec]],
        resolver: dns.asyncresolver.Resolver,
        interval_s: float,
        add: AddEngine,
        remove: RemoveEngine,
        removable: Removable = lambda _pool, _engine: True,
    ) -> None:
        self.templates = templates  # (pool name, template)
        self.resolver = resolver
        self.interval_s = interval_s
        self._add = add
        self._remove = remove
        self._removable = removable
        self._deferred: set[tuple[str, str]] = set()  # absent engines kept for a live stream
        #: expanded engines not added (another engine is reached there), tried again at each
        #: resolution while they are in the answer (so one added once that engine goes)
        self._duplicate: set[tuple[str, str, str]] = set()  # (pool, template, engine)
        self.counters = DnsCounters()
        self.current: dict[tuple[str, str], dict[str, EngineSpec]] = {}
        self._missing: dict[tuple[str, str], int] = {}  # (pool, engine) → answers missing from
        self._wake = asyncio.Event()
        #: Held while resolving and while a reload edits the templates, so a resolution never
        #: re-adds the engines of a template a reload just retired.
        self.lock = asyncio.Lock()

    async def run(self) -> None:
        while True:
            self._wake.clear()
            await self.resolve_once()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval_s)

    def wake(self) -> None:
        """Resolve again now (a reload changed the templates), not after the interval."""
        self._wake.set()

    def forget(self, pool: str, template: str) -> list[str]:
        """Stop following ``template`` of ``pool``; the names of the engines it had expanded to
        (the caller removes them — or nothing, when the whole pool goes)."""
        self.templates = [(p, t) for p, t in self.templates if (p, t.name) != (pool, template)]
        engines = list(self.current.pop((pool, template), {}))
        self._duplicate = {d for d in self._duplicate if d[:2] != (pool, template)}
        for name in engines:
            self._missing.pop((pool, name), None)
            self._deferred.discard((pool, name))
        return engines

    def set_templates(self, templates: list[tuple[str, EngineSpec]]) -> None:
        """The templates after a reload (retired ones already forgotten)."""
        self.templates = templates
        self.wake()

    async def resolve_once(self) -> None:
        async with self.lock:
            await self._resolve_all()

    async def _resolve_all(self) -> None:
        for pool, template in self.templates:
            assert template.dns is not None
            key = (pool, template.name)
            try:
                found = await resolve_engines(self.resolver, template.dns, srv=template.dns_srv)
            except DnsError as exc:
                self.counters.failures += 1
                _log.warning("dns_resolution_failed", pool=pool, name=template.dns, error=str(exc))
                continue
            self.counters.resolutions += 1
            wanted = {spec.name: spec for spec in (expand(template, e) for e in sorted(found))}
            have = self.current.setdefault(key, {})
            for name, spec in wanted.items():
                self._missing.pop((pool, name), None)
                self._deferred.discard((pool, name))
                if name not in have:
                    other = await self._add(pool, spec)
                    if other is not None:
                        if (*key, name) not in self._duplicate:  # (logged once per address)
                            self._duplicate.add((*key, name))
                            self.counters.duplicates += 1
                            _log.warning("engine_duplicate", pool=pool, engine=name,
                                         same_as=other)  # fmt: skip
                        continue
                    self._duplicate.discard((*key, name))
                    have[name] = spec
                    self.counters.engines_added += 1
                    _log.info("dns_engine_added", pool=pool, engine=name)
            self._duplicate = {d for d in self._duplicate if d[:2] != key or d[2] in wanted}
            for name in [n for n in have if n not in wanted]:
                misses = self._missing.get((pool, name), 0) + 1
                self._missing[(pool, name)] = misses
                if misses >= MISSING_ANSWERS_TO_REMOVE:
                    if not self._removable(pool, name):
                        if (pool, name) not in self._deferred:
                            self._deferred.add((pool, name))
                            self.counters.removals_deferred += 1
                            _log.info("dns_engine_kept", pool=pool, engine=name)
                        continue
                    self._deferred.discard((pool, name))
                    del have[name]
                    del self._missing[(pool, name)]
                    self.counters.engines_removed += 1
                    _log.info("dns_engine_removed", pool=pool, engine=name)
                    await self._remove(pool, name)
