"""LoRA on a hybrid model: adapters on the attention layers' `qkv`/`proj` and the Mamba-2 mixers'
`in_proj`/`out_proj`; the chunked gradient engine's adapter gradients equal plain autograd on the whole
sequence (float64), and `python -m litkv finetune` trains a converted hybrid checkpoint (the loss falls,
both kinds of adapter move)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from bamba_helpers import VOCAB, bamba_config, random_hf_bamba, tiny_bamba_config
from helpers import tiny_gpt
from safetensors.torch import load_file
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from litkv import GPT, KVCacheConfig
from litkv.checkpoints.checkpoint import load_model
from litkv.checkpoints.convert import convert_hf_checkpoint
from litkv.finetune.lora import LoRAArgs, LoRALinear, apply_lora, mark_only_lora_as_trainable
from litkv.gradient import chunked_loss_backward

REPO = Path(__file__).resolve().parents[2]
TARGETS = ["attn.qkv", "attn.proj", "mamba.in_proj", "mamba.out_proj"]
WORDS = ["the", "cache", "key", "value", "token", "slot", "policy", "keeps", "drops", "state", "layer", "scan"]


def _lora_hybrid(seed: int) -> GPT:
    model = tiny_gpt(seed, torch.float64, config=bamba_config(attn_layers=(1,), n_layer=3))
    torch.manual_seed(seed)  # the adapters' A: drawn from the global generator
    apply_lora(model, LoRAArgs(r=2, alpha=4.0, targets=TARGETS))
    torch.manual_seed(seed + 1)
    with torch.no_grad():  # non-zero B, so that every adapter's A gets a gradient too
        for module in model.modules():
            if isinstance(module, LoRALinear):
                module.lora_B.normal_(0.0, 0.1)
    mark_only_lora_as_trainable(model)
    return model


def test_adapters_cover_both_kinds_of_layer() -> None:
    model = _lora_hybrid(seed=0)
    names = sorted(n for n, m in model.named_modules() if isinstance(m, LoRALinear))
    assert names == [
        "transformer.h.0.attn.in_proj",
        "transformer.h.0.attn.out_proj",
        "transformer.h.1.attn.proj",
        "transformer.h.1.attn.qkv",
        "transformer.h.2.attn.in_proj",
        "transformer.h.2.attn.out_proj",
    ]


def test_adapter_gradients_match_plain_autograd() -> None:
    engine, naive = _lora_hybrid(seed=2), _lora_hybrid(seed=2)
    gen = torch.Generator().manual_seed(3)
    idx = torch.randint(0, VOCAB, (2, 29), generator=gen)
    targets = torch.randint(0, VOCAB, (2, 29), generator=gen)
    targets[0, :5] = -100
    loss = chunked_loss_backward(engine, idx, targets, KVCacheConfig("dense", cache_length=40, chunk_size=6))
    ref = F.cross_entropy(naive(idx).flatten(0, 1), targets.flatten(), ignore_index=-100)  # one pass, no cache
    ref.backward()
    assert loss == pytest.approx(float(ref.detach()), rel=1e-6)  # the engine's cross-entropy runs in float32
    got = {n: p.grad for n, p in engine.named_parameters() if p.requires_grad}
    expected = {n: p.grad for n, p in naive.named_parameters() if p.requires_grad}
    assert set(got) == set(expected) and len(got) == 2 * 6
    for name, grad in expected.items():  # float32 cross-entropy in the engine: errors ~1e-7 of the largest entry
        assert float(grad.abs().max()) > 0, name
        error = float((got[name] - grad).abs().max() / grad.abs().max())
        assert error < 1e-5, (name, error)


def _tokenizer(path: Path) -> None:
    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]", "<|endoftext|>"], show_progress=False)
    tokenizer.train_from_iterator([" ".join(WORDS)] * 8, trainer)
    assert tokenizer.get_vocab_size() <= VOCAB
    tokenizer.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "add_bos_token": False}
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def _text_loss(model: GPT, tokens: torch.Tensor) -> float:
    with torch.no_grad():
        logits = model(tokens[None, :-1].to(model.lm_head.weight.device))
    return float(F.cross_entropy(logits[0].float(), tokens[1:]))


@pytest.mark.slow
def test_cli_finetune_lora_on_a_converted_hybrid_checkpoint(tmp_path: Path) -> None:
    hf_dir = tmp_path / "hf"
    random_hf_bamba(tiny_bamba_config(attn_layers=(1,), n_layer=3), seed=4).float().save_pretrained(hf_dir)
    _tokenizer(hf_dir)
    ckpt = convert_hf_checkpoint(hf_dir, tmp_path / "ckpt")
    rng = random.Random(0)
    text = tmp_path / "t.txt"
    text.write_text(" ".join(rng.choice(WORDS[:4]) for _ in range(80)) + "\n")  # 4 words: easy to learn
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "litkv", "finetune", "--checkpoint_dir", str(ckpt), "--data.path", str(text),
           "--data.seq_length", "16", "--data.val_fraction", "0", "--kv_cache.policy", "h2o",
           "--kv_cache.cache_length", "8", "--kv_cache.chunk_size", "4", "--lora.targets", f"[{', '.join(TARGETS)}]",
           "--train.max_steps", "2", "--train.global_batch_size", "4", "--train.micro_batch_size", "2",
           "--train.lr", "0.02", "--train.warmup_steps", "0", "--out_dir", str(out)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    final = out / "final"
    adapters = load_file(str(final / "lora.safetensors"))
    moved = {k.rpartition(".lora_")[0] for k, v in adapters.items() if k.endswith("lora_B") and v.abs().max() > 0}
    assert moved == {
        f"transformer.h.{i}.attn.{n}"
        for i, n in [(0, "in_proj"), (0, "out_proj"), (1, "qkv"), (1, "proj"), (2, "in_proj"), (2, "out_proj")]
    }  # fmt: skip  (B starts at 0: a gradient reached it)
    tokens = torch.tensor(Tokenizer.from_file(str(ckpt / "tokenizer.json")).encode(text.read_text()).ids)
    before, after = _text_loss(load_model(ckpt), tokens), _text_loss(load_model(final), tokens)
    assert after < before - 0.05, (before, after)
