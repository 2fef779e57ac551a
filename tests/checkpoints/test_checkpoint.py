"""Safe checkpoint loading/saving (litkv.checkpoints.checkpoint),
checked against litgpt's own GPT on the same weights."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from helpers import forward_depth, max_diff, rounding_bound
from litgpt.model import GPT as LitGPT
from litgpt.utils import save_config
from tiny_checkpoint import checkpoint_config, make_tiny_checkpoint, train_tiny_tokenizer

from litkv.checkpoints.checkpoint import (
    check_checkpoint_dir,
    default_checkpoint_dir,
    load_config,
    load_model,
    load_state_dict,
    load_tokenizer,
    save_state_dict_atomic,
)
from litkv.core.atomic import write_atomic
from litkv.modeling.model import GPT


@pytest.mark.parametrize("fmt", ["safetensors", "pth"])
def test_load_model_matches_litgpt(tmp_path: Path, fmt: str) -> None:
    made = make_tiny_checkpoint(tmp_path, fmt=fmt)
    model = load_model(tmp_path)
    config = load_config(tmp_path)
    assert config.n_query_groups == 2 and config.n_layer == 2
    ref = LitGPT(config)
    ref.load_state_dict(made.state_dict())
    ref.eval()
    idx = torch.randint(0, config.padded_vocab_size, (2, 17))
    with torch.no_grad():
        expected = ref(idx)
        assert max_diff(model(idx), expected) <= rounding_bound(expected, forward_depth(config, 17))
    assert not model.training
    assert model.lm_head.weight.dtype == torch.float32


def test_load_model_dtype_and_device(tmp_path: Path) -> None:
    make_tiny_checkpoint(tmp_path)
    model = load_model(tmp_path, device="cpu", dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {p.device.type for p in model.parameters()} == {"cpu"}


def test_fabric_style_nested_pth_is_unwrapped(tmp_path: Path) -> None:
    made = make_tiny_checkpoint(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    torch.save({"model": made.state_dict()}, tmp_path / "lit_model.pth")
    model = load_model(tmp_path)
    torch.testing.assert_close(model.lm_head.weight, made.lm_head.weight)


class _Evil:
    def __reduce__(self):  # would run code on unpickling without weights_only
        return (os.system, ("echo pwned",))


def test_pickled_objects_are_refused(tmp_path: Path) -> None:
    made = make_tiny_checkpoint(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    torch.save({**made.state_dict(), "extra": _Evil()}, tmp_path / "lit_model.pth")
    with pytest.raises(ValueError, match="refusing to load .*pickled objects other than tensors"):
        load_model(tmp_path)


def test_non_tensor_entries_are_refused(tmp_path: Path) -> None:
    torch.save({"a": torch.zeros(2), "step": 3}, tmp_path / "x.pth")
    with pytest.raises(ValueError, match="entry 'step' is a int"):
        load_state_dict(tmp_path / "x.pth")


def test_missing_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        check_checkpoint_dir(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="model_config.yaml"):
        check_checkpoint_dir(tmp_path)
    save_config(checkpoint_config(), tmp_path)
    with pytest.raises(FileNotFoundError, match="model.safetensors or lit_model.pth"):
        check_checkpoint_dir(tmp_path)
    save_state_dict_atomic(tmp_path / "model.safetensors", GPT(checkpoint_config()).state_dict())
    with pytest.raises(FileNotFoundError, match="tokenizer.json or tokenizer.model"):
        check_checkpoint_dir(tmp_path)
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        load_tokenizer(tmp_path)
    train_tiny_tokenizer(tmp_path)
    assert check_checkpoint_dir(tmp_path) == tmp_path


def test_mismatched_weights_are_reported(tmp_path: Path) -> None:
    make_tiny_checkpoint(tmp_path)
    other = checkpoint_config()
    other.n_layer = 3
    save_config(other, tmp_path)
    with pytest.raises(ValueError, match="n_layer = 3, but .* holds 2 layers"):  # before the model is built
        load_model(tmp_path)
    other.n_layer, other.n_embd = 2, 96
    save_config(other, tmp_path)
    with pytest.raises(ValueError, match="shape"):
        load_model(tmp_path)


def test_tokenizer_roundtrip(tmp_path: Path) -> None:
    make_tiny_checkpoint(tmp_path)
    tok = load_tokenizer(tmp_path)
    text = "The passkey is 12345."
    ids = tok.encode(text)
    assert ids.dim() == 1 and ids.numel() < len(text)
    assert tok.decode(ids) == text
    assert tok.eos_id == 0


def test_save_state_dict_atomic_handles_tied_weights(tmp_path: Path) -> None:
    weight = torch.randn(4, 3)
    path = save_state_dict_atomic(tmp_path / "w.safetensors", {"a": weight, "b": weight, "c": weight.t()})
    loaded = load_state_dict(path)
    torch.testing.assert_close(loaded["a"], weight)
    torch.testing.assert_close(loaded["b"], weight)
    torch.testing.assert_close(loaded["c"], weight.t())
    pth = save_state_dict_atomic(tmp_path / "w.pth", {"a": weight})
    torch.testing.assert_close(load_state_dict(pth)["a"], weight)


def test_write_atomic_keeps_old_file_on_error(tmp_path: Path) -> None:
    target = tmp_path / "f.bin"
    target.write_bytes(b"old")

    def failing(tmp: Path) -> None:
        tmp.write_bytes(b"partial")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        write_atomic(target, failing)
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]
    write_atomic(target, lambda tmp: tmp.write_bytes(b"new"))
    assert target.read_bytes() == b"new"


def test_default_checkpoint_dir() -> None:
    import litkv

    assert default_checkpoint_dir() == Path(litkv.__file__).parent / "assets" / "default"


def test_litgpt_converted_pth_loads(tmp_path: Path) -> None:
    """`lit_model.pth` as litgpt's HF converter writes it (`incremental_save`) loads with weights_only."""
    from litgpt.utils import incremental_save

    made = make_tiny_checkpoint(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with incremental_save(tmp_path / "lit_model.pth") as saver:
        saver.save({k: saver.store_early(v) for k, v in made.state_dict().items()})
    model = load_model(tmp_path)
    idx = torch.randint(0, 384, (1, 9))
    with torch.no_grad():
        expected = made(idx)
        # same code and weights; the BLAS may still sum differently for differently aligned tensors
        assert max_diff(model(idx), expected) <= rounding_bound(expected, forward_depth(made.config, 9))
