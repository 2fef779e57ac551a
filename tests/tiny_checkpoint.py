"""A tiny LitGPT-layout checkpoint (random GQA/RoPE GPT, trained byte-level BPE tokenizer) for tests.

Used by the checkpoint, CLI, convert and evaluate tests: ``from tiny_checkpoint import ...``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from helpers import random_gates
from litgpt.utils import save_config

from litkv.checkpoints.checkpoint import save_gates, save_state_dict_atomic
from litkv.gates.gate import GATES_FILE
from litkv.modeling.config import Config
from litkv.modeling.fingerprint import model_fingerprint
from litkv.modeling.model import GPT

__all__ = ["TEXT", "checkpoint_config", "make_tiny_checkpoint", "train_tiny_tokenizer"]

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


def checkpoint_config(vocab_size: int = 384, block_size: int = 256) -> Config:
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


def make_tiny_checkpoint(
    out_dir: Path, seed: int = 0, fmt: str = "safetensors", block_size: int = 256, gates_seed: int | None = None
) -> GPT:
    """A random tiny GQA/RoPE GPT with a trained BPE tokenizer, saved in LitGPT layout; with `gates_seed`,
    also random eviction gates (`helpers.random_gates`) in `eviction_gates.safetensors`."""
    torch.manual_seed(seed)
    config = checkpoint_config(block_size=block_size)
    model = GPT(config)
    with torch.no_grad():  # larger weights than the default init, so that the logits are not flat
        for p in model.parameters():
            p.normal_(0, 0.2)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_config(config, out_dir)
    name = "model.safetensors" if fmt == "safetensors" else "lit_model.pth"
    save_state_dict_atomic(out_dir / name, model.state_dict())
    train_tiny_tokenizer(out_dir)
    if gates_seed is not None:
        gates = random_gates(config, gates_seed)
        gates.weights = model_fingerprint(model)["weights"]  # gates prove the weights they are for
        save_gates(gates, out_dir / GATES_FILE)
    return model.eval()


# SmolLM2-135M-Instruct's chat template, as its GGUF file's `tokenizer.chat_template` holds it.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def write_chatml_tokenizer(out: Path, template: str = SMOLLM2_TEMPLATE) -> None:
    """A byte-level BPE with `<|endoftext|>`=0, `<|im_start|>`=1, `<|im_end|>`=2 and the template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TEXT], trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": template,
        "bos_token": "<|im_start|>",
        "eos_token": "<|endoftext|>",
        "add_bos_token": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [0]}))
