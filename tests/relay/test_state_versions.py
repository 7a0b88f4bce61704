"""Pool state files of earlier kvrelays (layout 2, before copy counts and SGLang salts):
read for vLLM pools (every hash held once), refused for pools with SGLang engines (their
salted blocks were indexed unsalted then); and files from before an explicit salt's namespace
passed on to children."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvrelay.pool.batch import BatchBuilder
from kvrelay.pool.pool import Pool
from kvrelay.relay import handover, state_file
from kvrelay.relay.engines import PoolIdentity
from kvrelay.relay.settings import EngineSpec, PoolSpec
from kvrelay.sim.config import SimConfig
from tests.support.sglang import sglang_spec


def _spec(sglang: bool) -> PoolSpec:
    engine = (
        sglang_spec(SimConfig(name="e0", flavor="sglang", pub_port=5000))
        if sglang
        else EngineSpec(name="e0", host="127.0.0.1", grpc_port=5000)
    )
    return PoolSpec(
        namespace="ns", component="backend", endpoint="generate", engines=(engine,),
        expected_blocks=4096, model="m", kv_block_size=4,
    )  # fmt: skip


def _saved_as_version_2(tmp_path: Path, spec: PoolSpec) -> Pool:
    pool = Pool(spec.bucket_count, spec.ckf_seed, 4, 1)
    m = pool.add_member(1, 0)
    pool.apply(m, BatchBuilder().store([1, 2], list(range(8))).build())
    handover.save(tmp_path, spec, PoolIdentity("m", "m", 4), pool, [])
    path = handover.path_for(tmp_path, spec)
    parsed = state_file.read(path)
    copies = (".ckeys", ".cvals", ".cmeta")  # version 2 had no copy-count tables
    old = {k: a for k, a in parsed.arrays.items() if not k.endswith(copies)}
    state_file.write(path, {**parsed.header, "pool_layout": 2}, old)
    return pool


def test_a_version_2_file_restores_a_vllm_pool(tmp_path: Path) -> None:
    spec = _spec(sglang=False)
    pool = _saved_as_version_2(tmp_path, spec)
    restored = handover.load(tmp_path, spec, max_age_s=3600)
    assert restored is not None
    assert restored.pool(spec).snapshot_state() == pool.snapshot_state()


def test_a_version_2_file_of_an_sglang_pool_is_refused(tmp_path: Path) -> None:
    spec = _spec(sglang=True)
    _saved_as_version_2(tmp_path, spec)
    with pytest.raises(handover.Refused) as info:
        handover.load(tmp_path, spec, max_age_s=3600)
    assert info.value.kind == "version"


@pytest.mark.parametrize("reports", [False, True])
def test_a_file_that_does_not_record_engine_reports_was_saved_with_the_default(
    tmp_path: Path, reports: bool
) -> None:
    """Older files do not record ``engine_reports``; they were saved with ``false``, the only
    value kvrelay 0.1.0 had: used under it, refused under ``true``."""
    spec = _spec(sglang=False)
    _saved_as_version_2(tmp_path, spec)
    path = handover.path_for(tmp_path, spec)
    parsed = state_file.read(path)
    del parsed.header["filter"]["engine_reports"]
    path.unlink()
    state_file.write(path, parsed.header, parsed.arrays)
    spec = dataclasses.replace(spec, engine_reports=reports)
    if not reports:
        assert handover.load(tmp_path, spec, max_age_s=3600) is not None
        return
    with pytest.raises(handover.Refused) as info:
        handover.load(tmp_path, spec, max_age_s=3600)
    assert info.value.kind == "incompatible"


@pytest.mark.parametrize("salted", [False, True])
@pytest.mark.parametrize("namespacing", [False, True])
def test_a_file_from_before_salts_passed_on_is_refused_only_where_that_changed_its_chains(
    tmp_path: Path, salted: bool, namespacing: bool
) -> None:
    """Files of a kvrelay that kept the children of an explicitly salted store unsalted with
    namespacing off: refused when they hold namespaced chains there (a child's canonical hash
    is another now), used otherwise (the same chains either way)."""
    spec = _spec(sglang=False)
    spec = dataclasses.replace(
        spec, decode=dataclasses.replace(spec.decode, cache_salt_namespacing=namespacing)
    )
    pool = Pool(spec.bucket_count, spec.ckf_seed, 4, 1)
    m = pool.add_member(1, 0)
    ns = 0x1234 if salted else 0
    pool.apply(m, BatchBuilder().store([1], list(range(4)), salt=1337 + ns, ns_part=ns).build())
    handover.save(tmp_path, spec, PoolIdentity("m", "m", 4), pool, [])
    path = handover.path_for(tmp_path, spec)
    parsed = state_file.read(path)
    assert parsed.header.pop("salts_inherit") is True
    path.unlink()
    state_file.write(path, parsed.header, parsed.arrays)
    if salted and not namespacing:
        with pytest.raises(handover.Refused) as info:
            handover.load(tmp_path, spec, max_age_s=3600)
        assert info.value.kind == "version"
        return
    restored = handover.load(tmp_path, spec, max_age_s=3600)
    assert restored is not None
    assert restored.pool(spec).snapshot_state() == pool.snapshot_state()
