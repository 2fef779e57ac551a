#!/usr/bin/env bash
# One command for a machine with a CUDA GPU (issue 44's check; section limits 60 + 90 + 95 + 130 + 120 + 150 s, the
# import check itself takes seconds): whether litkv imports, the tests marked `cuda` (quick ones), then
# scripts/gpu_bench.py for SmolLM2-135M's and Llama-3.2-1B's shapes (random weights, bf16): decode against
# transformers' dynamic and static caches at 4,096 tokens, the policy table at 32,768 tokens with 4,096
# slots at batch 1 and 8, and the targets' ratios; litkv.hf's tests and scripts/bench_hf.py. Each section runs
# under its own time limit and reports its time; the report (markdown) is written to a file and printed at the end.
#
#   scripts/gpu_check.sh [REPORT]              # default REPORT: gpu_report.md
#   scripts/gpu_check.sh --dry-run [REPORT]    # the same steps on the CPU, small (cuda tests skip, the bench
#                                              # runs --quick: each preset's heads at head size 16, 2 layers, one
#                                              # thread); GPU_CHECK_DEVICE=cpu does the same
#
# Environment: PYTHON (default: python), GPU_CHECK_DEVICE (default: cuda). Packages: torch, transformers,
# tokenizers, and litkv's own dependencies (litgpt, lightning, jsonargparse; docs/gpu.md carries them as wheels).
# Exit status: 0 when every section passed, 1 when one failed or ran out of time (the report says which),
# 2 when no CUDA GPU is visible (and this is not a dry run).
set -uo pipefail

DEVICE="${GPU_CHECK_DEVICE:-cuda}"
if [ "${1:-}" = "--dry-run" ]; then
    DEVICE=cpu
    shift
fi
REPORT="${1:-gpu_report.md}"
PY="${PYTHON:-python}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1  # a section cut by its time limit keeps the rows it printed

if [ "$DEVICE" = "cuda" ] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA GPU visible to torch (set GPU_CHECK_DEVICE=cpu for a dry run on the CPU)" >&2
    exit 2
fi

status=0
start=$(date +%s)
slack=1  # the dry run's limits are 5x longer: a loaded CPU machine imports torch and lightning slowly
[ "$DEVICE" = "cpu" ] && slack=5
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

section "litkv imports" $(( 60 * slack )) "$PY" -c "
import importlib.metadata as m
import litkv
names = ('litgpt', 'lightning', 'jsonargparse', 'tokenizers', 'gguf')
def version(n):
    try:
        return m.version(n)
    except m.PackageNotFoundError:
        return 'absent'
print('litkv imports; ' + ', '.join(f'{n} {version(n)}' for n in names))
"
section "tests marked cuda (not slow)" $(( 90 * slack )) "$PY" -m pytest -m "cuda and not slow" -q -rs --no-header -p no:cacheprovider \
    tests/modeling/test_cuda.py tests/modeling/test_cuda_graph.py tests/kvcache/test_cuda_quant_kernel.py
if [ "$DEVICE" = "cuda" ]; then
    common=(--device cuda --dtype bf16 --prompts 4096 --new 64 --policy-prompt 32768 --cache-length 4096 --batches 1,8)
    section "SmolLM2-135M shape: decode, policies, targets" 95 "$PY" scripts/gpu_bench.py --model SmolLM2-135M "${common[@]}"
    section "Llama-3.2-1B shape: decode, policies, targets" 130 "$PY" scripts/gpu_bench.py --model Llama-3.2-1B "${common[@]}"
    # litkv.hf (issue 59) on the machine's transformers: its tests (CPU models: the version check), then
    # transformers + litkv h2o at 1/8 of 4k / 16k against transformers' dynamic cache and litkv's GPT
    section "litkv.hf tests (installed transformers)" 120 "$PY" -m pytest -m "not slow" -q -x --no-header \
        -p no:cacheprovider tests/hf/test_generate.py tests/hf/test_cache.py
    section "litkv.hf speed: SmolLM2-135M shape, h2o at 1/8" 150 "$PY" scripts/bench_hf.py --device cuda \
        --dtype bfloat16 --prompts 4096 16384 --new-tokens 64 --repeats 3
else
    # one thread: the small shapes' kernels are too short for a pool, which a loaded machine's scheduler stalls
    export OMP_NUM_THREADS=1
    for model in SmolLM2-135M Llama-3.2-1B; do
        section "$model shape (CPU dry run)" 300 "$PY" scripts/gpu_bench.py --model "$model" --device cpu --dtype bf16 --quick --no-compile
    done
fi

echo "Total: $(( $(date +%s) - start )) s. Status: $([ $status -eq 0 ] && echo passed || echo FAILED)." >> "$REPORT"
cat "$REPORT"
echo "gpu_check: report written to $REPORT"
exit $status
