#!/usr/bin/env bash
# The first hour of a new user, on what pip installs: build the sdist and the wheel,
# install the wheel with no extras (no numba, no OR-Tools) into a fresh virtualenv
# beside the CPU build of torch, and run the quick path's commands from outside the
# checkout. A command fails on a non-zero exit (or, where it must refuse, another exit
# than 2) or on "Traceback" anywhere in its output. One PASS/FAIL line per command,
# then one summary line; exit 1 if any failed.
#
#   bash .ci/wheel_smoke.sh            (CI calls it from .ci/run)
#   KEEP=1 bash .ci/wheel_smoke.sh     keeps the work directory and prints where it is
#
# Needs ../shared/benchmarks beside the checkout (the G10 cases and MiniMalloc's set).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
# shared/ beside the checkout (CI's clone), or beside its parent (a git worktree under wt/)
if [ -z "${SHARED:-}" ]; then
  for d in "$ROOT/../shared" "$ROOT/../../shared"; do
    if [ -d "$d/benchmarks" ]; then SHARED=$(cd "$d" && pwd)/benchmarks; break; fi
  done
fi
SHARED=${SHARED:-$ROOT/../shared/benchmarks}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/tierflow-wheel-smoke.XXXXXX")
if [ -z "${KEEP:-}" ]; then trap 'rm -rf "$WORK"' EXIT; else echo "wheel smoke: work directory $WORK"; fi
export PIP_DISABLE_PIP_VERSION_CHECK=1

fail=0
passed=0
failed_names=()

die() { echo "wheel smoke: FAIL setup: $*"; exit 1; }

# -- build and install -------------------------------------------------------------------
[ -d "$SHARED/g10/vit-1280" ] || die "no G10 case at $SHARED/g10/vit-1280 (shared/ must be beside the checkout)"
t0=$(date +%s)
"$PYTHON" -m venv "$WORK/build-env" || die "python -m venv"
"$WORK/build-env/bin/pip" install -q build >"$WORK/build.log" 2>&1 || { cat "$WORK/build.log"; die "pip install build"; }
"$WORK/build-env/bin/python" -m build --outdir "$WORK/dist" "$ROOT" >>"$WORK/build.log" 2>&1 \
  || { tail -40 "$WORK/build.log"; die "python -m build"; }
wheel=$(ls "$WORK"/dist/tierflow-*.whl 2>/dev/null | head -1)
sdist=$(ls "$WORK"/dist/tierflow-*.tar.gz 2>/dev/null | head -1)
[ -n "$wheel" ] && [ -n "$sdist" ] || die "python -m build made no wheel or no sdist ($(ls "$WORK/dist"))"
echo "wheel smoke: built $(basename "$sdist") and $(basename "$wheel") in $(( $(date +%s) - t0 )) s"

t0=$(date +%s)
"$PYTHON" -m venv "$WORK/env" || die "python -m venv"
V="$WORK/env/bin"
"$V/pip" install -q "$TORCH_SPEC" >"$WORK/install.log" 2>&1 || { tail -20 "$WORK/install.log"; die "pip install $TORCH_SPEC"; }
"$V/pip" install -q "$wheel" >>"$WORK/install.log" 2>&1 || { tail -20 "$WORK/install.log"; die "pip install the wheel"; }
echo "wheel smoke: installed torch and the wheel (no extras) in a fresh virtualenv in $(( $(date +%s) - t0 )) s"

# -- the commands --------------------------------------------------------------------------
# run NAME EXPECTED_EXIT CMD...: runs CMD in an empty directory (so nothing of the
# checkout is importable), PASS if its exit code is EXPECTED_EXIT and no traceback.
run() {
  local name=$1 want=$2
  shift 2
  local log="$WORK/$name.log" t=$(date +%s)
  (cd "$WORK/cwd" && "$@") >"$log" 2>&1
  local rc=$?
  local secs=$(( $(date +%s) - t ))
  if [ "$rc" -ne "$want" ] || grep -q "Traceback" "$log"; then
    echo "FAIL $name (exit $rc, wanted $want; ${secs} s): $*"
    sed 's/^/    | /' "$log" | tail -40
    fail=1
    failed_names+=("$name")
  else
    echo "PASS $name (${secs} s)"
    passed=$((passed + 1))
  fi
}

# check NAME CMD...: a plain assertion on what a command left (PASS if CMD exits 0).
check() {
  local name=$1
  shift
  if (cd "$WORK/cwd" && "$@") >"$WORK/$name.log" 2>&1; then
    echo "PASS $name"
    passed=$((passed + 1))
  else
    echo "FAIL $name: $*"
    sed 's/^/    | /' "$WORK/$name.log" | tail -20
    fail=1
    failed_names+=("$name")
  fi
}

mkdir -p "$WORK/cwd"
TF="$V/tierflow"
CASE="$SHARED/g10/vit-1280"
POOL_CSV="$SHARED/pool/minimalloc-challenging/A.csv"

check no-extras "$V/python" -c "
import importlib.util as u, sys
have = [m for m in ('numba', 'ortools', 'highspy') if u.find_spec(m)]
sys.exit(f'optional packages installed: {have}' if have else 0)"
check light-import "$V/python" -c "
import sys, tierflow
heavy = [m for m in ('scipy', 'matplotlib', 'numba', 'ortools') if m in sys.modules]
sys.exit(f'import tierflow loaded {heavy}' if heavy else 0)"
check installed-from-wheel "$V/python" -c "
import sys, tierflow
sys.exit(0 if '$WORK/env' in tierflow.__file__ else f'tierflow imported from {tierflow.__file__}')"
run policies 0 "$TF" policies --json
run demo 0 "$TF" demo
run compare 0 "$TF" compare "$CASE" --hardware g10-a100 --policies g10,tierflow
run simulate-deeptm 0 "$TF" simulate "$CASE" --hardware g10-a100 --policy deeptm --set episodes=1 --json
run report 0 "$TF" report "$CASE" --hardware g10-a100 --policies ideal,lru,g10 -o "$WORK/report.html"
check report-written test -s "$WORK/report.html"
run bound 0 "$TF" bound "$CASE" --hardware g10-a100 --budget 20GiB --json
run train 0 "$TF" train --model gpt-tiny --budget 50% --steps 4 --check-parity
if [ -f "$POOL_CSV" ]; then
  run pool-best 0 "$TF" pool "$POOL_CSV" --solver best --time-limit 5
  check pool-says-numba-is-missing grep -q "numba" "$WORK/pool-best.log"
else
  echo "FAIL pool-best: no MiniMalloc CSV at $POOL_CSV"
  fail=1
  failed_names+=("pool-best")
fi
run unknown-option 2 "$TF" simulate "$CASE" --policy g10 --set foo=1
check unknown-option-one-line bash -c "[ \$(wc -l < '$WORK/unknown-option.log') -eq 1 ] && grep -q \"g10 has no option 'foo'\" '$WORK/unknown-option.log'"

total=$((passed + ${#failed_names[@]}))
if [ "$fail" -eq 0 ]; then
  echo "wheel smoke: PASS, all $total checks on the installed wheel"
else
  echo "wheel smoke: FAIL, ${#failed_names[@]} of $total checks: ${failed_names[*]}"
fi
exit "$fail"
