"""`litkv convert` of the shipped model's own GGUF file attaches the eviction gates litkv ships for it (the
weights' fingerprint matches), with or without `--quantize`, so `--kv-cache learned` works on the result as
on the known name; another model's GGUF gets none. Skipped without the real model's GGUF file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from litkv.__main__ import main
from litkv.checkpoints.checkpoint import GATES_FILE, load_model
from litkv.checkpoints.download import MODELS, gguf_file
from litkv.checkpoints.known import shipped_gates_file
from litkv.gates.gate import EvictionGates
from litkv.modeling.fingerprint import model_fingerprint

NAME = "smollm2-135m-instruct"
SOURCE = gguf_file(MODELS[NAME], fetch=False)

pytestmark = [pytest.mark.slow, pytest.mark.skipif(SOURCE is None, reason=f"no GGUF file of {NAME}")]


def _same_gates(a: EvictionGates, b: EvictionGates) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def test_convert_of_the_shipped_gguf_attaches_the_shipped_gates(tmp_path: Path, capsys) -> None:
    shipped = EvictionGates.load(shipped_gates_file(NAME))
    main(["convert", str(SOURCE), str(tmp_path / "float")])
    assert "added its eviction gates" in capsys.readouterr().out
    model = load_model(tmp_path / "float")  # load_model checks the gates' fingerprint against the weights
    assert model.eviction_gates is not None and _same_gates(model.eviction_gates, shipped)
    assert shipped.weights == model_fingerprint(model)["weights"]

    main(["convert", str(SOURCE), str(tmp_path / "int4"), "--quantize", "int4"])
    quantized = load_model(tmp_path / "int4")
    assert quantized.eviction_gates is not None and _same_gates(quantized.eviction_gates, shipped)
    assert quantized.eviction_gates.weights == model_fingerprint(quantized)["weights"] != shipped.weights
    args = ["--kv-cache", "learned", "--kv_cache.cache_length", "64", "--max_new_tokens", "2", "--prompt", "Hi"]
    main(["generate", str(tmp_path / "int4"), *args])
    assert "cache: learned, 64 slots" in capsys.readouterr().err


def test_convert_of_another_gguf_attaches_none(tmp_path: Path) -> None:
    main(["convert", str(SOURCE), str(tmp_path / "bf16"), "--dtype", "bfloat16"])  # other weights: other fingerprint
    assert not (tmp_path / "bf16" / GATES_FILE).exists()
