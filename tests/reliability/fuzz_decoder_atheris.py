"""Coverage-guided fuzz target for the frame checks + msgpack decoder (libFuzzer via atheris).

Not collected by pytest (the suite fuzzes the same contract with hypothesis in
``test_fuzz_decoder.py``). Run it where atheris is installed (it is not in the project venv)::

    pip install atheris
    python tests/reliability/fuzz_decoder_atheris.py -max_total_time=300 [corpus_dir]

Contract checked per input: the frame checks raise only ``FrameError``; ``Decoder.decode`` returns
a batch or raises a ``DecodeError`` subclass; a returned batch applies to a ``Pool`` without an
exception or an exact-state invariant violation. Anything else crashes the fuzzer with the input.
"""

from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports():
    from kvrelay.ingest.decoder import Decoder
    from kvrelay.ingest.errors import DecodeError, FrameError
    from kvrelay.ingest.frames import check_live
    from kvrelay.pool.pool import Pool


def _split_frames(data: bytes) -> list[bytes]:
    """Frame boundaries from the input itself: the first byte picks the frame count (1..4)."""
    if not data:
        return [b""]
    n = data[0] % 4 + 1
    body = data[1:]
    step = max(1, len(body) // n)
    return [body[i * step : (i + 1) * step if i < n - 1 else len(body)] for i in range(n)]


def test_one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    mode = fdp.ConsumeIntInRange(0, 2)
    fast = fdp.ConsumeBool()
    rest = fdp.ConsumeBytes(fdp.remaining_bytes())
    payload = rest
    if mode == 0:  # through the live frame checks first
        try:
            _seq, payload = check_live(_split_frames(rest), b"")
        except FrameError:
            return
    decoder = Decoder(kv_block_size=16, dp_rank=0, fast=fast)
    pool = Pool(bucket_count=1024, seed=1, block_size=16, hash_format=1)
    chunks = [payload] if mode != 2 else [payload[: len(payload) // 2], payload]
    for chunk in chunks:  # mode 2: a prefix then the whole (decoder state carried over)
        try:
            res = decoder.decode(chunk)
        except DecodeError:
            continue
        before = pool.invariant_violations
        pool.apply(pool.add_member(1, 0), res.batch)
        if pool.invariant_violations != before:
            raise AssertionError("decoded batch broke the pool's exact-state invariants")


def main() -> None:
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
