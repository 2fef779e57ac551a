"""How long litkv takes to start: wall time of fresh interpreters, median of `--repeats` runs each.

Rows: `import litkv` (lazy: imports nothing heavy), `litkv --help`, `litkv generate --help` (stored help
texts), `litkv --version`, and for scale `import torch` and `from litkv import GPT` (torch, LitGPT and
Lightning: what a command that runs a model pays once). Targets (issue 46): `--help` under 2 s,
`import litkv` under 3 s. Each row also prints its ratio to `python -c pass` measured in the same run,
so a loaded machine can be told from a slow import; on a shared machine say how loaded it was.

    python scripts/startup_time.py --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROWS: dict[str, list[str]] = {
    "python -c pass": ["-c", "pass"],
    "import litkv": ["-c", "import litkv"],
    "litkv --help": ["-m", "litkv", "--help"],
    "litkv generate --help": ["-m", "litkv", "generate", "--help"],
    "litkv --version": ["-m", "litkv", "--version"],
    "import torch": ["-c", "import torch"],
    "from litkv import GPT": ["-c", "from litkv import GPT"],
}
TARGETS = {"import litkv": 3.0, "litkv --help": 2.0, "litkv generate --help": 2.0}


def wall_time(args: list[str]) -> float:
    """Seconds one fresh `python ARGS` takes, start to exit (output discarded; a failure raises)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    start = time.perf_counter()
    subprocess.run([sys.executable, *args], check=True, env=env, cwd=REPO, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="runs per row (the median is reported)")
    opts = parser.parse_args()
    if opts.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {opts.repeats}")
    times: dict[str, list[float]] = {name: [] for name in ROWS}
    for _ in range(opts.repeats):  # rows interleaved, so that a change of load touches every row alike
        for name, args in ROWS.items():
            times[name].append(wall_time(args))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"median of {opts.repeats} runs, load average {load:.1f} on {os.cpu_count()} CPUs")
    base = statistics.median(times["python -c pass"])
    print(f"{'command':<24} {'median s':>9} {'min s':>7} {'x python':>9}  target")
    for name, values in times.items():
        median = statistics.median(values)
        target = TARGETS.get(name)
        verdict = "" if target is None else f"< {target:.0f} s: {'met' if median < target else 'missed'}"
        print(f"{name:<24} {median:>9.2f} {min(values):>7.2f} {median / base:>9.1f}  {verdict}")


if __name__ == "__main__":
    main()
