"""kvrelay: a Dynamo ``dynamo.kvrelay.v1.KvEventRelay`` for vLLM fleets."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvrelay")
except PackageNotFoundError:  # pragma: no cover - running from a source tree without install
    __version__ = "0.0.0+unknown"

#: Versions this release was built and tested against (README "Supported versions").
SUPPORTED_VLLM = ">=0.10 (array era <=0.23, map era >=0.24; vllm.Control discovery >=0.27)"
SUPPORTED_DYNAMO = "dynamo.kvrelay.v1 as served by ai-dynamo 1.6.1"

__all__ = ["SUPPORTED_DYNAMO", "SUPPORTED_VLLM", "__version__"]
