"""Training eviction gates: the soft attention against a float64 oracle written from scratch, its
gradient against naive autograd, saturated gates against hard masks, training lowers the loss, and
`litkv finetune --learn_eviction true` writes a checkpoint that `load_model` reads back."""

from __future__ import annotations

import copy
import math

import jsonargparse
import pytest
import torch
import torch.nn.functional as F
from helpers import _reference_rope, band_mask, float64_model, random_tokens, reference_forward, tiny_config, tiny_gpt

from litkv.finetune.gate_training import GateTrainArgs, evictable, train_gates
from litkv.gates import EvictionGates, SoftEviction, soft_eviction
from litkv.gates.soft import soft_bias

CONFIG = tiny_config("pythia-14m", n_layer=2, n_head=4, n_query_groups=2, rotary_percentage=0.5)


def random_gates(seed: int, window: int = 3, sinks: int = 1, scale: float = 1.0, bias: float = 0.0) -> EvictionGates:
    g = torch.Generator().manual_seed(seed)
    c = CONFIG
    weight = torch.randn(c.n_layer, c.n_query_groups, c.head_size, generator=g) * scale
    return EvictionGates(weight, torch.randn(c.n_layer, c.n_query_groups, generator=g) + bias, window, sinks)


def oracle_forward(
    model, idx: torch.Tensor, gates: EvictionGates, weight: torch.Tensor, bias: torch.Tensor, tau: float
):
    """Float64 logits of the soft-evicting model, written from scratch: pre-RoPE keys straight from the qkv
    projection, the bias built element by element (loops), attention by einsum; `weight`/`bias` are the
    gate tensors autograd differentiates."""
    c = model.config
    ref = float64_model(copy.deepcopy(model))
    b, t = idx.shape
    hs, nh, g = c.head_size, c.n_head, c.n_query_groups
    x = ref.transformer.wte(idx)
    for layer, block in enumerate(ref.transformer.h):
        h = block.norm_1(x)
        q, k, v = block.attn.qkv(h).split((nh * hs, g * hs, g * hs), dim=-1)
        k_pre = k.view(b, t, g, hs)
        logit = torch.einsum("btgd,gd->bgt", k_pre, weight[layer]) / math.sqrt(hs) + bias[layer][None, :, None]
        log_keep = F.logsigmoid(logit / tau)
        add = torch.zeros(b, g, t, t, dtype=torch.float64)
        for i in range(t):
            for j in range(t):
                if j > i:
                    add[:, :, i, j] = float("-inf")
                elif i - j >= gates.window and j >= gates.sinks:
                    add[:, :, i, j] = log_keep[:, :, j]
        q = _reference_rope(q.view(b, t, nh, hs), c)
        k = _reference_rope(k_pre, c)
        group = torch.arange(nh) // (nh // g)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k[:, :, group]) / hs**0.5 + add[:, group]
        y = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1), v.view(b, t, g, hs)[:, :, group])
        attn = block.attn.proj(y.reshape(b, t, nh * hs))
        x = x + attn + block.mlp(block.norm_2(x))  # parallel residual (Pythia)
    return ref.lm_head(ref.transformer.ln_f(x))


