"""State handover across relay restarts: what a clean stop saves and a start may restore.

vLLM's replay buffer holds the last ``buffer_steps`` batches; a relay that restarts from nothing
loses every block stored before them until it is stored again. So a clean stop writes, per pool,
its exact state (``Pool.export_state``: lineage, refcounts and the cuckoo table) and, per member,
where that state stands in the engine's stream: the engine incarnation (``instance_id``), the
last applied sequence and a digest of that batch's bytes.

A start restores a file only if nothing about it is in doubt, and each member only once the
engine vouches for it: the same incarnation, and a replay that still holds the last applied batch
with the same bytes (see ``Subscriber(resume=...)``); the member then goes on from the next
sequence. Anything else — a corrupt, truncated or foreign file, another format version, a file
older than ``state_max_age_s``, other filter settings or pool identity, another incarnation,
history gone, no replay, no answer within ``RESTORE_VOUCH_S`` — is counted and rebuilds that
file's pool, or that member, exactly as a start without a file would. An unusable file is
removed once examined. A usable one stays until the pool's next checkpoint or stop replaces it:
a crash, or a stop before the pool had a generation again, must not lose the only saved state,
and restoring an older state is safe (each member is vouched for at its saved position, or
rebuilt). A hot upgrade's cut lives in a directory of its own and is consumed when read.

The restored generation is a new one for routers (the new process has a new relay incarnation,
as the contract requires); what survives is its coverage.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy.typing as npt
import xxhash

from kvrelay import __version__
from kvrelay.ingest.kinds import EngineKind
from kvrelay.ingest.sink import SourceKey
from kvrelay.pool.pool import Pool
from kvrelay.relay import safe_files, state_file
from kvrelay.relay.engines import PoolIdentity
from kvrelay.relay.settings import PoolSpec

SUFFIX = ".kvstate"
#: A pool's exact state costs well under 32 bytes per membership (a lineage slot and an owners
#: slot at their max loads, with growth slack); a file for more than this many memberships per
#: expected block is refused unread (``max_state_bytes``).
MAX_MEMBERSHIPS_PER_BLOCK = 64
_BYTES_PER_MEMBERSHIP = 32
_FIXED_BYTES = 16 << 20  # header, per-member metadata and minimum table sizes
#: A restored member whose engine has not vouched for it by then is reset.
RESTORE_VOUCH_S = 5.0


@dataclass(frozen=True, slots=True)
class MemberResume:
    """Where one member's saved state stands in its engine's stream."""

    worker_id: int
    dp_rank: int
    engine: str
    incarnation: str  # the engine's instance_id when saved ("" for static engines)
    last_seq: int
    digest: int  # XXH3-64 of the last applied batch's payload
    #: the KV-cache group kinds its decoder had learned (group, full attention), sorted
    groups: tuple[tuple[int, bool], ...] = ()
    #: ``groups`` are not all the kinds it learned: state saved without them, not reset since
    groups_unsure: bool = False
    #: when this position was first saved, for a member restored and not vouched for since (a
    #: file saved with it is no younger: ``save_state``); None: it stands where it is now
    since: float | None = None

    @property
    def key(self) -> SourceKey:
        return SourceKey(self.worker_id, self.dp_rank)


@dataclass(frozen=True, slots=True)
class RestoredPool:
    """A state file that passed every check that does not need the engines."""

    identity: PoolIdentity
    pool_meta: dict[str, Any]
    arrays: dict[str, npt.NDArray[Any]]
    members: dict[SourceKey, MemberResume]
    written_unix: float
    filter_shape: tuple[int, int] = (0, 0)  # (bucket_count, ckf_seed) the file was saved under

    def refiltered(self, spec: PoolSpec) -> bool:
        """Saved under another bucket count or seed: the filter is rebuilt from the state."""
        return self.filter_shape != (spec.bucket_count, spec.ckf_seed)

    def pool(self, spec: PoolSpec) -> Pool:
        return Pool.from_state(
            self.pool_meta, self.arrays, bucket_count=spec.bucket_count, seed=spec.ckf_seed,
            block_size=self.identity.block_size, hash_format=int(spec.hash_format),
            reports=spec.engine_reports, take=True, refilter=self.refiltered(spec),
        )  # fmt: skip


class Refused(Exception):
    """The file is not used; ``kind`` is the counted reason."""

    def __init__(self, kind: str, why: str) -> None:
        super().__init__(why)
        self.kind = kind


def path_for(state_dir: str | Path, spec: PoolSpec) -> Path:
    """One file per pool; named by a digest of its endpoint (names hold ``/`` and more)."""
    digest = xxhash.xxh3_64_hexdigest("/".join(spec.triple).encode())
    return Path(state_dir) / f"pool-{digest}{SUFFIX}"


def remove_orphans(state_dir: Path, keep: set[str], older_than_s: float, now: float) -> int:
    """Remove the state files of pools not configured any more (names not in ``keep``), and
    temporary files a crashed writer left for them, once older than ``older_than_s`` (a state
    file that old is refused as stale anyway, and a young one may still be restored if its
    pool comes back or still be written by a process handing over): the directory does not
    grow with the configuration's history. Returns how many were removed (unlink never follows
    a link)."""
    n = 0
    for p in [*state_dir.glob(f"pool-*{SUFFIX}"), *state_dir.glob(f".pool-*{SUFFIX}.*.tmp")]:
        owner = p.name.lstrip(".").split(".", 1)[0] + SUFFIX
        if owner in keep:
            continue
        try:
            if now - p.lstat().st_mtime > older_than_s:
                p.unlink()
                n += 1
        except OSError:
            continue
    return n


def _has_sglang(spec: PoolSpec) -> bool:
    kinds = [e.kind for e in spec.engines] + ([spec.connect.kind] if spec.connect else [])
    return EngineKind.SGLANG in kinds


def _older_salts(
    header: dict[str, Any], spec: PoolSpec, arrays: dict[str, npt.NDArray[Any]]
) -> bool:
    """A file of a kvrelay that kept the children of an explicitly salted store unsalted while
    namespacing was off: its chains under a namespace are not what this kvrelay computes."""
    if header.get("salts_inherit") is True or spec.decode.cache_salt_namespacing:
        return False
    return any(
        name.endswith(".nmeta") and bool(a.any()) for name, a in arrays.items()
    )


def max_state_bytes(spec: PoolSpec) -> int:
    """The largest file a pool of these settings could have written (a bigger one is refused
    before it is read)."""
    per_block = MAX_MEMBERSHIPS_PER_BLOCK * _BYTES_PER_MEMBERSHIP
    return spec.bucket_count * 8 + per_block * spec.expected_blocks + _FIXED_BYTES


#: Filter settings the exact state does not depend on: a file saved under other values is used,
#: its filter rebuilt from the state (``Pool.from_state(refilter=True)``).
_SHAPE_ONLY = ("bucket_count", "ckf_seed")


def _filter_settings(spec: PoolSpec) -> dict[str, Any]:
    """What shapes the filter and its contents: a file saved under other values of anything but
    ``_SHAPE_ONLY`` (what the canonical hashes are) is not used."""
    return {
        "bucket_count": spec.bucket_count,
        "ckf_seed": spec.ckf_seed,
        "hash_format": int(spec.hash_format),
        "cache_salt_namespacing": spec.decode.cache_salt_namespacing,
        "multimodal_hashing": spec.decode.multimodal_hashing,
        # what a store of a block the member holds counted (a copy, or a report): the counts
        "engine_reports": spec.engine_reports,
    }


#: Content settings older files do not record, read as their defaults (the only value kvrelay
#: 0.1.0 had).
_CONTENT_DEFAULTS = {"engine_reports": False}


def _content(settings: dict[str, Any]) -> dict[str, Any]:
    return _CONTENT_DEFAULTS | {k: v for k, v in settings.items() if k not in _SHAPE_ONLY}


def save(
    state_dir: str | Path,
    spec: PoolSpec,
    identity: PoolIdentity,
    pool: Pool,
    members: list[MemberResume],
    written: state_file.Written | None = None,
) -> int:
    """Write one pool's state atomically (the pool must not change meanwhile); returns the bytes
    written. ``written`` as ``state_file.write``'s."""
    meta, arrays = pool.export_state()
    return save_state(state_dir, spec, identity, meta, arrays, members, written)


