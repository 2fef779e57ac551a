#!/usr/bin/env bash
# Re-makes the README's set-up time figure: the README's set-up command (its first fenced bash block with
# `pip install`, read from README.md as .ci/run reads it), run from the repository root in a new
# virtual environment, first from empty caches (no pip cache, no model: "cold"), then once more in another
# new virtual environment with the caches the first run filled ("warm"). Prints the wall time of each run,
# its CPU time, and the time of each `&&`-separated step of the command (the steps run one after the other in
# the same environment, each verbatim, stopping at the first that fails: what `&&` does).
#
#   scripts/setup_time.sh [--dry-run] [--cold-only] [--keep] [WORKDIR]
#
#   WORKDIR      where the virtual environments and caches go (default: a new folder under $TMPDIR or /tmp);
#                it must be absent or empty
#   --dry-run    print what would run (the command, its steps, the folders) and stop: nothing is made
#   --cold-only  skip the warm run
#   --keep       keep WORKDIR afterwards (default: removed at the end)
#
# Caches: litkv's model cache is LITKV_HOME=$SETUP_TIME_HOME (default WORKDIR/litkv-home) and pip's is
# PIP_CACHE_DIR=WORKDIR/pip-cache. SETUP_TIME_HOME, when set, must be absent or empty: the script never
# uses, fills or wipes the user's own cache (~/.cache/litkv). The cold run downloads torch and the model.
# Exit status: 0 when both runs passed, 1 when a run failed, 2 for a usage error.
set -euo pipefail

usage() { sed -n '2,/^# Exit status/p' "$0" | sed 's/^# \{0,1\}//'; }
die() { echo "setup_time: $1" >&2; exit 2; }

dry_run=0 warm=1 keep=0 work=""
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) dry_run=1 ;;
        --cold-only) warm=0 ;;
        --keep) keep=1 ;;
        -h|--help) usage; exit 0 ;;
        -*) die "unknown option $1 (see --help)" ;;
        *) [ -z "$work" ] || die "one WORKDIR at most, got '$work' and '$1'"; work="$1" ;;
    esac
    shift
done

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
cmd=$(python3 - <<'PY'
import re, sys
text = open("README.md", encoding="utf-8").read()
blocks = [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, re.S) if "pip install" in b]
if not blocks:
    sys.exit("setup_time: README.md has no set-up block with `pip install`")
print(blocks[0])
PY
) || exit 2
mapfile -t steps < <(printf '%s\n' "$cmd" | sed 's/ && /\n/g')

empty_or_absent() { [ ! -e "$1" ] || { [ -d "$1" ] && [ -z "$(ls -A "$1")" ]; }; }
if [ -n "$work" ]; then
    empty_or_absent "$work" || die "WORKDIR $work is not empty"
    made_work=0
else
    work="${TMPDIR:-/tmp}/litkv-setup-time.$$"
    made_work=1
fi
home="${SETUP_TIME_HOME:-$work/litkv-home}"
empty_or_absent "$home" || die "SETUP_TIME_HOME $home is not empty (the cold run needs an empty model cache)"

echo "command: $cmd"
for i in "${!steps[@]}"; do echo "step $((i + 1)): ${steps[$i]}"; done
echo "workdir: $work"
echo "LITKV_HOME: $home"
echo "PIP_CACHE_DIR: $work/pip-cache"
echo "runs: cold$([ $warm -eq 1 ] && echo ", warm")"
if [ $dry_run -eq 1 ]; then
    echo "dry run: nothing was made"
    exit 0
fi

mkdir -p "$work" "$home" "$work/pip-cache"
[ $keep -eq 1 ] || trap '[ $made_work -eq 1 ] && rm -rf "$work"; [ -z "${SETUP_TIME_HOME:-}" ] || rm -rf "$home"' EXIT

cpu_s() {  # the CPU seconds (user + system) of this shell's finished children so far
    times | tail -n 1 | awk '{ t = 0; for (i = 1; i <= 2; i++) { split($i, a, "m"); t += a[1] * 60 + a[2] } printf "%.1f", t }'
}

minus() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", a - b }'; }

run() {  # run NAME: the README's command, step by step, in a new virtual environment
    local name=$1 status=0 start cpu0 t0 t1
    python3 -m venv "$work/venv-$name"
    echo "=== $name run"
    start=$(date +%s.%N)
    cpu0=$(cpu_s)
    for i in "${!steps[@]}"; do
        t0=$(date +%s.%N)
        (
            # shellcheck disable=SC1090
            . "$work/venv-$name/bin/activate"
            export LITKV_HOME="$home" PIP_CACHE_DIR="$work/pip-cache"
            bash -euo pipefail -c "${steps[$i]}"
        ) > "$work/$name-step$((i + 1)).log" 2>&1 || status=$?
        t1=$(date +%s.%N)
        printf '%s step %d: %.0f s%s\n' "$name" $((i + 1)) "$(minus "$t1" "$t0")" \
            "$([ $status -eq 0 ] || echo " FAILED (exit status $status; its log: $work/$name-step$((i + 1)).log)")"
        [ $status -eq 0 ] || return 1
    done
    t1=$(date +%s.%N)
    local wall cpu
    wall=$(minus "$t1" "$start")
    cpu=$(minus "$(cpu_s)" "$cpu0")
    printf '%s: %s wall, %.0f s of CPU\n' "$name" "$(awk -v w="$wall" 'BEGIN { printf "%d min %02d s", w / 60, w % 60 }')" "$cpu"
}

status=0
run cold || status=1
if [ $status -eq 0 ] && [ $warm -eq 1 ]; then
    run warm || status=1
fi
echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg) on $(nproc) cores"
exit $status
