"""`--quantize` as a user gives it: through `python -m litkv generate`, through `load_for_inference`'s
one-line refusals, and in `litkv bench` (litkv's own rows quantised, the peers float)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from litkv.checkpoints.checkpoint import load_tokenizer
from litkv.checkpoints.runtime import load_for_inference
from litkv.cli import bench_cmd
from litkv.cli.bench_cmd import format_table
from litkv.eval import peers
from litkv.eval.peers import BenchResult
from litkv.inference.generate import generate
from litkv.inference.sampling import Sampling
from litkv.kvcache.config import KVCacheConfig
from litkv.modeling.quant_weights import Int4Linear, Int8Linear, parse_quantize, quantize_model, stored_weight_bytes

REPO = Path(__file__).resolve().parents[2]
PROMPT = "The quick brown fox"


def _start_cli(*args: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "litkv", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)


def _finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    out, err = proc.communicate(timeout=600)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture(scope="module")
def procs(ckpt: Path) -> Iterator[dict[str, subprocess.Popen]]:
    """The `python -m litkv generate` processes of this file, started at once so that their imports overlap."""
    started = {
        "int8": _start_cli("generate", str(ckpt), "--prompt", PROMPT, "--max_new_tokens", "12", "--temperature", "0",
                           "--chat_template", "false", "--device", "cpu", "--quantize", "int8"),
        # the tiny checkpoint's width is 32: no linear layer can take groups of 64 input columns
        "int4-g64": _start_cli("generate", str(ckpt), "--prompt", PROMPT, "--max_new_tokens", "2", "--device", "cpu",
                               "--quantize", "int4-g64"),
    }  # fmt: skip
    yield started
    for proc in started.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


# -- the CLI flag ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_generate_cli_int8_prints_the_quantised_models_greedy_tokens(ckpt: Path, procs) -> None:
    proc = _finish(procs["int8"])
    assert proc.returncode == 0, proc.stderr
    model, _ = load_for_inference(ckpt, None, "cpu", 1, "int8")
    assert isinstance(model.lm_head, Int8Linear)
    tok = load_tokenizer(ckpt)
    kv = KVCacheConfig(policy="dense", cache_length=1024)
    expected = generate(model, [tok.encode(PROMPT).long()], 12, kv, Sampling(stop_tokens=(tok.eos_id,)))[0]
    assert proc.stdout == tok.decode(expected) + "\n"


@pytest.mark.slow
def test_generate_cli_refuses_a_group_size_the_model_cannot_take_in_one_line(procs) -> None:
    proc = _finish(procs["int4-g64"])
    assert proc.returncode != 0 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "multiple of the group size 64, got 32" in lines[0], proc.stderr


# -- load_for_inference's refusals ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("fp8", "quantize mode must be one of .* got 'fp8'"),
        ("int4-g48", "int4 group size must be one of .* got 48"),
        ("INT8", "quantize mode must be one of .* got 'INT8'"),
    ],
)
def test_load_for_inference_refuses_bad_strings_before_reading_weights(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):  # an empty directory: the weights are never read
        load_for_inference(tmp_path, None, "cpu", 1, text)


def test_load_for_inference_refuses_meta_and_a_non_cpu_device(tiny_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="device 'meta' cannot run generation"):
        load_for_inference(tiny_ckpt, None, "meta", 1, "int8")
    # a machine where MPS (or CUDA) resolves: refused by the quantisation check before loading
    monkeypatch.setattr("litkv.checkpoints.runtime.resolve_device", torch.device)
    with pytest.raises(ValueError, match=r"^--quantize int4 runs on the CPU only .* got mps$"):
        load_for_inference(tiny_ckpt, None, "mps", 1, "int4")
    model, dev = load_for_inference(tiny_ckpt, None, "cpu", 1, "none")  # no quantisation: any device
    assert dev.type == "cpu" and isinstance(model.lm_head, nn.Linear)


# -- litkv bench ----------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["int8", "int4", "int4-g64"])
def test_stored_weight_bytes_are_the_quantised_layers_parameters(text: str) -> None:
    quant = parse_quantize(text)
    linear = nn.Linear(128, 48, bias=False)
    layer = Int8Linear.from_linear(linear) if quant.mode == "int8" else Int4Linear.from_linear(linear, quant.group_size)
    assert stored_weight_bytes(48, 128, quant) == sum(p.nbytes for p in layer.parameters())


def test_bench_step_bytes_count_the_quantised_weights() -> None:
    prompt, new = 512, 128
    kv = 46_080 * (prompt + new / 2)  # SmolLM2-135M: 46,080 float32 KV bytes per cached token
    floats = bench_cmd._step_bytes("SmolLM2-135M", prompt, new) - kv  # tied head: the float weights once
    head = 4 * 49_152 * 576  # the LM head's float32 bytes (int4 stores it as int8)
    int8 = (1 + 2 / 576) / 4
    for text, per_float_byte in (("int8", int8 * floats), ("int4", (0.5 + 4 / 32) / 4 * (floats - head) + int8 * head)):
        weights = bench_cmd._step_bytes("SmolLM2-135M", prompt, new, text) - kv
        # every weight but the norms is in a linear layer: its stored bytes per float32 byte
        assert weights == pytest.approx(per_float_byte, rel=0.01)


def test_bench_rows_name_their_quantisation_and_bad_values_are_refused(tmp_path: Path) -> None:
    ours = BenchResult("litkv", 32, 8, 0.1, 50.0, 900.0, 10.0, [1, 2], quantize="int4")
    theirs = BenchResult("hf", 32, 8, 0.1, 25.0, 900.0, 10.0, [1, 2])
    ours_row, theirs_row = format_table([ours, theirs]).splitlines()[2:]
    assert ours_row.startswith("| 32 | litkv (int4 weights) |") and theirs_row.startswith("| 32 | hf |")
    assert theirs_row.split(" | ")[10] == "2.00"  # ratios still against litkv's row
    with pytest.raises(ValueError, match="quantize mode must be one of .* got 'fp8'"):
        bench_cmd.bench(quantize="fp8", weights_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []  # refused before any weights are written


def test_bench_worker_quantises_litkv_only(tiny_config, tmp_path: Path) -> None:
    hf_dir, lit_dir = peers.prepare_weights(tiny_config, 0, tmp_path)
    r = peers.run_peer("litkv", tiny_config, hf_dir, lit_dir, 12, 6, 8, 0, quantize="int8")
    from litkv.modeling.model import GPT

    model = quantize_model(peers.load_lit(tiny_config, lit_dir, GPT), parse_quantize("int8"))
    prompt = torch.randint(0, tiny_config.vocab_size, (12,), generator=torch.Generator().manual_seed(0))
    expected = generate(model, [prompt], 6, KVCacheConfig(cache_length=18, chunk_size=8))[0]
    assert r.quantize == "int8" and r.tokens == expected.tolist() and r.new_tokens == 6
    hf = peers.run_peer("hf", tiny_config, hf_dir, lit_dir, 12, 6, 8, 0, quantize="int8")
    assert hf.quantize == "none" and len(hf.tokens) == 6