def save_state(
    state_dir: str | Path,
    spec: PoolSpec,
    identity: PoolIdentity,
    meta: dict[str, Any],
    arrays: state_file.Arrays,
    members: list[MemberResume],
    written: state_file.Written | None = None,
) -> int:
    """Write an exported state (``Pool.export_state``, a copy of it, or a ``PoolImage``'s
    arrays) atomically; ``written`` as ``state_file.write``'s."""
    header = {
        "kind": "kvrelay-pool-state",
        "kvrelay": __version__,
        "pool_layout": Pool.STATE_VERSION,
        "pool": list(spec.triple),
        # as old as its oldest member not vouched for since a restore: a state carried over
        # restarts unvouched must not look younger than ``state_max_age_s`` allows
        "written_unix": min([time.time(), *(m.since for m in members if m.since is not None)]),
        "filter": _filter_settings(spec),
        "salts_inherit": True,
        "identity": {"model": identity.model, "model_source": identity.model_source,
                     "block_size": identity.block_size},
        "pool_meta": meta,
        "members": [
            {
                "worker_id": m.worker_id, "dp_rank": m.dp_rank, "engine": m.engine,
                "incarnation": m.incarnation, "last_seq": m.last_seq, "digest": m.digest,
                "groups": [[g, full] for g, full in m.groups],
                "groups_unsure": m.groups_unsure,
            }
            for m in members
        ],
    }
    path = path_for(state_dir, spec)
    safe_files.remove_dead_temps(path.parent, path.name)  # a killed writer's, this pool's
    return state_file.write(path, header, arrays, written)


