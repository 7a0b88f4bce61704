"""docs/operations.md, "Validation": the example output is what `check-config` prints for one
file, and the page names as many kinds of warning as the validation can give (it said three
while a mirror's plaintext upstream made a fourth)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import kvrelay
from kvrelay.ops.config import check_file

ROOT = Path(kvrelay.__file__).resolve().parent
DOC = ROOT.parent / "docs" / "operations.md"
NUMBERS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7,
           "eight": 8, "nine": 9, "ten": 10}


def _validation() -> str:
    return DOC.read_text().split("### Validation", 1)[1].split("\n## ", 1)[0]


def test_the_example_problems_are_what_check_config_prints(tmp_path: Path) -> None:
    key = tmp_path / "relay.key"
    key.write_text("")
    config = tmp_path / "kvrelay.toml"
    config.write_text(
        '[relay]\ndc_name = "dc-west-1"\nbind = "0.0.0.0:50161"\ndiscovery_interval = 3\n\n'
        '[[pools]]\nnamespace = "dynamo"\ncomponent = "backend"\nendpoint = "generate"\n'
        '[[pools.engines]]\nname = "e0"\ngrpc_port = 50051\n'
        '[[pools.engines]]\nname = "e0"\nhost = "10.0.0.2"\n\n'
        f'[tls]\nkey = "{key}"\n'
    )
    cfg, problems = check_file(config, env={})
    assert cfg is None
    documented = _validation().split("```\n", 2)[1].split("```", 1)[0].splitlines()
    assert [str(p) for p in problems] == documented


def test_the_page_counts_every_kind_of_warning() -> None:
    tree = ast.parse((ROOT / "ops" / "config.py").read_text())
    sites = sum(
        1 for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        and node.func.attr == "warn"
    )  # fmt: skip
    said = re.search(r"There are (\w+):", _validation())
    assert said is not None
    assert NUMBERS[said.group(1)] == sites, f"config.py warns at {sites} places"


def test_the_warning_examples_are_what_check_config_prints(tmp_path: Path) -> None:
    """The second example block: each line from the example config changed as the page says
    (it was presented as what deleting the prefill pool gives, which gives only the first)."""
    example = (ROOT / "ops" / "assets" / "kvrelay.example.toml").read_text()
    start = example.index("# A second pool: the prefill endpoint")
    no_prefill = example[:start] + example[example.index("# A third pool in connect mode"):]
    replay_5558 = example.replace('replay_endpoint = "tcp://*:5657"',
                                  'replay_endpoint = "tcp://*:5558"')  # fmt: skip
    printed = []
    for name, text in (("no_prefill", no_prefill), ("replay_5558", replay_5558)):
        config = tmp_path / f"{name}.toml"
        config.write_text(text)
        cfg, problems = check_file(config, env={})
        assert cfg is not None
        printed += [str(p) for p in problems]
    documented = _validation().split("```\n", 4)[3].split("```", 1)[0].splitlines()
    assert printed == documented


def test_the_directory_warning_examples_are_what_check_config_prints(tmp_path: Path) -> None:
    """The third example block: an unusable ``runtime_dir`` with ``workers = 2`` and a
    world-writable ``state_dir``, which ``check-config`` passed silently before (``serve`` then
    exited 1, or ran without saving state). Made under ``tmp_path``, shown with the page's paths."""
    runtime = tmp_path / "kvrelay-missing"
    state = tmp_path / "kvrelay"
    state.mkdir()
    state.chmod(0o777)
    config = tmp_path / "kvrelay.toml"
    config.write_text(
        f'[relay]\ndc_name = "dc"\nworkers = 2\nruntime_dir = "{runtime}"\n'
        f'state_dir = "{state}"\n\n[[pools]]\nnamespace = "dynamo"\ncomponent = "backend"\n'
        'endpoint = "generate"\n[[pools.engines]]\nname = "e0"\ngrpc_port = 50051\n'
    )
    cfg, problems = check_file(config, env={})
    assert cfg is not None, problems
    printed = [str(p).replace(str(runtime), "/run/kvrelay-missing")
               .replace(str(state), "/var/lib/kvrelay") for p in problems]  # fmt: skip
    documented = _validation().split("```\n", 6)[5].split("```", 1)[0].splitlines()
    assert printed == documented
