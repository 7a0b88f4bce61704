"""Faults an operator's disk or a hostile writer can put at the state file's path: a header
that the JSON parser itself refuses (nesting past the recursion limit, an integer past the digit
limit, infinity in an integer field, array shapes numpy refuses) is a typed, consumed refusal; a
header built to inflate into gigabytes of Python objects is refused before it is parsed; a
second relay's start never removes the temporary file a running one is writing."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

from kvrelay.pool.pool import Pool
from kvrelay.relay import handover, safe_files, state_file
from kvrelay.relay.engines import PoolIdentity
from kvrelay.relay.settings import EngineSpec, PoolSpec

SPEC = PoolSpec(namespace="ns", component="c", endpoint="e", expected_blocks=4096,
                engines=(EngineSpec(name="e0", host="127.0.0.1", grpc_port=1),))  # fmt: skip
IDENT = PoolIdentity(model="m", model_source="m", block_size=4)


def _container(head: bytes, body: bytes = b"") -> bytes:
    """A file with a valid magic, version, layout and checksum around ``head`` (XXH3 is no MAC:
    whoever writes the file can make its checksum agree)."""
    prefix = struct.pack("<8sII", state_file.MAGIC, state_file.FORMAT_VERSION, len(head)) + head
    prefix += b"\0" * (-len(prefix) % 64)
    data = prefix + body
    return data + xxhash.xxh3_128(data).digest()


def _saved_header(tmp_path: Path) -> dict[str, Any]:
    pool = Pool(SPEC.bucket_count, SPEC.ckf_seed, 4, int(SPEC.hash_format))
    pool.add_member(1, 0)
    handover.save(tmp_path, SPEC, IDENT, pool,
                  [handover.MemberResume(1, 0, "e0", "inc", 5, 7)])  # fmt: skip
    return dict(state_file.decode(handover.path_for(tmp_path, SPEC).read_bytes()).header)


def _with(h: dict[str, Any], field: str, literal: str, **changes: Any) -> bytes:
    """``h`` (arrays dropped) with ``changes``, one string value ``"@"`` of them then written as
    the raw JSON ``literal`` in ``field``'s place (json.dumps refuses to write such values)."""
    text = json.dumps({**h, "arrays": [], **changes})
    return _container(text.replace(f'"{field}": "@"', f'"{field}": {literal}', 1).encode())


def _array(shape: object, nbytes: int = 0) -> bytes:
    spec = {"name": "a", "dtype": "u8", "shape": shape, "offset": 0, "nbytes": nbytes}
    return _container(json.dumps({"arrays": [spec]}).encode(), b"\0" * (nbytes + -nbytes % 64))


def _member(**fields: Any) -> list[dict[str, Any]]:
    m = {"worker_id": 1, "dp_rank": 0, "engine": "e0", "incarnation": "inc", "last_seq": 5,
         "digest": 7}  # fmt: skip
    return [{**m, **fields}]


HOSTILE: dict[str, Any] = {
    "nesting_past_the_recursion_limit": lambda h: _container(b"[" * 100_000 + b"]" * 100_000),
    "an_integer_past_the_digit_limit": lambda h: _with(
        h, "worker_id", "9" * 5000, members=_member(worker_id="@")),
    "infinity_for_a_sequence": lambda h: _with(h, "last_seq", "1e400",
                                               members=_member(last_seq="@")),
    "infinity_for_a_worker": lambda h: _with(h, "worker_id", "-Infinity",
                                             members=_member(worker_id="@")),
    "a_zero_size_array_with_a_dimension_past_any_index": lambda h: _array([0, 2**70]),
    "more_dimensions_than_numpy_has": lambda h: _array([1] * 100, 8),
    "a_boolean_dimension": lambda h: _array([True], 8),
}  # fmt: skip


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_header_the_parser_refuses_is_a_typed_refusal_and_consumed(
    tmp_path: Path, case: str
) -> None:
    """Each of these escaped as RecursionError, ValueError, TypeError or OverflowError: a start
    counted it only through its catch-all and left the file to be read again at every start, and
    a hot upgrade's successor failed with a traceback instead of refusing the cut typed."""
    path = handover.path_for(tmp_path, SPEC)
    path.write_bytes(HOSTILE[case](_saved_header(tmp_path)))
    with pytest.raises(handover.Refused) as err:
        handover.load(tmp_path, SPEC, max_age_s=60, keep=True)
    assert err.value.kind == "corrupt", err.value
    assert not path.exists(), "an unusable file that was examined is consumed"


