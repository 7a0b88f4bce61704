#!/usr/bin/env bash
# The workers scale-out grid on a device machine (16 cores, no network, Python 3.12 with numba,
# numpy, grpcio, protobuf, uvloop, xxhash and prometheus-client), in ONE command of at most
# 10 minutes (benchmarks/README.md, "On a 16-core machine"). Run THERE, from the repository
# root, with the wheels benchmarks/device_prepare.sh downloaded carried along:
#
#   KVRELAY_BENCH_COMMIT=<short hash> KVRELAY_BENCH_DIRTY=0 bash benchmarks/device_run.sh [ARGS]
#
# 1. .venv (the interpreter every benchmark process runs): a venv over the device's python3
#    with --system-site-packages, plus a .pth naming that interpreter's own site directories
#    (the device's python3 is itself a venv, whose packages a venv made from it would not see);
# 2. the carried wheels, offline (pip --no-index; the ones the device has at a version that
#    satisfies kvrelay are left out), then kvrelay itself, editable, --no-deps
#    --no-build-isolation (its build backend, setuptools, is on the device or carried); should
#    that fail, the benchmarks import kvrelay from the tree (PYTHONPATH) as they always do;
# 3. the numba kernels compiled once (`python -m kvrelay warm`, NUMBA_CACHE_DIR shared with
#    every relay process the grid starts);
# 4. python -m benchmarks.device_grid with what is left of TOTAL_S (default 570 s) as its
#    budget, ARGS passed on; device_grid.{json,md} go to $OUT (what the device tool brings
#    back), rewritten after every point, with this log and the processes' logs.
#
# Environment: OUT (default benchmarks/.work/device-out), WHEELS (.device-wheels), TOTAL_S,
# PYTHON (python3), KVRELAY_BENCH_COMMIT / KVRELAY_BENCH_DIRTY (the commit that was copied: the
# copy on the device has no git history).
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
TOTAL_S=${TOTAL_S:-570}
WHEELS=${WHEELS:-.device-wheels}
OUT=${OUT:-benchmarks/.work/device-out}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
exec > >(tee -a "$OUT/device_run.log") 2>&1
export PYTHONUNBUFFERED=1
step() { echo "[$(date +%H:%M:%S) +$(( $(date +%s) - T0 ))s] device_run: $*"; }
die() { step "FAILED: $*"; exit 1; }

step "$(uname -srm), $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2 / 2^20}' /proc/meminfo)"
"$PYTHON" -c 'import sys; assert sys.version_info[:2] == (3, 12), sys.version' \
  || die "$PYTHON is not Python 3.12 (the carried wheels are cp312)"
[ -f "$WHEELS/manifest.json" ] || die "$WHEELS/manifest.json missing: carry the folder device_prepare.sh filled"
[ -n "${KVRELAY_BENCH_COMMIT:-}" ] || step "WARNING: KVRELAY_BENCH_COMMIT unset: the result will name no commit"
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)" 2>/dev/null || true

# 1. the venv (only one this script made is reused or replaced: never a developer's .venv)
if [ -e .venv ] && [ ! -f .venv/.device-run ]; then
  die ".venv exists and was not made by device_run.sh: run this on a device machine"
fi
if ! .venv/bin/python -c 'import sys' 2>/dev/null; then
  rm -rf .venv
  "$PYTHON" -m venv --system-site-packages .venv 2>/dev/null \
    || { rm -rf .venv; "$PYTHON" -m venv --system-site-packages --without-pip .venv; } \
    || die "python3 -m venv failed"
  touch .venv/.device-run
fi
SITE=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$PYTHON" - >"$SITE/_device_parent.pth" <<'EOF'
import os, sys
for p in sys.path:
    if p.rstrip("/").endswith(("site-packages", "dist-packages")) and os.path.isdir(p):
        print(p)
EOF
step "venv: $(.venv/bin/python -c 'import sys; print(sys.prefix, sys.version.split()[0])'); parent site: $(tr '\n' ' ' <"$SITE/_device_parent.pth")"

# 2. the wheels and kvrelay
mapfile -t picks < <(.venv/bin/python -m benchmarks.device_wheels select "$WHEELS")
step "installing ${#picks[@]} wheels offline"
if .venv/bin/python -m pip --version >/dev/null 2>&1; then
  .venv/bin/python -m pip install -q --no-index --find-links "$WHEELS" --no-deps --no-compile \
    --no-cache-dir --ignore-installed --disable-pip-version-check "${picks[@]}" \
    || die "pip install of the wheels"
  if .venv/bin/python -m pip install -q --no-index --no-deps --no-build-isolation \
      --disable-pip-version-check -e . ; then
    step "kvrelay installed (editable)"
  else
    step "kvrelay not installed (no offline build backend?): the benchmarks import it from the tree"
  fi
else
  step "no pip: unpacking the wheels into $SITE"
  .venv/bin/python -m benchmarks.device_wheels unpack "$SITE" "${picks[@]}" || die "unpack"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
.venv/bin/python -m benchmarks.device_wheels check || die "a runtime dependency is missing"

# 3. the kernels
export NUMBA_CACHE_DIR="$PWD/benchmarks/.work/numba-device"
mkdir -p "$NUMBA_CACHE_DIR"
.venv/bin/python -m kvrelay warm || die "kvrelay warm"

# 4. the grid
budget=$(( TOTAL_S - ($(date +%s) - T0) - 20 ))
[ "$budget" -ge 60 ] || die "only ${budget} s left for the grid"
step "device_grid with a budget of ${budget} s"
.venv/bin/python -m benchmarks.device_grid --budget-s "$budget" --out "$OUT" "$@"
rc=$?
step "device_grid exited $rc"
# the processes' logs (relay, loadgens, subscribers; not their latency arrays), under 16 MiB
(cd benchmarks/.work && find . -maxdepth 1 -name '*.log' -print0 \
  | tar -czf "$OUT/work-logs.tar.gz" --null -T -) 2>/dev/null || true
if [ "$(stat -c %s "$OUT/work-logs.tar.gz" 2>/dev/null || echo 0)" -gt 16000000 ]; then
  (cd benchmarks/.work && tar -czf "$OUT/work-logs.tar.gz" relay-*.log loadgen-*.log) || true
fi
ls -l "$OUT"
exit $rc
