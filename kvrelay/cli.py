"""Command-line entry point (``kvrelay`` and ``python -m kvrelay``).

Exit codes: 0 success, 1 runtime failure, 2 usage or configuration error.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvrelay import SUPPORTED_DYNAMO, SUPPORTED_VLLM, __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvrelay",
        description=(
            "kvrelay: Dynamo's dynamo.kvrelay.v1.KvEventRelay for vLLM fleets. "
            "Ingests vLLM KV-cache events over ZMQ and serves cuckoo-filter streams to routers."
        ),
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"kvrelay {__version__} (vLLM {SUPPORTED_VLLM}; {SUPPORTED_DYNAMO})",
    )
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    return 0  # pragma: no cover - subcommands arrive with later issues


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
