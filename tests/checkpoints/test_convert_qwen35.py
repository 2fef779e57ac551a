"""`litkv convert` on Hugging Face Qwen3.5 directories (the text model, and the multimodal form whose language
model sits under `model.language_model.` beside a vision tower and MTP weights); mixture-of-experts forms and
unknown layer kinds refused in one line at convert and at load."""

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
from qwen35_helpers import VOCAB, hf_in_float64, random_hf_qwen35, tiny_qwen35_config
from safetensors.torch import save_file

from litkv.checkpoints.checkpoint import CONFIG_FILE, load_config, load_model
from litkv.checkpoints.convert import convert_hf_checkpoint

REPO = Path(__file__).resolve().parents[2]
KINDS = ["gated_deltanet", "gated_deltanet", "attention"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    hf = random_hf_qwen35(tiny_qwen35_config(n_layer=3, interval=3), seed=7)
    path = tmp_path_factory.mktemp("qwen35") / "tiny-qwen3.5"
    hf.save_pretrained(path, safe_serialization=True)
    return path, hf


def _check_logits(out: Path, hf: torch.nn.Module) -> None:
    model = helpers.float64_model(load_model(out))
    idx = torch.randint(0, VOCAB, (2, 13))
    with torch.no_grad(), hf_in_float64():
        expected = hf(idx).logits
    with torch.no_grad():
        got = model(idx)
    torch.testing.assert_close(got, expected, atol=1e-10, rtol=1e-10)


def test_convert_then_load_gives_transformers_logits(hf_dir: tuple[Path, torch.nn.Module], tmp_path: Path) -> None:
    path, hf = hf_dir
    assert json.loads((path / "config.json").read_text())["model_type"] == "qwen3_5_text"
    (path / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    out = convert_hf_checkpoint(path, tmp_path / "ckpt")
    assert (out / "chat_template.jinja").read_text() == (path / "chat_template.jinja").read_text()
    raw = yaml.safe_load((out / CONFIG_FILE).read_text())
    assert raw["layer_kinds"] == KINDS
    assert raw["attn_output_gate"] and raw["norm_unit_offset"] and raw["rotary_percentage"] == 0.25
    _check_logits(out, hf)


def test_multimodal_directory_converts_its_language_model(hf_dir: tuple[Path, torch.nn.Module], tmp_path: Path) -> None:
    """`model_type: qwen3_5` with a nested `text_config`; the vision tower and MTP tensors are left out."""
    path, hf = hf_dir
    text = json.loads((path / "config.json").read_text())
    src = tmp_path / "qwen3.5-vl"
    src.mkdir()
    config = {"model_type": "qwen3_5", "text_config": text, "vision_config": {"depth": 1}}
    (src / "config.json").write_text(json.dumps(config))
    weights = {k.replace("model.", "model.language_model.", 1): v for k, v in hf.state_dict().items()}
    weights["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
    weights["mtp.fc.weight"] = torch.zeros(4, 4)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(src / "model.safetensors"))
    out = convert_hf_checkpoint(src, tmp_path / "ckpt")
    assert yaml.safe_load((out / CONFIG_FILE).read_text())["layer_kinds"] == KINDS
    _check_logits(out, hf)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"model_type": "qwen3_5_moe"}, "model_type 'qwen3_5_moe' has mixture-of-experts MLPs"),
        ({"model_type": "qwen3_next", "num_experts": 8}, r"mixture-of-experts MLPs \(num_experts=8"),
        ({"layer_types": ["linear_attention", "sliding_attention", "full_attention"]}, "'sliding_attention'"),
        ({"attention_bias": True}, "attention biases"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "RoPE scaling of type 'yarn'"),
    ],
)
def test_what_litkv_lacks_is_one_line_at_convert(
    hf_dir: tuple[Path, torch.nn.Module], tmp_path: Path, change: dict, named: str
) -> None:
    path, _ = hf_dir
    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.loads((path / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=named) as err:
        convert_hf_checkpoint(bad, tmp_path / "out")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()  # refused before anything was written


@pytest.mark.slow
def test_cli_convert_refuses_moe_in_one_line(hf_dir: tuple[Path, torch.nn.Module], tmp_path: Path) -> None:
    path, _ = hf_dir
    bad = tmp_path / "moe"
    bad.mkdir()
    config = json.loads((path / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "model_type": "qwen3_5_moe_text"}))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "litkv", "convert", str(bad), str(tmp_path / "out")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "mixture-of-experts" in lines[0], done.stderr


def test_unknown_layer_kind_is_one_line_at_load(hf_dir: tuple[Path, torch.nn.Module], tmp_path: Path) -> None:
    path, _ = hf_dir
    out = convert_hf_checkpoint(path, tmp_path / "ckpt")
    raw = yaml.safe_load((out / CONFIG_FILE).read_text())
    raw["layer_kinds"][1] = "gated_deltanet2"
    (out / CONFIG_FILE).write_text(yaml.dump(raw))
    with pytest.raises(ValueError, match="layer 1 has kind 'gated_deltanet2', which litkv does not implement") as err:
        load_config(out)
    assert "\n" not in str(err.value)
