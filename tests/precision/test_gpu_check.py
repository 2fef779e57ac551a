"""scripts/gpu_check.sh as far as a machine without a GPU can check it: valid bash, a one-line refusal
(exit status 2) without CUDA, and scripts/gpu_bench.py's options (its `--device cpu --quick` run is the
script's dry run: `GPU_CHECK_DEVICE=cpu scripts/gpu_check.sh`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def test_gpu_check_is_valid_bash_and_executable() -> None:
    assert os.access(SCRIPT, os.X_OK)
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is visible: the script would run")
def test_gpu_check_without_cuda_refuses_in_one_line(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("GPU_CHECK_DEVICE", None)
    proc = subprocess.run([str(SCRIPT), str(tmp_path / "r.md")], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "gpu_check: no CUDA GPU visible to torch (set GPU_CHECK_DEVICE=cpu for a dry run on the CPU)"
    )
    assert not (tmp_path / "r.md").exists()


def test_gpu_bench_options() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from gpu_bench import parse_args
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    args = parse_args([])
    assert (args.device, args.dtype, args.prompts) == ("cuda", "bf16", "512,4096,16384")
    quick = parse_args(["--device", "cpu", "--quick"])
    assert quick.prompts == "32,64" and quick.new == 4
