"""docs/vllm.md's recipes, run as written against kvrelay's vLLM simulator.

The simulator form of each recipe is run exactly as docs/vllm.md prints it (``kvrelay sim MODEL``
with the ``vllm serve`` line's flags: the simulator takes vLLM's names and the same
``--kv-events-config`` JSON), and it is checked to be the documented ``vllm serve`` line with
``kvrelay sim`` in its place; the documented TOML is the relay's config, and the documented
verify commands are run. Only the port numbers change: every
documented port is moved into one free block with the same offsets (a shared machine may already
use 8000 or 50161), and the relay's default ports are moved with the documented ``KVRELAY_*``
overrides.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from kvrelay.sim.ports import free_port_block
from tests.support.commands import REPO, clean_env
from tests.support.timing import scaled

DOC = REPO / "docs" / "vllm.md"
RECIPE = re.compile(r"<!-- recipe:([a-z-]+) -->\n```[a-z]+\n(.*?)\n```", re.S)
#: vLLM flags the recipes may use; each is a flag of `kvrelay sim` with the same meaning
SIM_FLAGS = {"--port": "--metrics-port", "--grpc-port": "--grpc-port",
             "--block-size": "--block-size", "--data-parallel-size": "--data-parallel-size",
             "--kv-events-config": "--kv-events-config"}  # fmt: skip
POOL = "dynamo/backend/generate"


def recipes() -> dict[str, str]:
    return dict(RECIPE.findall(DOC.read_text()))


def ports_map() -> dict[int, int]:
    """Documented port → free port, keeping the publisher/replay/rank offsets."""
    base = free_port_block(400)
    return {5557: base, 5657: base + 100, 50051: base + 200, 8000: base + 300,
            50161: base + 301, 50162: base + 302}  # fmt: skip


def moved(text: str, ports: dict[int, int]) -> str:
    for old, new in ports.items():
        text = re.sub(rf"(?<![0-9]){old}(?![0-9])", str(new), text)
    return text


def _words(line: str) -> list[str]:
    words = shlex.split(line.replace("\\\n", " "))
    while "=" in words[0]:  # VLLM_USE_RUST_FRONTEND=1
        words.pop(0)
    return words


def sim_command(sim_line: str) -> list[str]:
    """The documented ``kvrelay sim`` line, as printed (only the interpreter is spelled out)."""
    words = _words(sim_line)
    assert words[:2] == ["kvrelay", "sim"], words
    return [sys.executable, "-m", "kvrelay", *words[1:]]


@pytest.mark.parametrize("flavour", ["control", "static"])
def test_the_simulator_form_is_the_vllm_line(flavour: str) -> None:
    """Same model and flags as the `vllm serve` line; a static recipe (vLLM < 0.27) adds only
    `--grpc-port -1` (no Control frontend). Every flag is one kvrelay sim knows."""
    r = recipes()
    vllm, sim = _words(r[f"{flavour}-vllm"]), _words(r[f"{flavour}-sim"])
    assert vllm[:2] == ["vllm", "serve"] and sim[:2] == ["kvrelay", "sim"]
    assert sim[2] == vllm[2]  # the positional model
    v = dict(zip(vllm[3::2], vllm[4::2], strict=True))
    m = dict(zip(sim[3::2], sim[4::2], strict=True))
    new = set(v) - set(SIM_FLAGS)
    assert not new, f"teach kvrelay sim (and SIM_FLAGS) the new flag(s): {new}"
    extra = {} if "--grpc-port" in v else {"--grpc-port": "-1"}
    assert m == {**v, **extra}


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return str(r.read().decode())


def _sample(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def _kvrelay(line: str, env: dict[str, str], path: Path, timeout: float = 90) -> str:
    words = shlex.split(line.replace("/etc/kvrelay/kvrelay.toml", str(path)))
    assert words[0] == "kvrelay", line
    res = subprocess.run([sys.executable, "-m", "kvrelay", *words[1:]], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=timeout)  # fmt: skip
    assert res.returncode == 0, f"{line}\n{res.stdout}\n{res.stderr[-3000:]}"
    return res.stdout


@pytest.mark.slow
@pytest.mark.parametrize("flavour", ["control", "static"])
def test_documented_recipe_runs_against_the_simulator(flavour: str, tmp_path: Path) -> None:
    r = recipes()
    assert {"control-vllm", "control-sim", "control-config", "static-vllm", "static-sim",
            "static-config", "verify"} <= set(r)  # fmt: skip
    ports = ports_map()
    config = tmp_path / "kvrelay.toml"
    config.write_text(moved(r[f"{flavour}-config"], ports))
    relay, metrics = f"127.0.0.1:{ports[50161]}", ports[50162]
    env = clean_env(
        KVRELAY_RELAY_BIND=relay, KVRELAY_METRICS_BIND=f"127.0.0.1:{metrics}",
        KVRELAY_RELAY=relay,  # the inspection commands' default address, moved the same way
    )
    verify = [ln for ln in r["verify"].splitlines() if ln.strip()]
    out = _kvrelay(verify[0], env, config)  # check-config
    assert out.strip().endswith("0 warning(s)") and ": ok: " in out, out

    logs = tmp_path / "logs"
    logs.mkdir()
    procs: list[subprocess.Popen[bytes]] = []

    def spawn(name: str, cmd: list[str]) -> subprocess.Popen[bytes]:
        with open(logs / f"{name}.out", "wb") as o, open(logs / f"{name}.err", "wb") as e:
            p = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=o, stderr=e)
        procs.append(p)
        return p

    try:
        spawn("sim", sim_command(moved(r[f"{flavour}-sim"], ports)))
        serve = spawn("serve", [sys.executable, "-m", "kvrelay", "serve", "--config", str(config)])
        deadline = time.monotonic() + scaled(90)
        text = ""
        while time.monotonic() < deadline:
            assert all(p.poll() is None for p in procs), (logs / "serve.err").read_text()[-3000:]
            try:
                text = _metrics(metrics)
            except OSError:
                text = ""
            live = _sample(text, "kvrelay_ingest_sources", pool=POOL, state="live")
            b = [_sample(text, "kvrelay_ingest_batches_total", dp_rank=str(k)) for k in (0, 1)]
            if live == 2 and all(x for x in b):
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"no live sources with batches:\n{text[-3000:]}")

        catalog = _kvrelay(verify[1], env, config)  # kvrelay watch catalog --count 1
        row = next(ln for ln in catalog.splitlines() if POOL in ln)
        assert "meta-llama/Llama-3.1-8B-Instruct" in row and " 16 " in row and "STANDARD" in row

        curl = moved(verify[2], ports)
        if shutil.which("curl"):
            grep = subprocess.run(["bash", "-c", curl], capture_output=True, text=True,
                                  timeout=30).stdout  # fmt: skip
        else:  # the same filter over the same page
            pattern = re.search(r"grep -E '([^']+)'", curl).group(1)  # type: ignore[union-attr]
            grep = "\n".join(ln for ln in _metrics(metrics).splitlines() if re.search(pattern, ln))
        assert f'kvrelay_ingest_sources{{pool="{POOL}",state="live"}} 2.0' in grep, grep
        for rank in (0, 1):
            assert (_sample(grep, "kvrelay_ingest_batches_total", dp_rank=str(rank)) or 0) > 0
        if flavour == "control":
            assert _sample(grep, "kvrelay_engine_reachable", worker="gpu-node-1") == 1.0, grep

        # subscribe --verify --duration 5, for 2 s: snapshot and deltas come in the first second
        assert verify[3].endswith("--duration 5"), verify[3]
        out = _kvrelay(verify[3].replace("--duration 5", "--duration 2"), env, config, timeout=120)
        assert "SNAPSHOT_CHUNK" in out and "DELTA" in out, out[-2000:]

        serve.send_signal(signal.SIGTERM)
        assert serve.wait(30) == 0, (logs / "serve.err").read_text()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
    assert os.path.getsize(logs / "sim.out") > 0  # the simulator said which sockets it bound
