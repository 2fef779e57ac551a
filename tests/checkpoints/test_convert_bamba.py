"""`litkv convert` on a Hugging Face `BambaForCausalLM` directory; unsupported layer kinds refused in one line
at convert and at load."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import helpers
import pytest
import torch
import yaml
from bamba_helpers import VOCAB, hf_in_float64, random_hf_bamba, tiny_bamba_config

from litkv.checkpoints.checkpoint import CONFIG_FILE, load_config, load_model
from litkv.checkpoints.convert import convert_hf_checkpoint

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    hf = random_hf_bamba(tiny_bamba_config(attn_layers=(2,), n_layer=3), seed=7)
    path = tmp_path_factory.mktemp("bamba") / "tiny-bamba"
    hf.save_pretrained(path, safe_serialization=True)
    return path, hf


def test_convert_then_load_gives_transformers_logits(hf_dir: tuple[Path, torch.nn.Module], tmp_path: Path) -> None:
    path, hf = hf_dir
    out = convert_hf_checkpoint(path, tmp_path / "ckpt")
    raw = yaml.safe_load((out / CONFIG_FILE).read_text())
    assert raw["layer_kinds"] == ["mamba2", "mamba2", "attention"]
    model = helpers.float64_model(load_model(out))
    assert model.lm_head.weight.dtype == torch.float64
    idx = torch.randint(0, VOCAB, (2, 13))
    with torch.no_grad(), hf_in_float64():
        expected = hf(idx).logits
    with torch.no_grad():
        got = model(idx)
    torch.testing.assert_close(got, expected, atol=1e-11, rtol=1e-11)


@pytest.mark.parametrize(
    ("model_type", "named"),
    [("mamba", "Mamba-1"), ("jamba", "mixture-of-experts"), ("nemotron_h", "MLP-only layers")],
)
def test_unsupported_kinds_are_one_line_at_convert(
    hf_dir: tuple[Path, torch.nn.Module], tmp_path: Path, model_type: str, named: str
) -> None:
    path, _ = hf_dir
    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.loads((path / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    with pytest.raises(ValueError, match=named) as err:
        convert_hf_checkpoint(bad, tmp_path / "out")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_moe_bamba_refused(hf_dir: tuple[Path, torch.nn.Module], tmp_path: Path) -> None:
    path, _ = hf_dir
    bad = tmp_path / "moe"
    bad.mkdir()
    config = json.loads((path / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "num_experts": 4}))
    with pytest.raises(ValueError, match=r"mixture-of-experts MLPs \(num_experts=4\)"):
        convert_hf_checkpoint(bad, tmp_path / "out")


@pytest.mark.slow
def test_cli_convert_refuses_mamba1_in_one_line(hf_dir: tuple[Path, torch.nn.Module], tmp_path: Path) -> None:
    path, _ = hf_dir
    bad = tmp_path / "mamba1"
    bad.mkdir()
    config = json.loads((path / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "model_type": "mamba"}))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "litkv", "convert", str(bad), str(tmp_path / "out")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Mamba-1" in lines[0], done.stderr


def test_unknown_layer_kind_is_one_line_at_load(hf_dir: tuple[Path, torch.nn.Module], tmp_path: Path) -> None:
    path, _ = hf_dir
    out = convert_hf_checkpoint(path, tmp_path / "ckpt")
    raw = yaml.safe_load((out / CONFIG_FILE).read_text())
    raw["layer_kinds"][1] = "mamba1"
    (out / CONFIG_FILE).write_text(yaml.dump(raw))
    with pytest.raises(ValueError, match="layer 1 has kind 'mamba1', which litkv does not implement") as err:
        load_config(out)
    assert "\n" not in str(err.value)
