#!/usr/bin/env bash
# One command for a machine with a CUDA GPU: the tests marked `cuda`, then litkv against transformers'
# dynamic and static caches in bf16 at 512 / 4,096 / 16,384-token prompts and the policy table
# (scripts/gpu_bench.py), each section under its own time limit (8 minutes in all), into one report file.
#
#   scripts/gpu_check.sh [REPORT]          # default REPORT: gpu_report.md
#   GPU_CHECK_DEVICE=cpu scripts/gpu_check.sh report.md   # the same steps on the CPU, small (a dry run:
#                                                         # the cuda tests skip, the bench runs --quick)
#
# Environment: PYTHON (default: python), GPU_CHECK_DEVICE (default: cuda).
# Exit status: 0 when every section passed, 1 when one failed or ran out of time (the report says which),
# 2 when no CUDA GPU is visible (and GPU_CHECK_DEVICE is not cpu).
set -uo pipefail

REPORT="${1:-gpu_report.md}"
PY="${PYTHON:-python}"
DEVICE="${GPU_CHECK_DEVICE:-cuda}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

if [ "$DEVICE" = "cuda" ] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA GPU visible to torch (set GPU_CHECK_DEVICE=cpu for a dry run on the CPU)" >&2
    exit 2
fi

status=0
start=$(date +%s)
{
    echo "# litkv GPU check"
    echo
    echo "- date: $(date -u +%Y-%m-%dT%H:%M:%SZ), commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    "$PY" - <<'PYEOF'
import torch
import transformers

gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
print(f"- device: {gpu}; torch {torch.__version__}, CUDA {torch.version.cuda}, transformers {transformers.__version__}")
PYEOF
    echo
} > "$REPORT"

section() {  # section TITLE LIMIT_S COMMAND...: run, append its output, note failures and timeouts
    local title="$1" limit="$2"
    shift 2
    local t0 rc
    t0=$(date +%s)
    echo "## $title" >> "$REPORT"
    echo >> "$REPORT"
    timeout "$limit" "$@" >> "$REPORT" 2>"$REPORT.stderr"
    rc=$?
    if [ $rc -ne 0 ]; then
        status=1
        local why="exit status $rc"
        [ $rc -eq 124 ] && why="ran out of its ${limit} s"
        { echo; echo "**$title failed: $why.** Last lines of its stderr:"; echo; echo '```'
          tail -n 20 "$REPORT.stderr"; echo '```'; } >> "$REPORT"
    fi
    echo >> "$REPORT"
    echo "($title: $(( $(date +%s) - t0 )) s)" >> "$REPORT"
    echo >> "$REPORT"
    rm -f "$REPORT.stderr"
}

section "tests marked cuda" 150 "$PY" -m pytest -m cuda -q -rs --no-header -p no:cacheprovider tests/
if [ "$DEVICE" = "cuda" ]; then
    section "decode in bf16 against transformers, and the policy table" 300 \
        "$PY" scripts/gpu_bench.py --device cuda --dtype bf16 --prompts 512,4096,16384 --new 64 --repeats 2
else
    section "decode in bf16 against transformers, and the policy table (CPU dry run)" 300 \
        "$PY" scripts/gpu_bench.py --device cpu --dtype bf16 --quick --no-compile
fi

echo "Total: $(( $(date +%s) - start )) s. Status: $([ $status -eq 0 ] && echo passed || echo FAILED)." >> "$REPORT"
echo "gpu_check: report written to $REPORT"
exit $status
