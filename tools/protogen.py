"""Regenerate the betterproto2 package from ``protos/`` (``make proto``).

Kept as a module, not a shell line, so the freshness test and ``make proto`` run the exact same
generator invocation. A developer tool: it is not part of the installed package.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "protos"
PROTO_FILES = ("dynamo/kvrelay/v1/relay.proto", "vllm/control.proto")


def _plugin_path() -> str:
    candidate = Path(sys.executable).with_name("protoc-gen-python_betterproto2")
    if candidate.exists():
        return str(candidate)
    found = shutil.which("protoc-gen-python_betterproto2")
    if found is None:
        raise RuntimeError("betterproto2-compiler is not installed (pip install '.[dev]')")
    return found


def generate(out_dir: Path, proto_root: Path = PROTO_ROOT) -> None:
    """Generate async client + async grpclib server code for both protos into ``out_dir``."""
    from grpc_tools import protoc

    # The compiler formats its output by running the ``ruff`` executable: make the venv's own
    # (pinned) ruff the one it finds, so output is reproducible.
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{proto_root}",
        f"--plugin=protoc-gen-python_betterproto2={_plugin_path()}",
        f"--python_betterproto2_out={out_dir}",
        "--python_betterproto2_opt=client_generation=async,server_generation=async",
        *(str(proto_root / f) for f in PROTO_FILES),
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    target = Path(argv[0]) if argv else REPO / "kvrelay" / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(tmp, target)
    print(f"generated {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
