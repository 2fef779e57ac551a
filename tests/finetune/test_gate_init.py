"""A `distill` run that starts from fitted gates (`--learn.init checkpoint`, the retrofit from a KVzap fit):
one bias shift for every layer and head, checked against a float64 computation from scratch, and the CLI
run that continues a checkpoint's gates of one scale, with LoRA adapters, into a checkpoint that loads by
path and keeps their target."""

from __future__ import annotations

import copy
import math

import jsonargparse
import pytest
import torch
from helpers import _reference_rope, float64_model, random_tokens
from test_learned_train import CONFIG, random_gates

from litkv.finetune.gate_training import GateTrainArgs, evictable, start_from
from litkv.modeling.model import GPT


def _logits_from_scratch(model: GPT, idx: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """`(n_layer, B, G, T)` float64 gate logits: pre-RoPE keys straight from each layer's qkv projection of a
    float64 forward written out (Pythia's parallel residual, full causal attention by einsum)."""
    c = model.config
    ref = float64_model(copy.deepcopy(model))
    b, t = idx.shape
    hs, nh, g = c.head_size, c.n_head, c.n_query_groups
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    group = torch.arange(nh) // (nh // g)
    x, out = ref.transformer.wte(idx), []
    for layer, block in enumerate(ref.transformer.h):
        q, k, v = block.attn.qkv(block.norm_1(x)).split((nh * hs, g * hs, g * hs), dim=-1)
        k_pre = k.view(b, t, g, hs)
        logit = torch.einsum("btgd,gd->bgt", k_pre, weight[layer].double()) / math.sqrt(hs)
        out.append(logit + bias[layer].double()[None, :, None])
        q, k = _reference_rope(q.view(b, t, nh, hs), c), _reference_rope(k_pre, c)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k[:, :, group]) / hs**0.5
        probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        y = torch.einsum("bhqk,bkhd->bqhd", probs, v.view(b, t, g, hs)[:, :, group])
        x = x + block.attn.proj(y.reshape(b, t, nh * hs)) + block.mlp(block.norm_2(x))
    return torch.stack(out)


@pytest.mark.parametrize("keep", [0.25, 0.5])
def test_start_from_shifts_every_bias_by_one_constant_to_the_keep_share(keep: float) -> None:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    gates = random_gates(5, window=3, sinks=1, scale=2.0)
    gates.target = "kvzip"
    idx = random_tokens(2, 40, seed=1)
    args = GateTrainArgs(target_keep=keep, window=3, sinks=1, init="checkpoint")
    started = start_from(model, gates, idx, args)
    assert torch.equal(started.weight, gates.weight)
    shift = started.bias - gates.bias
    assert torch.allclose(shift, shift.flatten()[0].expand_as(shift), atol=1e-6)  # one constant for all heads
    assert started.target == "kvzip" and (started.window, started.sinks) == (3, 1)
    with torch.no_grad():
        logits = _logits_from_scratch(model, idx, started.weight, started.bias)
    mask = evictable(40, 3, 1, idx.device)
    above = (logits[..., mask] > 0).double().mean().item()
    n = logits[..., mask].numel()
    assert abs(above - keep) <= 1.5 / n  # the k-th smallest of the pooled logits sits at 0


def test_cli_retrofit_continues_the_checkpoints_gates_with_lora(tmp_path) -> None:
    """`litkv finetune --learn_eviction true --learn.init checkpoint --learn.lora true` on a checkpoint whose
    gates are of one scale: the output's merged weights and gates load by path, the gates keep the target
    (so `learned` ranks them across layers) and moved from their start; without gates it is one error."""
    from test_finetune import write_text
    from tiny_checkpoint import make_tiny_checkpoint

    from litkv.checkpoints.checkpoint import load_model, save_gates
    from litkv.cli.finetune_cmd import finetune
    from litkv.gates import GATES_FILE, EvictionGates

    base, bare = tmp_path / "base", tmp_path / "bare"
    make_tiny_checkpoint(base, gates_seed=3)
    make_tiny_checkpoint(bare)
    fitted = EvictionGates.load(base / GATES_FILE)
    fitted.target = "kvzip"
    save_gates(fitted, base / GATES_FILE)
    text = write_text(tmp_path / "train.txt", 3000)
    argv = ["--data.path", str(text), "--data.seq_length", "48", "--learn_eviction", "true",
            "--kv_cache.policy", "learned", "--learn.steps", "2", "--learn.batch_size", "2", "--learn.window", "8",
            "--learn.init", "checkpoint", "--learn.ramp", "0", "--learn.target_keep", "0.25",
            "--learn.lora", "true", "--lora.r", "2", "--lora.targets", "[attn.qkv, attn.proj]"]  # fmt: skip
    jsonargparse.CLI(finetune, args=["--checkpoint_dir", str(base), *argv, "--out_dir", str(tmp_path / "out")])
    model = load_model(tmp_path / "out" / "final")  # merged weights, gates under their fingerprint
    gates = model.eviction_gates
    assert gates is not None and gates.target == "kvzip" and gates.one_scale
    assert not torch.allclose(gates.weight.cpu(), fitted.weight)  # trained on from the fit
    with pytest.raises(ValueError, match="--learn.init checkpoint starts from the checkpoint's eviction gates"):
        jsonargparse.CLI(finetune, args=["--checkpoint_dir", str(bare), *argv, "--out_dir", str(tmp_path / "x")])
    with pytest.raises(ValueError, match="init 'checkpoint' continues the checkpoint's gates by method 'distill'"):
        GateTrainArgs(method="lstsq", init="checkpoint")
