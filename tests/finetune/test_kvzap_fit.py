"""The KVzap fit (litkv/finetune/kvzap_fit.py): the least squares of both inputs (key, hidden state) against a
float64 brute-force `lstsq` with the ridge rows written out, on the log KVzip+ scores of a float64 brute-force
reconstruction pass; the sums saved and resumed equal one pass; the per-head affine calibration against a
brute-force solve; Spearman (per head, pooled) against a brute force with ties; gates on one scale marked so."""

from __future__ import annotations

import math
from itertools import pairwise

import pytest
import torch
from helpers import random_tokens, tiny_config, tiny_gpt
from kvzip_reference import brute_scores

from litkv.checkpoints.checkpoint import save_gates
from litkv.finetune.kvzap_fit import (
    KVzapSums,
    affine_calibration,
    calibrated,
    hidden_logits,
    scale_report,
    spearman,
)
from litkv.finetune.kvzip_target import FLOOR, kvzip_records
from litkv.finetune.lstsq import RIDGE
from litkv.gates.gate import EvictionGates
from litkv.inference.kvzip_reconstruction import RepeatPrompt
from litkv.kvcache.learned import _gate_hidden

CONFIG = tiny_config("pythia-14m", n_layer=2, n_head=4, n_query_groups=2, rotary_percentage=0.5)
REPEAT = RepeatPrompt(first=(5, 6, 7), later=(8, 9), suffix=(10, 11))
T, SINKS = 20, 2


