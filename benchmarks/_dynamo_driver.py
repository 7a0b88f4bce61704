"""Traffic driver for Dynamo's mocker, run with .venv-dynamo's python inside the benchmark
network namespace: sends the prompts of ``--prompts`` (JSON list of token lists) through Dynamo's
runtime client at ``--rate`` requests/s and prints one JSON line with each request's submit wall
time in µs (the origin of the side-by-side end-to-end latency)."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any


async def amain(a: argparse.Namespace) -> dict[str, Any]:
    from dynamo.runtime import DistributedRuntime  # type: ignore[import-not-found]

    with open(a.prompts) as f:
        prompts: list[list[int]] = json.load(f)["prompts"][a.start : a.start + a.count]
    loop = asyncio.get_running_loop()
    drt = DistributedRuntime(loop, "file", "tcp", event_plane="zmq")
    client = await drt.endpoint(a.endpoint).client()
    await client.wait_for_instances()
    sent: list[tuple[int, int]] = []
    errors = 0
    sem = asyncio.Semaphore(a.concurrency)

    async def one(i: int, tokens: list[int]) -> None:
        nonlocal errors
        req = {
            "token_ids": tokens, "stop_conditions": {"max_tokens": 1, "ignore_eos": True},
            "sampling_options": {}, "output_options": {}, "eos_token_ids": [1],
            "model": a.model, "annotations": [],
        }
        async with sem:
            t = int(time.time() * 1e6)
            try:
                stream = await client.generate(req)
                async for _ in stream:
                    pass
                sent.append((a.start + i, t))
            except Exception:  # counted: a failed request is not a probe
                errors += 1

    t0 = time.perf_counter()
    tasks = []
    for i, tokens in enumerate(prompts):
        due = t0 + i / a.rate
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i, tokens)))
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - t0
    drt.shutdown()
    return {"sent": sorted(sent), "errors": errors, "seconds": elapsed,
            "requests_per_s": len(sent) / elapsed if elapsed else 0.0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--prompts", required=True)
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--count", type=int, default=100)
    p.add_argument("--rate", type=float, default=20.0)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--endpoint", default="testns.mocker.generate")
    p.add_argument("--model", default="fake")
    a = p.parse_args()
    res = asyncio.run(amain(a))
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
