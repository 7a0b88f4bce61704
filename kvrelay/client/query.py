"""Per-pool query planning: which pools serve a model and how their hashes are seeded (§7).

Each pool hashes with its OWN ``query_semantics`` (block size, STANDARD/EAGLE) and the request's
salt: LoRA salt = the canonical adapter name from the registration's ``ModelTarget.lora`` (never
an alias), plus the request's ``cache_salt`` as cache namespace.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.client.hashes import block_hashes, request_salt, sequence_hashes


@dataclass(frozen=True, slots=True)
class QueryPlan:
    """How to query one pool for a request."""

    block_size: int
    eagle: bool
    adapter: str | None  # canonical LoRA adapter name used in the salt
    base_model: str  # canonical id of the pool's base registration
    lora_model: str | None  # canonical id of the LoRA registration (readiness lookup)

    def salt(self, cache_salt: str | None) -> int:
        return request_salt(self.adapter, cache_salt)


def _names(reg: pb.ModelRegistration) -> set[str]:
    return {reg.canonical_model_id, *reg.aliases}


def _known_target(reg: pb.ModelRegistration) -> bool:
    """A registration whose ``ModelTarget`` is a base model or a LoRA adapter. An unset target
    may be a variant added to the oneof after this SDK (§3.3): its pool is unsupported, and the
    registration is never read as a base model (its hashes may be salted otherwise)."""
    t = reg.target
    return t is not None and (t.base is not None or t.lora is not None)


def plan_for(
    desc: pb.KvPoolDescriptor, model: str, lora: str | None = None
) -> QueryPlan | None:
    """The plan for ``model`` (canonical id or alias; may name a LoRA registration) and an
    optional explicit ``lora`` adapter on a base model, or None if the pool does not serve it."""
    qs = desc.query_semantics
    if qs is None or qs.kv_block_size <= 0:
        return None
    fmt = int(qs.hash_format)
    if fmt not in (1, 2):
        return None  # unknown hash format: fail closed
    if not all(_known_target(r) for r in desc.registrations):
        return None  # a target of a kind this SDK does not know: the whole pool is unsupported
    bases = [r for r in desc.registrations if r.target is not None and r.target.base is not None]
    loras = [r for r in desc.registrations if r.target is not None and r.target.lora is not None]
    base_id = bases[0].canonical_model_id if bases else ""
    chosen: pb.ModelRegistration | None = None
    for reg in desc.registrations:
        if model in _names(reg):
            chosen = reg
            break
    if chosen is None or chosen.target is None:
        return None
    adapter: str | None = None
    lora_model: str | None = None
    if chosen.target.lora is not None:
        adapter = chosen.target.lora.adapter
        lora_model = chosen.canonical_model_id
        if lora is not None and lora not in (adapter, *_names(chosen)):
            return None
    elif lora is not None:
        match = [
            r for r in loras
            if r.target is not None and r.target.lora is not None
            and (lora == r.target.lora.adapter or lora in _names(r))
        ]  # fmt: skip
        if not match:
            return None
        lt = match[0].target
        assert lt is not None and lt.lora is not None
        adapter = lt.lora.adapter
        lora_model = match[0].canonical_model_id
    return QueryPlan(int(qs.kv_block_size), fmt == 2, adapter, base_id, lora_model)


class HashCache:
    """Sequence hashes of one prompt, computed once per (block size, format, salt)."""

    def __init__(self, tokens: object) -> None:
        self.tokens = tokens
        self._cache: dict[tuple[int, bool, int], np.ndarray] = {}

    def get(self, block_size: int, eagle: bool, salt: int) -> np.ndarray:
        key = (block_size, eagle, salt)
        out = self._cache.get(key)
        if out is None:
            out = sequence_hashes(block_hashes(self.tokens, block_size, salt, eagle))
            self._cache[key] = out
        return out
