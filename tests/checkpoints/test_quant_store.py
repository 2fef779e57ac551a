"""Stored quantised checkpoints (`litkv convert --quantize`, `litkv.checkpoints.quant_store`): the round trip against
quantising the float checkpoint at load (bitwise), the packing in blocks of rows against packing the
whole weight, and the refusals (another scheme, missing metadata, misshapen codes, truncated file)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from gguf_files import TinyGGUF, write_gguf
from safetensors.torch import load_file, save_file

from litkv.checkpoints.checkpoint import SAFETENSORS_FILE, load_model, load_state_dict
from litkv.checkpoints.quant_store import QUANT_KEY
from litkv.checkpoints.runtime import load_for_inference
from litkv.cli.convert_cmd import convert
from litkv.modeling.fingerprint import model_fingerprint
from litkv.modeling.quant_weights import Int4Linear, Int8Linear, int4_from_nibbles, int4_nibbles

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def stored(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """`tiny_ckpt` written again with int8 and with int4 weights."""
    root = tmp_path_factory.mktemp("quantised")
    for mode in ("int8", "int4"):
        convert(tiny_ckpt, root / mode, quantize=mode)
    return {mode: root / mode for mode in ("int8", "int4")}


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for item in src.iterdir():
        (dst / item.name).write_bytes(item.read_bytes())
    return dst


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_stored_checkpoint_gives_the_logits_of_quantising_at_load_bitwise(
    tiny_ckpt: Path, stored: dict[str, Path], mode: str
) -> None:
    at_load, _ = load_for_inference(tiny_ckpt, None, "cpu", 1, mode)
    from_file, _ = load_for_inference(stored[mode], None, "cpu", 1, "none")
    assert not any(isinstance(m, torch.nn.Linear) for m in from_file.modules())
    assert isinstance(from_file.lm_head, Int8Linear)  # int4 keeps the LM head at int8
    assert isinstance(from_file.transformer.h[0].attn.qkv, Int8Linear if mode == "int8" else Int4Linear)
    idx = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for rows in (12, 3):  # prefill chunks dequantise; a few rows go through the packed kernels
            assert torch.equal(at_load(idx[:, :rows]), from_file(idx[:, :rows]))
    assert model_fingerprint(at_load) == model_fingerprint(from_file)
    float_model, _ = load_for_inference(tiny_ckpt, None, "cpu", 1, "none")
    assert model_fingerprint(float_model)["weights"] != model_fingerprint(from_file)["weights"]


def test_the_stored_file_holds_codes_and_names_the_scheme(stored: dict[str, Path]) -> None:
    from safetensors import safe_open

    with safe_open(str(stored["int4"] / SAFETENSORS_FILE), framework="pt") as f:
        assert f.metadata()[QUANT_KEY] == "int4"
        keys = set(f.keys())
    assert "transformer.h.0.attn.qkv.codes" in keys and "transformer.h.0.attn.qkv.scale_zeros" in keys
    assert "lm_head.scales" in keys and "transformer.h.0.norm_1.weight" in keys
    assert not any(k.endswith(("qkv.weight", "proj.weight", "fc_1.weight", "lm_head.weight", ".packed")) for k in keys)


@pytest.mark.parametrize("n", [2048 + 64, 48])
def test_packing_in_blocks_of_rows_is_packing_the_whole_weight(n: int) -> None:
    codes = torch.randint(0, 16, (n, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    assert torch.equal(int4_from_nibbles(int4_nibbles(codes)), codes)
    scale_zeros = torch.ones(2, n, 2, dtype=torch.bfloat16)
    layer = Int4Linear.from_codes(int4_nibbles(codes), scale_zeros, 32, None, nibbles=True)
    assert torch.equal(layer.packed, torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1))


@pytest.mark.parametrize(("mode", "asked"), [("int4", "int8"), ("int4", "int4-g64"), ("int8", "int4")])
def test_another_quantize_is_refused_in_one_line_naming_both(stored: dict[str, Path], mode: str, asked: str) -> None:
    with pytest.raises(ValueError, match=f"stored quantised as {mode}, --quantize {asked} asks for another") as err:
        load_for_inference(stored[mode], None, "cpu", 1, asked)
    assert "\n" not in str(err.value)
    model, _ = load_for_inference(stored[mode], None, "cpu", 1, mode)  # its own scheme is fine
    assert isinstance(model.lm_head, Int8Linear)


def test_codes_without_metadata_are_refused(stored: dict[str, Path], tmp_path: Path) -> None:
    bad = _copy(stored["int4"], tmp_path / "bad")
    save_file(load_file(str(bad / SAFETENSORS_FILE)), str(bad / SAFETENSORS_FILE))  # metadata dropped
    with pytest.raises(ValueError, match=f"holds quantised weights .* but no {QUANT_KEY} metadata"):
        load_model(bad)


def test_metadata_naming_another_scheme_than_the_codes_is_refused(stored: dict[str, Path], tmp_path: Path) -> None:
    bad = _copy(stored["int4"], tmp_path / "bad")
    tensors = load_file(str(bad / SAFETENSORS_FILE))
    save_file(tensors, str(bad / SAFETENSORS_FILE), metadata={QUANT_KEY: "int8", "litkv_quant_format": "1"})
    with pytest.raises(ValueError, match=r"transformer.h.0.attn.qkv.codes is torch.uint8 \(64, 16\), expected torch."):
        load_model(bad)


def test_a_truncated_file_is_a_clear_error(stored: dict[str, Path], tmp_path: Path) -> None:
    bad = _copy(stored["int8"], tmp_path / "bad")
    data = (bad / SAFETENSORS_FILE).read_bytes()
    (bad / SAFETENSORS_FILE).write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="is not a valid safetensors file .truncated or corrupt"):
        load_model(bad)


def test_a_quantised_checkpoint_off_the_cpu_is_refused(stored: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="holds int4 weights, which run on the CPU only, got cuda"):
        load_model(stored["int4"], device="cuda")


def test_a_quantised_source_is_not_quantised_again(stored: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"is quantised already \(int8\); quantise the float checkpoint"):
        convert(stored["int8"], tmp_path / "again", quantize="int8")
    assert not (tmp_path / "again").exists()


@pytest.fixture(scope="module")
def procs(tiny_ckpt: Path, stored: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """The `python -m litkv` processes of this file, started at once so that their imports overlap:
    "convert" (into the returned directory's `q`) and "refused"."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    out = tmp_path_factory.mktemp("cli")
    commands = {
        "convert": ["convert", str(tiny_ckpt), str(out / "q"), "--quantize", "int4"],
        "refused": ["generate", str(stored["int4"]), "--prompt", "The", "--max_new_tokens", "2", "--device", "cpu",
                    "--quantize", "int8"],
    }  # fmt: skip
    started = {
        name: subprocess.Popen([sys.executable, "-m", "litkv", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=env, cwd=REPO)
        for name, args in commands.items()
    }  # fmt: skip
    yield {"out": out, **started}
    for proc in started.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.mark.slow
def test_convert_cli_quantises_a_checkpoint_directory(procs: dict) -> None:
    stdout, stderr = procs["convert"].communicate(timeout=600)
    assert procs["convert"].returncode == 0, stderr
    assert "(int4 weights)" in stdout
    assert isinstance(load_model(procs["out"] / "q").transformer.h[1].mlp.proj, Int4Linear)


def test_bfloat16_float_parts_round_trip_bitwise(tiny_ckpt: Path, tmp_path: Path) -> None:
    convert(tiny_ckpt, tmp_path / "bf16", dtype="bfloat16", quantize="int4")
    at_load, _ = load_for_inference(tiny_ckpt, "bf16-true", "cpu", 1, "int4")
    from_file, _ = load_for_inference(tmp_path / "bf16", "bf16-true", "cpu", 1, "none")
    assert from_file.transformer.wte.weight.dtype == torch.bfloat16
    assert from_file.lm_head.scales.dtype == torch.bfloat16
    idx = torch.randint(0, 300, (1, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(at_load(idx), from_file(idx))


def test_a_gguf_file_is_quantised_as_its_float_conversion(tmp_path: Path) -> None:
    gguf_file = tmp_path / "m.gguf"
    write_gguf(gguf_file, TinyGGUF(n_layer=1, qtypes=("Q4_1",)))
    convert(gguf_file, tmp_path / "direct", quantize="int4")
    convert(gguf_file, tmp_path / "float")
    convert(tmp_path / "float", tmp_path / "two_steps", quantize="int4")
    direct, two_steps = (load_state_dict(tmp_path / d / SAFETENSORS_FILE) for d in ("direct", "two_steps"))
    assert set(direct) == set(two_steps) and all(torch.equal(direct[k], two_steps[k]) for k in direct)


@pytest.mark.slow
def test_the_cli_refuses_another_quantize_in_one_line(procs: dict) -> None:
    proc = procs["refused"]
    stdout, stderr = proc.communicate(timeout=600)
    lines = stderr.strip().splitlines()
    assert proc.returncode != 0 and stdout == "" and len(lines) == 1, stderr
    assert "stored quantised as int4, --quantize int8 asks for another scheme" in lines[0]
