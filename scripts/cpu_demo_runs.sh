#!/usr/bin/env bash
# Alternated `bytebound demo` runs on CPU, one line each (docs/perf/cpu-decode-nano.md, 2026-12-02 section):
#
#   scripts/cpu_demo_runs.sh warm N   # N pairs: compiled step (warm inductor cache, the default) vs --no-cpu-compile
#   scripts/cpu_demo_runs.sh cold N   # N compiled runs, each with a fresh inductor cache and temporary directory
#                                     # (inductor's precompiled header lives under TMPDIR): a fresh user's first run
#
# Each line: mode, clock, 1-minute load average before-after, the compile's "ready in", decode tok/s (TPOT),
# wall / user / sys seconds of the whole command, and a hash of the printed answer (equal across modes when the
# greedy text is). PYTHON (default .venv/bin/python) runs `-m bytebound.cli demo` from the repository root.
set -euo pipefail
cd "$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY=${PYTHON:-.venv/bin/python}
mode=${1:?warm or cold}; n=${2:-6}
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
run() {     # run LABEL ARGS...: one demo, one line
    local label=$1; shift
    local l0; l0=$(cut -d' ' -f1 /proc/loadavg)
    /usr/bin/time -f "TIME %e %U %S" -o "$work/time" env PYTHONPATH="$PWD" "$PY" -m bytebound.cli demo "$@" \
        >"$work/out" 2>"$work/err"
    local l1; l1=$(cut -d' ' -f1 /proc/loadavg)
    echo "$label $(date +%H:%M) load $l0-$l1 $(grep -o 'ready in [0-9.]* s' "$work/err" || echo eager)" \
         "$(grep -o 'TPOT [0-9.]* ms, decode [0-9.]* tok/s' "$work/out") $(cat "$work/time")" \
         "answer $(grep -v 'tokens, prompt' "$work/out" | md5sum | cut -c1-8)"
}
case $mode in
    warm)
        export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$work/cache}
        run warm-up >/dev/null             # fills the cache when it is empty
        for i in $(seq "$n"); do run compiled; run eager --no-cpu-compile; done ;;
    cold)
        for i in $(seq "$n"); do
            mkdir -p "$work/c$i/tmp"
            TORCHINDUCTOR_CACHE_DIR="$work/c$i/cache" TMPDIR="$work/c$i/tmp" run cold
        done ;;
    *) echo "usage: $0 warm|cold [N]" >&2; exit 2 ;;
esac