def load(
    state_dir: str | Path,
    spec: PoolSpec,
    *,
    max_age_s: float,
    now: float | None = None,
    keep: bool = False,
) -> RestoredPool | None:
    """Read the pool's file: None when there is none; ``Refused`` when unusable.

    A file that was read and is unusable is consumed (never examined again); a usable one too,
    unless ``keep`` (the state directory's: see the module docstring). One that could not be
    read (a transient ``OSError``: EIO, EMFILE, a permission being fixed, or a symbolic link,
    which is never followed) stays where it is."""
    path = path_for(state_dir, spec)
    try:
        parsed = state_file.read(path, max_state_bytes(spec))
    except FileNotFoundError:
        return None
    except state_file.StateFileError as exc:
        _consume(path)
        raise Refused(exc.kind, f"{path}: {exc}") from None
    except OSError as exc:
        raise Refused("unreadable", f"{path}: {exc}") from None
    try:
        restored = _check(parsed, spec, max_age_s, time.time() if now is None else now)
    except Refused:
        _consume(path)
        raise
    if not keep:
        _consume(path)
    return restored


def _consume(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:  # a file that stays could be restored twice: not used
        raise Refused("unreadable", f"{path}: cannot be consumed: {exc}") from None


def _check(
    parsed: state_file.StateFile, spec: PoolSpec, max_age_s: float, now: float
) -> RestoredPool:
    h = parsed.header
    try:
        if h.get("kind") != "kvrelay-pool-state":
            raise Refused("corrupt", "not a pool state")
        if h.get("pool_layout") not in Pool.READABLE_STATE_VERSIONS:
            raise Refused("version", f"pool layout {h.get('pool_layout')!r}, this kvrelay "
                                     f"uses {Pool.STATE_VERSION}")  # fmt: skip
        if h.get("pool_layout") == 2 and _has_sglang(spec):  # salts were not honoured then
            raise Refused("version", "pool layout 2 indexed SGLang's salted blocks unsalted")
        if _older_salts(h, spec, parsed.arrays):
            raise Refused("version", "saved before an explicit salt's namespace passed on to "
                                     "children")  # fmt: skip
        if h.get("pool") != list(spec.triple):
            raise Refused("incompatible", f"saved for pool {h.get('pool')!r}")
        written = float(h["written_unix"])
        if not now - max_age_s <= written <= now + 60:
            raise Refused("stale", f"written {now - written:.0f} s ago (limit {max_age_s:g} s)")
        saved = h.get("filter")
        want = _filter_settings(spec)
        if not isinstance(saved, dict) or _content(saved) != _content(want):
            raise Refused("incompatible", "saved under other hash, decode or engine_reports "
                                          "settings")
        shape = (int(saved["bucket_count"]), int(saved["ckf_seed"]))
        ident = h["identity"]
        identity = PoolIdentity(
            model=str(ident["model"]), model_source=str(ident["model_source"]),
            block_size=int(ident["block_size"]),
        )  # fmt: skip
        members: dict[SourceKey, MemberResume] = {}
        for m in h["members"]:
            r = MemberResume(
                worker_id=int(m["worker_id"]), dp_rank=int(m["dp_rank"]), engine=str(m["engine"]),
                incarnation=str(m["incarnation"]), last_seq=int(m["last_seq"]),
                digest=int(m["digest"]), groups=_groups(m.get("groups", [])),
                groups_unsure=_groups_unsure(m), since=written,
            )  # fmt: skip
            if not (0 <= r.last_seq < 2**64 and 0 <= r.digest < 2**64):
                raise Refused("corrupt", "member position out of range")
            members[r.key] = r
        meta = h["pool_meta"]
        if not isinstance(meta, dict):
            raise Refused("corrupt", "pool metadata is not an object")
    except Refused:
        raise
    except (KeyError, TypeError, ValueError, OverflowError) as exc:  # inf in an int field
        raise Refused("corrupt", f"header field: {exc}") from None
    return RestoredPool(identity, meta, parsed.arrays, members, written, shape)


#: Group kinds a member may carry (a decoder keeps 64 by index and 1,024 odd ids more).
MAX_SAVED_GROUPS = 2048


def _groups_unsure(m: dict[str, Any]) -> bool:
    """Files of kvrelay before it saved the learned group kinds have no ``groups``: any group
    but those the file lists may be full attention."""
    unsure = m.get("groups_unsure", "groups" not in m)
    if not isinstance(unsure, bool):
        raise Refused("corrupt", "member groups_unsure is not a boolean")
    return unsure


def _groups(raw: Any) -> tuple[tuple[int, bool], ...]:
    """A member's saved group kinds (absent in files of kvrelay before it saved them)."""
    if not isinstance(raw, list) or len(raw) > MAX_SAVED_GROUPS:
        raise Refused("corrupt", "member groups are not a bounded list")
    out = []
    for item in raw:
        if not (isinstance(item, list) and len(item) == 2 and type(item[0]) is int
                and isinstance(item[1], bool) and -(2**31) <= item[0] < 2**31):  # fmt: skip
            raise Refused("corrupt", f"member group {item!r}")
        out.append((item[0], item[1]))
    return tuple(sorted(out))