def test_soft_forward_and_gate_gradient_equal_float64_oracle():
    model = tiny_gpt(1, torch.float64, config=CONFIG)
    idx = random_tokens(2, 12, seed=2)
    gates = random_gates(3, scale=3.0)
    w = gates.weight.double().requires_grad_(True)
    b = gates.bias.double().requires_grad_(True)
    ours = EvictionGates(w, b, gates.window, gates.sinks)
    soft = SoftEviction(ours, CONFIG.rope_n_elem, temperature=0.7, noise=False, straight_through=False)
    with soft_eviction(model, soft):
        logits = model(idx)
    expected = oracle_forward(model, idx, gates, w, b, 0.7)
    # the model's RoPE table is float32 (LitGPT's): the dense model itself is ~6e-8 from the oracle
    assert torch.allclose(logits, expected, atol=1e-5, rtol=0)
    assert (model(idx) - expected).abs().max() > 0.1  # the gates do change the output
    probe = torch.randn(logits.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    grads = torch.autograd.grad((logits * probe).sum(), (w, b))
    w2 = gates.weight.double().requires_grad_(True)
    b2 = gates.bias.double().requires_grad_(True)
    ref_grads = torch.autograd.grad((oracle_forward(model, idx, gates, w2, b2, 0.7) * probe).sum(), (w2, b2))
    for got, want in zip(grads, ref_grads, strict=True):
        assert torch.isfinite(got).all() and got.abs().sum() > 0
        assert torch.allclose(got, want, atol=1e-6, rtol=1e-4)
    assert set(soft.keep) == {0, 1} and soft.keep[0].shape == (2, CONFIG.n_query_groups, 12)


@pytest.mark.parametrize("keep", [True, False])
def test_saturated_gates_equal_hard_masks(keep):
    """Gates far from 0: soft == hard decision; keep-all is the dense model, evict-all is a band + sinks mask."""
    model = tiny_gpt(5, torch.float64, config=CONFIG)
    idx = random_tokens(1, 14, seed=6)
    gates = random_gates(7, window=4, sinks=2, scale=0.0, bias=60.0 if keep else -60.0)
    outs = []
    for straight_through in (False, True):
        gates64 = EvictionGates(gates.weight.double(), gates.bias.double(), 4, 2)
        soft = SoftEviction(gates64, CONFIG.rope_n_elem, noise=False, straight_through=straight_through)
        with soft_eviction(model, soft):
            outs.append(model(idx))
    expected = model(idx) if keep else reference_forward(model, idx, masks=band_mask(5, sinks=2)).logits
    for out in outs:
        assert torch.allclose(out, expected, atol=1e-5, rtol=0)  # float32 RoPE table, as above


def test_soft_bias_against_loops():
    log_keep = torch.randn(1, 2, 9)
    bias = soft_bias(log_keep, window=3, sinks=2, sliding=6)
    for i in range(9):
        for j in range(9):
            d = i - j
            want = float("-inf") if d < 0 or d >= 6 else (0.0 if d < 3 or j < 2 else None)
            got = bias[0, :, i, j]
            if want is None:
                assert torch.equal(got, log_keep[0, :, j])
            else:
                assert torch.all(got == want)
    assert (
        evictable(9, 3, 2, torch.device("cpu")).tolist() == [False, False, True, True, True, True, False] + [False] * 2
    )


@pytest.mark.parametrize("method, engine", [("distill", "chunked"), ("distill", "whole"), ("regress", "whole")])
def test_training_lowers_the_loss(method, engine):
    model = tiny_gpt(8, config=CONFIG)
    g = torch.Generator().manual_seed(9)
    examples = []
    for _ in range(8):
        ids = torch.randint(0, 128, (65,), generator=g)
        examples.append((ids[:-1], ids[1:]))
    args = GateTrainArgs(
        method=method,
        steps=30,
        batch_size=2,
        window=4,
        sinks=1,
        target_keep=0.3,
        ramp=0.0,
        lr=0.1,
        seed=1,
        engine=engine,
    )  # ramp 0: the compression target is fixed from the first step, so the total loss is comparable
    gates, logs = train_gates(model, examples, args)
    first, last = sum(log.loss for log in logs[:5]) / 5, sum(log.loss for log in logs[-5:]) / 5
    assert math.isfinite(last) and last < first
    if method == "distill":
        assert logs[-1].keep < logs[0].keep  # the compression term moved the gates
    assert not gates.weight.requires_grad and all(not p.requires_grad for p in model.parameters())


def test_gate_args_and_gates_validate():
    with pytest.raises(ValueError, match="method must be one of"):
        GateTrainArgs(method="oracle")
    with pytest.raises(ValueError, match="target_keep"):
        GateTrainArgs(target_keep=0)
    with pytest.raises(ValueError, match="window must be"):
        GateTrainArgs(window=-1)
    with pytest.raises(ValueError, match="gate weight must be"):
        EvictionGates(torch.zeros(2, 3), torch.zeros(2), 1, 0)
    gates = random_gates(0)
    with pytest.raises(ValueError, match=r"the model has \(3, 2, 16\)"):
        gates.check_model(3, 2, 16, None, "test")


def test_finetune_learn_eviction_writes_a_loadable_checkpoint(tmp_path):
    from test_finetune import write_text
    from tiny_checkpoint import make_tiny_checkpoint

    from litkv.checkpoints.checkpoint import load_model
    from litkv.cli.finetune_cmd import finetune
    from litkv.gates import GATES_FILE

    base = tmp_path / "base"
    make_tiny_checkpoint(base)
    text = write_text(tmp_path / "train.txt", 3000)
    argv = ["--checkpoint_dir", str(base), "--data.path", str(text), "--data.seq_length", "48", "--learn_eviction",
            "true", "--kv_cache.policy", "learned", "--learn.steps", "3", "--learn.batch_size", "2",
            "--learn.window", "8", "--out_dir", str(tmp_path / "out")]  # fmt: skip
    jsonargparse.CLI(finetune, args=argv)
    final = tmp_path / "out" / "final"
    assert (final / GATES_FILE).is_file() and (final / "learn_eviction.csv").read_text().count("\n") == 4
    model = load_model(final)
    assert model.eviction_gates is not None and model.eviction_gates.window == 8
    base_model = load_model(base)
    for (name, p), q in zip(model.state_dict().items(), base_model.state_dict().values(), strict=True):
        assert torch.equal(p, q), name  # the backbone is the base's
    with pytest.raises(ValueError, match="needs both --learn_eviction true and --kv_cache.policy learned"):
        jsonargparse.CLI(finetune, args=argv[:6] + ["--learn_eviction", "true", "--out_dir", str(tmp_path / "x")])
