"""What a configuration reload changes: a plan computed from the old and new settings.

A reload must not cost routers a re-snapshot where nothing they read changed, and must never
keep a filter whose shape or contents the new settings define differently. So each pool of the
new settings is one of:

* **unchanged** — the same settings: the generation, its sequence and its subscribers go on;
* **changed in membership only** — engines added, removed or redefined (another host, port,
  static endpoint, ...), or only what readiness publishes (``role``, ``needs``): the generation
  goes on; a removed or redefined engine's members are removed (a redefined one then rebuilds
  from its replay), an added one is probed and subscribed;
* **re-materialized** — a setting that shapes the filter or its contents changed
  (``expected_blocks``, ``ckf_seed``, ``hash_format``, the decode options, ``engine_reports``,
  which decides what a store of a held block counts): the generation is withdrawn and a new one
  is built from replay (routers see the pool change and re-subscribe).
  ``model``, ``model_source`` and ``kv_block_size`` feed the pool identity check that already
  re-materializes when the identity they give actually changes;
* **added** or **removed**.

Settings the running process cannot take over (the data-centre identity, the relay instance id,
the limits behind permits and queues) keep their running values and are reported as needing a
restart.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvrelay.relay.settings import EngineSpec, PoolSpec, RelaySettings

#: PoolSpec fields that define the filter's shape or contents.
FILTER_FIELDS = ("expected_blocks", "ckf_seed", "hash_format", "decode", "engine_reports")
#: RelaySettings fields only a restart applies (identity, permits and queue bounds).
RESTART_FIELDS = {"dc_name": "relay.dc_name", "drt_instance_id": "relay.drt_instance_id",
                  "limits": "relay.limits", "zmq_reader": "relay.zmq_reader"}  # fmt: skip


@dataclass(frozen=True, slots=True)
class PoolChange:
    """How one pool that exists before and after the reload changes."""

    spec: PoolSpec
    #: A filter-shaping setting changed: withdraw the generation, build a new one.
    rematerialize: bool
    #: Concrete engines (not DNS templates) to remove: gone, or redefined (then re-added).
    engines_removed: tuple[str, ...]
    engines_added: tuple[EngineSpec, ...]
    #: DNS templates gone or redefined: the engines they expanded to are removed.
    templates_retired: tuple[str, ...]

    @property
    def name(self) -> str:
        return "/".join(self.spec.triple)


@dataclass(frozen=True, slots=True)
class ReloadPlan:
    settings: RelaySettings  # what the relay runs with afterwards (restart-only fields kept)
    added: tuple[PoolSpec, ...]
    removed: tuple[str, ...]  # pool names
    changed: tuple[PoolChange, ...]
    unchanged: tuple[str, ...]
    restart_required: tuple[str, ...]  # setting paths whose new value waits for a restart

    @property
    def empty(self) -> bool:
        return not (self.added or self.removed or self.changed)

    def summary(self) -> dict[str, object]:
        """The plan in a log line's fields."""
        return {
            "pools_added": [
                "/".join(p.triple) for p in self.added
            ],
            "pools_removed": list(self.removed),
            "pools_rematerialized": [c.name for c in self.changed if c.rematerialize],
            "pools_changed": [c.name for c in self.changed if not c.rematerialize],
            "pools_unchanged": len(self.unchanged),
            "engines_added": sum(len(c.engines_added) for c in self.changed),
            "engines_removed": sum(len(c.engines_removed) for c in self.changed),
            "restart_required": list(self.restart_required),
        }


def _name(spec: PoolSpec) -> str:
    return "/".join(spec.triple)


def _engine_diff(
    old: PoolSpec, new: PoolSpec
) -> tuple[tuple[str, ...], tuple[EngineSpec, ...], tuple[str, ...]]:
    before = {e.name: e for e in old.engines}
    after = {e.name: e for e in new.engines}
    removed: list[str] = []
    added: list[EngineSpec] = []
    retired: list[str] = []
    for name, e in before.items():
        if after.get(name) == e:
            continue
        if e.dns is not None:
            retired.append(name)
        else:
            removed.append(name)
    for name, e in after.items():
        if before.get(name) != e and e.dns is None:
            added.append(e)  # (a new or redefined DNS template is resolved by membership)
    return tuple(removed), tuple(added), tuple(retired)


def plan_reload(old: RelaySettings, new: RelaySettings) -> ReloadPlan:
    """The plan that turns a relay running ``old`` into one running ``new``."""
    restart = tuple(
        path for f, path in RESTART_FIELDS.items() if getattr(old, f) != getattr(new, f)
    )
    kept = {f: getattr(old, f) for f in RESTART_FIELDS}
    settings = dataclasses.replace(new, **kept)
    before = {p.triple: p for p in old.pools}
    after = {p.triple: p for p in new.pools}
    added = tuple(p for t, p in after.items() if t not in before)
    removed = tuple(_name(p) for t, p in before.items() if t not in after)
    changed: list[PoolChange] = []
    unchanged: list[str] = []
    for triple, spec in after.items():
        prev = before.get(triple)
        if prev is None:
            continue
        if prev == spec:
            unchanged.append(_name(spec))
            continue
        remat = any(getattr(prev, f) != getattr(spec, f) for f in FILTER_FIELDS)
        engines_removed, engines_added, retired = _engine_diff(prev, spec)
        changed.append(PoolChange(spec, remat, engines_removed, engines_added, retired))
    return ReloadPlan(
        settings=settings,
        added=added,
        removed=removed,
        changed=tuple(changed),
        unchanged=tuple(unchanged),
        restart_required=restart,
    )
