"""vLLM-compatible engine simulator (ZMQ KV events, replay, Control gRPC, /metrics).

Written for kvrelay from the wire spec; contains no vLLM code.
"""

from kvrelay.sim.blocks import HeldBlock
from kvrelay.sim.config import LoraInfo, SimConfig
from kvrelay.sim.engine import SimEngine, SimFleet
from kvrelay.sim.hashing import dynamo_sequence_hashes
from kvrelay.sim.traffic import TrafficConfig
from kvrelay.sim.wire import Era, HashMode, offset_endpoint

__all__ = [
    "Era",
    "HashMode",
    "HeldBlock",
    "LoraInfo",
    "SimConfig",
    "SimEngine",
    "SimFleet",
    "TrafficConfig",
    "dynamo_sequence_hashes",
    "offset_endpoint",
]