@pytest.mark.parametrize("unit", [b"{},", b'"ab",'])
def test_a_header_built_to_inflate_is_refused_within_bounded_memory(
    tmp_path: Path, unit: bytes
) -> None:
    """A 16 MiB header (the most a header may be, and far less than the file size a pool's
    bound admits) of empty objects made the reader hold 420 MiB of dicts before it found the
    header unusable: a container's memory limit killed the relay at every start, the file still
    there. Its containers and separators are now counted first."""
    n = (state_file.MAX_HEADER_BYTES - 64) // len(unit)
    head = b"[" + unit * n + unit[:-1] + b"]"
    assert len(head) <= state_file.MAX_HEADER_BYTES
    path = handover.path_for(tmp_path, SPEC)
    path.write_bytes(_container(head))
    del head
    tracemalloc.start()
    try:
        with pytest.raises(handover.Refused) as err:
            handover.load(tmp_path, SPEC, max_age_s=60, keep=True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert err.value.kind == "corrupt"
    assert peak < 40 << 20, f"{peak >> 20} MiB to refuse a 16 MiB header"


def test_a_real_header_is_well_within_the_parse_bounds(tmp_path: Path) -> None:
    """The bounds cost a real file nothing: 64 members with groups load, using a small share."""
    pool = Pool(SPEC.bucket_count, SPEC.ckf_seed, 4, int(SPEC.hash_format))
    members = []
    for w in range(64):
        pool.add_member(w, 0)
        members.append(handover.MemberResume(w, 0, f"engine-{w}", "0" * 32, 10**6, 2**63,
                                             ((0, True), (1, False))))  # fmt: skip
    handover.save(tmp_path, SPEC, IDENT, pool, members)
    raw = handover.path_for(tmp_path, SPEC).read_bytes()
    head = raw[16:16 + struct.unpack("<8sII", raw[:16])[2]]
    containers = head.count(b"{") + head.count(b"[")
    separators = head.count(b",") + head.count(b":")
    # 20K members of this size fit both bounds, as they fit MAX_HEADER_BYTES
    per = state_file.MAX_HEADER_BYTES / len(head)
    assert containers * per <= state_file.MAX_HEADER_CONTAINERS * 1.1
    assert separators * per <= state_file.MAX_HEADER_SEPARATORS * 1.1
    r = handover.load(tmp_path, SPEC, max_age_s=60, keep=True)
    assert r is not None and len(r.members) == 64
    assert r.pool(SPEC).members() == pool.members()


_WRITER = """
import sys, time
from pathlib import Path
from kvrelay.relay import safe_files
fd, tmp = safe_files.create_temp(Path(sys.argv[1]), sys.argv[2])
print(tmp, flush=True)
time.sleep(60)
"""

_SWEEP = """
import sys
from pathlib import Path
from kvrelay.relay import safe_files
print(safe_files.remove_stale_temps(Path(sys.argv[1]), sys.argv[2]))
"""


def _sweep(d: Path, name: str) -> int:
    """A start's sweep, run by another process (a second relay on the same state directory)."""
    out = subprocess.run([sys.executable, "-c", _SWEEP, str(d), name], check=True,
                         capture_output=True, text=True, timeout=30).stdout  # fmt: skip
    return int(out)


_EXITING_WRITER = """
import sys
from pathlib import Path
from kvrelay.relay import safe_files
fd, tmp = safe_files.create_temp(Path(sys.argv[1]), sys.argv[2])
print(tmp, flush=True)
"""


def test_a_writer_that_exited_unreaped_or_whose_pid_was_reused_is_dead(tmp_path: Path) -> None:
    """A checkpoint's writer killed mid-write and not reaped yet (a zombie: its parent has not
    waited for it) still answers ``kill(pid, 0)``; so does an unrelated process that took its
    pid since. Its temporary file stayed (the size of a pool's state) through every save of the
    process after it; each save now removes it. A live writer's file stays."""
    path = handover.path_for(tmp_path, SPEC)
    exiting = subprocess.Popen([sys.executable, "-c", _EXITING_WRITER, str(tmp_path), path.name],
                               stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert exiting.stdout is not None
    gone = Path(exiting.stdout.readline().strip())
    try:
        deadline = time.monotonic() + 30
        while Path(f"/proc/{exiting.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline, "the writer never exited"
            time.sleep(0.05)
        os.kill(exiting.pid, 0)  # (a zombie: kill still finds it)
        assert gone.exists()
        live = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), path.name],
                                stdout=subprocess.PIPE, text=True)  # fmt: skip
        sleeper = subprocess.Popen(["sleep", "60"])
        try:
            assert live.stdout is not None
            held = Path(live.stdout.readline().strip())
            # a file "of" the sleeper, written an hour before the sleeper started: a reused pid
            reused = tmp_path / f".{path.name}.{sleeper.pid}.cccccccccccc{safe_files.TEMP_SUFFIX}"
            reused.write_bytes(b"x" * 4096)
            os.utime(reused, (time.time() - 3600, time.time() - 3600))
            assert safe_files.remove_dead_temps(tmp_path, path.name) == 2
            assert not gone.exists() and not reused.exists()
            assert held.exists(), "a live writer's file is left alone"
        finally:
            for p in (live, sleeper):
                p.kill()
                p.wait()
    finally:
        exiting.wait()


