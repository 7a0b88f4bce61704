"""A command run on a read-only root, as in a pod with ``readOnlyRootFilesystem``: inside a
private mount namespace (root only; ``can_unshare`` says whether this machine allows it), every
mount but /dev, /proc and /sys remounted read-only, then the directories named in
``KVRELAY_TEST_WRITABLE`` (space-separated) bound writable again. ``KVRELAY_TEST_PROBE``: a path
the script must fail to create (exit 97 if it can: the root is still writable)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence

_SCRIPT = r"""
set -e
awk '{print $2}' /proc/self/mounts | sort -u | while read -r m; do
  case "$m" in /dev|/dev/*|/proc|/proc/*|/sys|/sys/*) continue ;; esac
  mount -o remount,bind,ro "$m" 2>/dev/null || true
done
if touch "$KVRELAY_TEST_PROBE" 2>/dev/null; then echo "root still writable" >&2; exit 97; fi
for d in $KVRELAY_TEST_WRITABLE; do mount --bind "$d" "$d"; mount -o remount,bind,rw "$d"; done
exec "$@"
"""


def can_unshare() -> bool:
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    res = subprocess.run([unshare, "--mount", "--propagation", "private", "true"],
                         capture_output=True, timeout=30)  # fmt: skip
    return res.returncode == 0


def read_only_root(command: Sequence[str]) -> list[str]:
    """``command`` wrapped to run on a read-only root (see the module docstring)."""
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", _SCRIPT, "sh",
            *command]  # fmt: skip
