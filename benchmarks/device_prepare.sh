#!/usr/bin/env bash
# Prepare a device run of benchmarks/device_grid.py (benchmarks/README.md, "On a 16-core
# machine"). Run HERE, on the development machine, with the package index reachable:
#
#   bash benchmarks/device_prepare.sh [DIR]        # DIR: .device-wheels (git-ignored)
#
# Downloads cp312 manylinux x86-64 wheels of kvrelay's runtime dependencies that the device
# machines lack (benchmarks/device_wheels.py decides which, from pyproject.toml and the versions
# installed in .venv), checks that every requirement of those wheels is carried or on the
# device and that the wheels and the working tree fit what travels to the device (64 MiB), and
# prints the one command to give the device tool. A wheel already in DIR is kept; any other
# wheel there is removed.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.device-wheels}
LIMIT_MIB=64
PY=.venv/bin/python
[ -x "$PY" ] || { echo "device_prepare: $PY missing: make venv first" >&2; exit 1; }

"$PY" -m benchmarks.device_wheels prepare "$DIR"

# What travels: tracked and untracked-not-ignored files, plus the carried wheel folder.
tree_bytes=$(git ls-files -z --cached --others --exclude-standard \
  | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
wheel_bytes=$(find "$DIR" -type f -printf '%s\n' | awk '{s += $1} END {print s + 0}')
total=$((tree_bytes + wheel_bytes))
awk -v t="$tree_bytes" -v w="$wheel_bytes" -v a="$total" -v l="$LIMIT_MIB" 'BEGIN {
  printf "device_prepare: working tree %.1f MiB + wheels %.1f MiB = %.1f MiB (limit %d MiB)\n",
    t / 2^20, w / 2^20, a / 2^20, l }'
if [ "$total" -gt $((LIMIT_MIB * 1024 * 1024)) ]; then
  echo "device_prepare: too much would travel to the device" >&2
  exit 1
fi

commit=$(git rev-parse --short HEAD)
dirty=0
[ -z "$(git status --porcelain --untracked-files=no -- . ':(exclude)benchmarks/results')" ] || dirty=1
[ "$dirty" = 0 ] || echo "device_prepare: NOTE: tracked files are modified; commit first so the result names a commit that holds what ran"
cat <<EOF

Device command (the device tool's run; one call, about 9.5 minutes):
  command:   KVRELAY_BENCH_COMMIT=$commit KVRELAY_BENCH_DIRTY=$dirty bash benchmarks/device_run.sh
  carry:     ["$DIR"]
  timeout_s: 600
Then copy device_grid.json and device_grid.md from the returned files into benchmarks/results/
and run: .venv/bin/python -m tools.bench_figures --index
EOF
