"""Bridge for the heavy-load side by side, run with .venv-dynamo's python inside the benchmark
network namespace: Dynamo's own worker-side ``KvEventPublisher`` subscribes to a vLLM ZMQ
endpoint and republishes every batch on Dynamo's event plane, which ``dynamo.kv_dc_relay`` reads.

This is how a vLLM worker feeds Dynamo's relay in a real deployment (the worker process runs the
publisher beside vLLM), so its CPU is worker-side cost and is reported apart from the relay's.
The endpoint is registered as an aggregated token-input model so the relay materializes a pool
for it; its handler is never called (the benchmark sends no requests).

Prints ``READY`` once the publisher is subscribed; exits on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections.abc import AsyncIterator
from typing import Any


async def amain(a: argparse.Namespace) -> None:
    from dynamo.llm import (  # type: ignore[import-not-found]  # .venv-dynamo only
        KvEventPublisher,
        ModelInput,
        ModelType,
        WorkerType,
        register_model,
    )
    from dynamo.runtime import DistributedRuntime  # type: ignore[import-not-found]

    loop = asyncio.get_running_loop()
    drt = DistributedRuntime(loop, "file", "tcp", event_plane="zmq")
    endpoint = drt.endpoint(a.endpoint)

    async def handler(_request: Any) -> AsyncIterator[dict[str, Any]]:
        yield {"token_ids": [], "finish_reason": "stop"}  # never called by the benchmark

    await register_model(ModelInput.Tokens, ModelType.Chat, endpoint, a.model_path, a.model,
                         worker_type=WorkerType.Aggregated, kv_cache_block_size=a.block_size)
    serving = asyncio.ensure_future(endpoint.serve_endpoint(handler))
    publisher = KvEventPublisher(endpoint=endpoint, kv_block_size=a.block_size,
                                 zmq_endpoint=a.zmq, zmq_topic="")
    print("READY", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    publisher.shutdown()
    serving.cancel()
    drt.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--zmq", required=True, help="vLLM ZMQ PUB endpoint, tcp://127.0.0.1:PORT")
    p.add_argument("--endpoint", default="benchns.backend.generate")
    p.add_argument("--model-path", required=True)
    p.add_argument("--model", default="bench-model")
    p.add_argument("--block-size", type=int, default=16)
    asyncio.run(amain(p.parse_args()))


if __name__ == "__main__":
    main()
