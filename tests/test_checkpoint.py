"""Safe checkpoint loading/saving (litkv.checkpoint), checked against litgpt's own GPT on the same weights.

`make_tiny_checkpoint` and `train_tiny_tokenizer` are also used by the CLI, convert and evaluate tests.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from litgpt.model import GPT as LitGPT
from litgpt.utils import save_config

from litkv.checkpoint import (
    check_checkpoint_dir,
    default_checkpoint_dir,
    load_config,
    load_model,
    load_state_dict,
    load_tokenizer,
    save_file_atomic,
    save_state_dict_atomic,
)
from litkv.config import Config
from litkv.model import GPT

TEXT = (
    "The quick brown fox jumps over the lazy dog. In the beginning was the word, and the word was with "
    "the fox. The passkey is 12345. Remember it. What is the passkey? The passkey is 12345. "
) * 20


def train_tiny_tokenizer(out_dir: Path, vocab_size: int = 320) -> None:
    """A byte-level BPE `tokenizer.json` + `tokenizer_config.json` (eos `<|endoftext|>`) in `out_dir`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TEXT], trainer=trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "add_bos_token": False}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config))


def tiny_config(vocab_size: int = 384, block_size: int = 256) -> Config:
    return Config(
        name="tiny-llama",
        block_size=block_size,
        vocab_size=vocab_size,
        padded_vocab_size=vocab_size,
        n_layer=2,
        n_head=4,
        n_query_groups=2,
        n_embd=32,
        rotary_percentage=1.0,
        parallel_residual=False,
        bias=False,
        norm_class_name="RMSNorm",
        mlp_class_name="LLaMAMLP",
        intermediate_size=64,
    )


def make_tiny_checkpoint(out_dir: Path, seed: int = 0, fmt: str = "safetensors", block_size: int = 256) -> GPT:
    """A random tiny GQA/RoPE GPT with a trained BPE tokenizer, saved in LitGPT layout."""
    torch.manual_seed(seed)
    config = tiny_config(block_size=block_size)
    model = GPT(config)
    with torch.no_grad():  # larger weights than the default init, so that the logits are not flat
        for p in model.parameters():
            p.normal_(0, 0.2)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_config(config, out_dir)
    name = "model.safetensors" if fmt == "safetensors" else "lit_model.pth"
    save_state_dict_atomic(out_dir / name, model.state_dict())
    train_tiny_tokenizer(out_dir)
    return model.eval()


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
        torch.testing.assert_close(model(idx), ref(idx), rtol=1e-4, atol=1e-4)
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
    save_config(tiny_config(), tmp_path)
    with pytest.raises(FileNotFoundError, match="model.safetensors or lit_model.pth"):
        check_checkpoint_dir(tmp_path)
    save_state_dict_atomic(tmp_path / "model.safetensors", GPT(tiny_config()).state_dict())
    with pytest.raises(FileNotFoundError, match="tokenizer.json or tokenizer.model"):
        check_checkpoint_dir(tmp_path)
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        load_tokenizer(tmp_path)
    train_tiny_tokenizer(tmp_path)
    assert check_checkpoint_dir(tmp_path) == tmp_path


def test_mismatched_weights_are_reported(tmp_path: Path) -> None:
    make_tiny_checkpoint(tmp_path)
    other = tiny_config()
    other.n_layer = 3
    save_config(other, tmp_path)
    with pytest.raises(ValueError, match="missing .* keys .*transformer.h.2"):
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


def test_save_file_atomic_keeps_old_file_on_error(tmp_path: Path) -> None:
    target = tmp_path / "f.bin"
    target.write_bytes(b"old")

    def failing(tmp: Path) -> None:
        tmp.write_bytes(b"partial")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        save_file_atomic(target, failing)
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]
    save_file_atomic(target, lambda tmp: tmp.write_bytes(b"new"))
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
        torch.testing.assert_close(model(idx), made(idx))
