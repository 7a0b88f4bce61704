"""Which engine family publishes a stream: the decoder and frame checks differ per kind.

vLLM and SGLang share the ZMQ framing and the msgpack event vocabulary, but not every field
position, nor the topic frame (``docs/contract.md`` §21).
"""

from __future__ import annotations

import enum


class EngineKind(enum.Enum):
    VLLM = "vllm"
    SGLANG = "sglang"


ENGINE_KINDS: dict[str, EngineKind] = {k.value: k for k in EngineKind}
