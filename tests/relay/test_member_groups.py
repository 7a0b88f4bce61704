"""A member resumed from saved state keeps the KV-cache group kinds its decoder had learned.

vLLM names a store's kind (``kv_cache_spec_kind``) but a remove only its ``group_idx``; the
decoder learns each group's kind from the stores and gates removes by it (an unlearned
non-zero group is dropped). Hybrid models often number their full-attention group above 0, so
a member that restarted without what it had learned would drop that group's removes, and keep
their blocks for ever. State saved before the kinds were (no ``groups`` in the file) resumes
with the kinds unsure: the removes of any group not learned since are applied. The oracle: the
decoder's own gating on both decode paths, and the state file's header through a real write and
read.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvrelay.ingest.decoder import Decoder
from kvrelay.pool.pool import Pool
from kvrelay.relay import handover, state_file
from kvrelay.relay.engines import PoolIdentity
from kvrelay.relay.handover import MemberResume
from kvrelay.relay.settings import EngineSpec, PoolSpec
from tests.support import vllm_wire as W

B = 16


def _remove_of_group_2() -> bytes:
    return W.batch([W.removed("map", [7], group_idx=2)])


def test_a_decoder_given_what_was_learned_keeps_the_removes_of_that_group() -> None:
    learner = Decoder(kv_block_size=B, dp_rank=0)
    stores = W.batch([
        W.stored("map", block_hashes=[7], token_ids=list(range(B)), block_size=B, group_idx=2,
                 kv_cache_spec_kind="full_attention"),
        W.stored("map", block_hashes=[8], token_ids=list(range(B)), block_size=B, group_idx=1,
                 kv_cache_spec_kind="sliding_window"),
    ])  # fmt: skip
    learner.decode(stores)
    assert learner.learned_groups() == {1: False, 2: True}
    fresh = Decoder(kv_block_size=B, dp_rank=0)
    assert fresh.decode(_remove_of_group_2()).stats.drops == {"group": 1}  # unlearned: dropped
    resumed = Decoder(kv_block_size=B, dp_rank=0)
    resumed.learn_groups(learner.learned_groups())
    res = resumed.decode(_remove_of_group_2())
    assert res.stats.drops == {} and res.batch.ext_hashes.tolist() == [7]


def _store(group: int, kind: str | None, h: int = 9) -> bytes:
    return W.batch([W.stored("map", block_hashes=[h], token_ids=list(range(B)), block_size=B,
                             group_idx=group, kv_cache_spec_kind=kind)])  # fmt: skip


@pytest.mark.parametrize("fast", [True, False])
def test_unsure_kinds_apply_every_unlearned_remove_and_gate_kindless_stores(fast: bool) -> None:
    """Resumed without saved kinds: a remove of a group not learned is applied (a miss at
    worst, never a phantom); a kind-less store of such a group stays gated as before; a store
    that names its kind teaches it, and a reset forgets the doubt with the rest."""
    d = Decoder(kv_block_size=B, dp_rank=0, fast=fast)
    d.learn_groups({1: False})
    d.assume_unsure_groups()
    assert d.groups_unsure and d.learned_groups() == {1: False}
    res = d.decode(_remove_of_group_2())
    assert res.stats.drops == {} and res.batch.ext_hashes.tolist() == [7]
    assert d.decode(W.batch([W.removed("map", [8], group_idx=1)])).stats.drops == {"group": 1}
    assert d.decode(_store(3, None)).stats.drops == {"non_full_attention": 1}
    assert d.decode(_store(0, None)).batch.ext_hashes.tolist() == [9]
    d.decode(_store(2, "sliding_window"))
    assert d.learned_groups() == {1: False, 2: False}
    assert d.decode(_remove_of_group_2()).stats.drops == {"group": 1}
    d.reset()
    assert not d.groups_unsure
    assert d.decode(W.batch([W.removed("map", [7], group_idx=5)])).stats.drops == {"group": 1}


def _spec() -> PoolSpec:
    return PoolSpec(namespace="ns", component="c", endpoint="e", expected_blocks=1 << 12,
                    engines=(EngineSpec(name="e0", host="127.0.0.1", grpc_port=1),))  # fmt: skip


def test_the_state_file_keeps_each_member_s_groups(tmp_path: Path) -> None:
    spec, ident = _spec(), PoolIdentity(model="m", model_source="m", block_size=1)
    members = [
        MemberResume(1, 0, "e0", "", 41, 5, ((1, False), (2, True))),
        MemberResume(2, 0, "e0", "", 9, 6),  # nothing learned
    ]
    handover.save(tmp_path, spec, ident, Pool(1 << 12, 7, 1, 1), members)
    restored = handover.load(tmp_path, spec, max_age_s=60)
    assert restored is not None
    assert {k.worker_id: m.groups for k, m in restored.members.items()} == {
        1: ((1, False), (2, True)),
        2: (),
    }
    assert not any(m.groups_unsure for m in restored.members.values())


@pytest.mark.parametrize("saved", ["absent", "unsure"])
def test_a_member_saved_without_its_kinds_resumes_unsure(tmp_path: Path, saved: str) -> None:
    """A file of kvrelay before the kinds were saved has no ``groups``; a member resumed from
    one and saved again before a reset says so again (with what it learned meanwhile)."""
    spec, ident = _spec(), PoolIdentity(model="m", model_source="m", block_size=1)
    member = MemberResume(1, 0, "e0", "", 41, 5, ((2, True),), saved == "unsure")
    handover.save(tmp_path, spec, ident, Pool(1 << 12, 7, 1, 1), [member])
    if saved == "absent":
        path = handover.path_for(tmp_path, spec)
        old = state_file.read(path)
        del old.header["members"][0]["groups"], old.header["members"][0]["groups_unsure"]
        path.unlink()
        state_file.write(path, old.header, old.arrays)
    restored = handover.load(tmp_path, spec, max_age_s=60)
    assert restored is not None
    (m,) = restored.members.values()
    assert m.groups_unsure
    assert m.groups == (() if saved == "absent" else ((2, True),))


@pytest.mark.parametrize("bad", ["full", [[2, "yes"]], [[2]], [["2", True]], [[2, True]] * 3000])
def test_a_file_with_malformed_groups_is_refused(tmp_path: Path, bad: object) -> None:
    spec, ident = _spec(), PoolIdentity(model="m", model_source="m", block_size=1)
    handover.save(tmp_path, spec, ident, Pool(1 << 12, 7, 1, 1),
                  [MemberResume(1, 0, "e0", "", 41, 5, ((2, True),))])  # fmt: skip
    path = handover.path_for(tmp_path, spec)
    saved = state_file.read(path)
    saved.header["members"][0]["groups"] = bad
    path.unlink()
    state_file.write(path, saved.header, saved.arrays)
    with pytest.raises(handover.Refused) as exc:
        handover.load(tmp_path, spec, max_age_s=60)
    assert exc.value.kind == "corrupt"


@pytest.mark.parametrize("fast", [True, False])
def test_another_rank_s_batch_teaches_no_group_kinds(fast: bool) -> None:
    """A batch naming another DP rank is dropped whole: the kinds its stores name are not
    learned either, on the walker as on the msgspec path (they agreed on everything else)."""
    from kvrelay.ingest.errors import DpRankMismatchError

    d = Decoder(kv_block_size=B, dp_rank=0, fast=fast)
    other = W.batch([W.stored("map", block_hashes=[7], token_ids=list(range(B)), block_size=B,
                              group_idx=1, kv_cache_spec_kind="full_attention")],
                    dp=1)  # fmt: skip
    with pytest.raises(DpRankMismatchError):
        d.decode(other)
    assert d.learned_groups() == {}
    assert d.decode(W.batch([W.removed("map", [7], group_idx=1)])).stats.drops == {"group": 1}