def test_a_second_relays_start_leaves_the_running_ones_checkpoint_alone(tmp_path: Path) -> None:
    """Two relays configured with the same state directory: the second one's start removed every
    temporary file of the pool, the first one's checkpoint being written among them, and that
    checkpoint then failed at its rename (ENOENT). A writer holds a lock on its temporary file
    now; the sweep removes only the files nobody holds, however their writer ended."""
    path = handover.path_for(tmp_path, SPEC)
    state_file.write(path, {"k": 1}, {"a": np.arange(8, dtype=np.uint64)})
    fd, tmp = safe_files.create_temp(tmp_path, path.name)  # this relay's checkpoint, mid-write
    safe_files.write_all(fd, b"partial")
    assert _sweep(tmp_path, path.name) == 0
    assert tmp.exists(), "a live writer's temporary file is left alone"
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    safe_files.write_all(fd, state_file.encode({"k": 2}, {"a": np.arange(9, dtype=np.uint64)}))
    safe_files.commit(fd, tmp, path)  # its checkpoint completes
    assert state_file.read(path).header == {"k": 2}

    # another process's file: kept while it lives, removed once it is gone (killed mid-write)
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), path.name],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert writer.stdout is not None
        other = Path(writer.stdout.readline().strip())
        assert other.exists()
        assert safe_files.remove_stale_temps(tmp_path, path.name) == 0 and other.exists()
    finally:
        writer.kill()
        writer.wait()
    assert safe_files.remove_stale_temps(tmp_path, path.name) == 1
    assert not other.exists(), "a killed writer's temporary file goes at the next start"
    # a previous incarnation's file, named with this process's own pid (a container's pid 1)
    stale = tmp_path / f".{path.name}.{os.getpid()}.aaaaaaaaaaaa{safe_files.TEMP_SUFFIX}"
    stale.write_bytes(b"x" * 4096)
    assert safe_files.remove_stale_temps(tmp_path, path.name) == 1 and not stale.exists()
    # planted at a temporary name: a link (its target untouched) and a FIFO, removed unopened
    target = tmp_path.parent / f"{tmp_path.name}-target"
    target.write_bytes(b"keep")
    link = tmp_path / f".{path.name}.1.bbbbbbbbbbbb{safe_files.TEMP_SUFFIX}"
    link.symlink_to(target)
    os.mkfifo(tmp_path / f".{path.name}.2.cccccccccccc{safe_files.TEMP_SUFFIX}")
    assert safe_files.remove_stale_temps(tmp_path, path.name) == 2
    assert target.read_bytes() == b"keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]