def ridge_lstsq(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """`argmin |x theta - y|^2 + RIDGE * mean(diag(x^T x)) |theta|^2` by `lstsq` on the stacked rows."""
    rows = math.sqrt(RIDGE * float((x * x).sum(0).mean())) * torch.eye(x.shape[1], dtype=torch.float64)
    return torch.linalg.lstsq(torch.cat([x, rows]), torch.cat([y, torch.zeros(x.shape[1], dtype=torch.float64)]))[0]


def attention_inputs(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Per layer the attention's input `(B, T, C)` of a plain forward pass (no cache)."""
    store: dict[int, torch.Tensor] = {}
    hooks = [
        block.attn.register_forward_pre_hook(lambda m, a, i=i: store.__setitem__(i, a[0].detach()))
        for i, block in enumerate(model.transformer.h)
    ]
    try:
        model(ids)
    finally:
        for hook in hooks:
            hook.remove()
    return [store[i] for i in range(len(hooks))]


@pytest.mark.slow
def test_fit_on_kvzip_target_equals_brute_force_for_keys_and_hidden_states():
    model = tiny_gpt(3, torch.float64, config=CONFIG)
    c = model.config
    windows = random_tokens(3, T, seed=11)
    sums = KVzapSums(c.n_layer, c.n_query_groups, c.head_size, c.n_embd)
    xs: dict[tuple[str, int, int], list] = {}
    for ids in windows:
        hidden: list[torch.Tensor] = []
        recs = kvzip_records(model, ids[None], REPEAT, hidden=hidden)
        target = torch.log(brute_scores(model, ids.tolist(), True, REPEAT, 0, 4, 2048).clamp_min(FLOOR))  # (L, G, T)
        plain = attention_inputs(model, ids[None])
        for layer, ((k, y), h) in enumerate(zip(recs, hidden, strict=True)):
            torch.testing.assert_close(
                y[0], target[layer], rtol=1e-6, atol=1e-6
            )  # the KVzap target (scores kept in float32)
            torch.testing.assert_close(h, plain[layer], rtol=1e-9, atol=1e-9)  # KVzap's input
            sums.add(layer, k[:, :, SINKS:], h[:, SINKS:], y[:, :, SINKS:])
            for g in range(c.n_query_groups):
                xk = torch.cat([k[0, g, SINKS:] / math.sqrt(c.head_size), torch.ones(T - SINKS, 1)], -1)
                xh = torch.cat([plain[layer][0, SINKS:] / math.sqrt(c.n_embd), torch.ones(T - SINKS, 1)], -1)
                for name, x in (("key", xk), ("hidden", xh)):
                    xs.setdefault((name, layer, g), []).append((x, target[layer, g, SINKS:]))
    weight, bias = sums.keys.solve()
    hw, hb = sums.solve_hidden()
    for (name, layer, g), parts in xs.items():
        theta = ridge_lstsq(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))
        if name == "key":
            got = torch.cat([weight[layer, g], bias[layer, g, None]])
        else:
            got = torch.cat([hw[layer, g] * math.sqrt(c.n_embd), hb[layer, g, None]])
        torch.testing.assert_close(got, theta, rtol=1e-5, atol=1e-5 * float(theta.abs().max()))
    # the hidden surrogate's logits are its linear map of the hidden state
    h = attention_inputs(model, windows[:1])[1]
    want = torch.einsum("btc,gc->bgt", h, hw[1]) + hb[1][None, :, None]
    torch.testing.assert_close(hidden_logits(hw, hb, 1, h), want)
    # the gates written for `learned` (`hidden_gates`: the weight rescaled to `x . w / sqrt(C) + b`) give those
    # logits when the policy computes them (float32 gates)
    gates = sums.hidden_gates(window=2, sinks=SINKS)
    assert gates.input == "hidden" and gates.one_scale
    got = _gate_hidden(gates.weight[1:2], gates.bias[1:2], h[:, None])[:, 0]
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def _random_sums(seed: int, windows: list[int]) -> KVzapSums:
    sums = KVzapSums(2, 3, 4, 5)
    for w in windows:
        g = torch.Generator().manual_seed(seed * 1000 + w)
        for layer in range(2):
            k, h = torch.randn(1, 3, 9, 4, generator=g), torch.randn(1, 9, 5, generator=g)
            sums.add(layer, k, h, torch.randn(1, 3, 9, generator=g))
        sums.windows.append(w)
    return sums


def test_sums_saved_and_resumed_equal_one_pass(tmp_path):
    whole = _random_sums(1, [0, 1, 2, 3])
    first = _random_sums(1, [0, 1])
    first.save(tmp_path / "sums.safetensors")
    resumed = KVzapSums.load(tmp_path / "sums.safetensors")
    for w in (2, 3):  # what the next session adds
        g = torch.Generator().manual_seed(1000 + w)
        for layer in range(2):
            k, h = torch.randn(1, 3, 9, 4, generator=g), torch.randn(1, 9, 5, generator=g)
            resumed.add(layer, k, h, torch.randn(1, 3, 9, generator=g))
        resumed.windows.append(w)
    assert resumed.windows == [0, 1, 2, 3]
    for a, b in ((whole.keys.solve(), resumed.keys.solve()), (whole.solve_hidden(), resumed.solve_hidden())):
        torch.testing.assert_close(a[0], b[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(a[1], b[1], rtol=1e-12, atol=1e-12)
    (tmp_path / "other.safetensors").write_bytes((tmp_path / "sums.safetensors").read_bytes()[:10])
    with pytest.raises(Exception):  # noqa: B017 (a truncated file is no state)
        KVzapSums.load(tmp_path / "other.safetensors")


def test_affine_calibration_equals_brute_force_and_puts_heads_on_one_scale():
    g = torch.Generator().manual_seed(0)
    y = torch.randn(3, 2, 400, generator=g, dtype=torch.float64)
    scale = torch.tensor([[0.2, 3.0], [1.0, 0.5], [7.0, 0.1]], dtype=torch.float64)
    shift = torch.tensor([[5.0, -2.0], [0.0, 9.0], [-4.0, 1.0]], dtype=torch.float64)
    z = scale[..., None] * (y + 0.3 * torch.randn(y.shape, generator=g, dtype=torch.float64)) + shift[..., None]
    a, c = affine_calibration(z, y)
    for i in range(3):
        for j in range(2):
            x = torch.stack([z[i, j], torch.ones(400, dtype=torch.float64)], -1)
            theta = torch.linalg.lstsq(x, y[i, j]).solution
            torch.testing.assert_close(torch.stack([a[i, j], c[i, j]]), theta, rtol=1e-9, atol=1e-9)
    before, after = scale_report(z, y), scale_report(a[..., None] * z + c[..., None], y)
    assert after["per_head"] == pytest.approx(before["per_head"])  # an increasing map keeps each head's ranks
    assert before["pooled"] < 0.5 < 0.9 < after["pooled"]  # but puts the heads on one scale
    gates = EvictionGates(torch.randn(3, 2, 4, generator=g), torch.randn(3, 2, generator=g), 2, 1, target="kvzip")
    keys = torch.randn(1, 2, 7, 4, generator=g, dtype=torch.float64)
    cal = calibrated(gates, a, c)
    for layer in range(3):
        want = a[layer][None, :, None] * gates.logits(layer, keys) + c[layer][None, :, None]
        torch.testing.assert_close(cal.logits(layer, keys), want, rtol=1e-5, atol=1e-4)
    assert cal.target == "kvzip" and cal.one_scale
    flat = affine_calibration(torch.ones(1, 1, 5), torch.arange(5.0)[None, None])
    assert flat[0].item() == 0 and flat[1].item() == pytest.approx(2.0)  # constant logits: the mean


def _brute_spearman(x: list[float], y: list[float]) -> float:
    def ranks(v: list[float]) -> list[float]:
        return [sum(1 for w in v if w < u) + (sum(1 for w in v if w == u) + 1) / 2 for u in v]

    rx, ry = ranks(x), ranks(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    return cov / math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))


def test_spearman_equals_brute_force_with_ties():
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 6, (40,), generator=g).double()  # many ties
    y = x + torch.randint(0, 4, (40,), generator=g).double()
    assert spearman(x, y) == pytest.approx(_brute_spearman(x.tolist(), y.tolist()), abs=1e-12)
    z = torch.randn(30, generator=g, dtype=torch.float64)
    assert spearman(z, z**3) == pytest.approx(1.0)
    assert all(a <= b for a, b in pairwise(sorted([spearman(z, -z), 0.0, spearman(z, z)])))


def test_one_scale_gates_keep_their_target_in_the_file(tmp_path):
    gates = EvictionGates.create(2, 3, 4, 8, 2)
    assert not gates.one_scale
    gates.target = "kvzip"
    save_gates(gates, tmp_path / "g.safetensors")
    back = EvictionGates.load(tmp_path / "g.safetensors")
    assert back.target == "kvzip" and back.one_scale and back.to("cpu").one_scale
    with pytest.raises(ValueError, match="target must be a str"):
        EvictionGates.create(2, 3, 4, 8, 2).__class__(gates.weight, gates.bias, 8, 2, None, 3)  # type: ignore[arg-type]


def test_held_out_split_and_hidden_error_equal_brute_force():
    """`minus` leaves the sums of the later windows alone; `hidden_mse` is the mean over heads of each head's
    mean squared error of `x . w + b`, written out token by token."""
    whole, first, later = _random_sums(2, [0, 1, 2]), _random_sums(2, [0]), _random_sums(2, [1, 2])
    split = whole.minus(first)
    assert split.windows == [1, 2]
    torch.testing.assert_close(split.hxtx, later.hxtx, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(split.keys.xty, later.keys.xty, rtol=1e-12, atol=1e-12)
    weight, bias = first.solve_hidden()
    errors = torch.zeros(2, 3, dtype=torch.float64)
    for w in (1, 2):
        g = torch.Generator().manual_seed(2000 + w)
        for layer in range(2):
            torch.randn(1, 3, 9, 4, generator=g)  # the keys, as _random_sums draws them
            h, y = torch.randn(1, 9, 5, generator=g), torch.randn(1, 3, 9, generator=g)
            pred = torch.einsum("bnc,gc->bgn", h.double(), weight[layer]) + bias[layer][None, :, None]
            errors[layer] += ((pred - y.double()) ** 2).sum(dim=(0, 2))
    assert split.hidden_mse(weight, bias) == pytest.approx(float((errors / 18).mean()), rel=1e-9)
    with pytest.raises(ValueError, match="not a prefix"):
        first.minus(whole)
