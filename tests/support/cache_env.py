"""The environment that chooses or keys numba's kernel cache, and what a child finds in that cache.

Every process the tests start (``kvrelay serve`` under a READY deadline above all) inherits the
test process's environment through ``clean_env()``. One test that leaves ``NUMBA_CACHE_DIR`` set
sends every daemon started after it to another, empty cache: the first one compiles every kernel
(a minute on a busy machine) instead of loading them in a second. ``tests/conftest.py`` fails any
test that leaves these variables changed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping

from tests.support.commands import REPO, clean_env

#: Besides every ``NUMBA_*``: what ``kvrelay.ops.kernelcache`` reads to pick the directory.
KEYS = ("CACHE_DIRECTORY", "XDG_CACHE_HOME", "HOME", "TMPDIR")


def cache_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables of ``env`` (default: this process's) that choose or key the kernel cache."""
    src = os.environ if env is None else env
    return {k: v for k, v in src.items() if k.startswith("NUMBA_") or k in KEYS}


PROBE = """
import json, os
from kvrelay import _jit
from kvrelay.cli import _numba_cache_from_systemd
from kvrelay.ops import warmup
_numba_cache_from_systemd()  # as `kvrelay serve` does, before numba is imported
for g in warmup.STEPS:
    warmup._import(g)
print(json.dumps({"dir": os.environ.get("NUMBA_CACHE_DIR"),
                  "missing": {g: _jit.missing(g) for g in warmup.STEPS}}))
"""


def child_cache_view() -> dict[str, object]:
    """What a ``kvrelay serve`` started now by a test would see: its ``NUMBA_CACHE_DIR`` and, per
    warm-up step, the declared kernels missing from its cache (``_jit.missing``; nothing compiled
    or loaded by the probe itself)."""
    res = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=REPO, env=clean_env(), capture_output=True, text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.splitlines()[-1])  # type: ignore[no-any-return]
