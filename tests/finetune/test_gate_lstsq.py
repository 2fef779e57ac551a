"""`--learn.method lstsq`: the closed-form gates equal a brute-force ridge least-squares solve of the
`regress` objective on the same tokens (keys taken straight from the qkv projection), they minimise the
objective (Adam on it never does better), and `litkv finetune` writes gates `load_model` accepts."""

from __future__ import annotations

import jsonargparse
import pytest
import torch
from helpers import random_tokens, tiny_config, tiny_gpt
from kvzip_reference import brute_scores

from litkv.finetune.gate_training import GateTrainArgs, attention_mass, batch_indices, evictable, train_gates
from litkv.finetune.kvzip_target import FLOOR
from litkv.finetune.lstsq import RIDGE, NormalEquations, fit_gates_lstsq
from litkv.inference.kvzip_reconstruction import RepeatPrompt

CONFIG = tiny_config("pythia-14m", n_layer=2, n_head=4, n_query_groups=2, rotary_percentage=0.5)
T, WINDOW, SINKS = 24, 3, 1
REPEAT = RepeatPrompt(first=(5, 6, 7), later=(8, 9), suffix=(10, 11))


def examples(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    ids = random_tokens(n, T, seed=5)
    return [(row, row.clone()) for row in ids]


def attention_targets(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Per layer `(B, G, T)`: log of the largest far attention weight (the `attention` target)."""
    return [torch.log(mass.double() + 1e-4) for _, mass in attention_mass(model, ids, WINDOW)]


def kvzip_targets(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Per layer `(B, G, T)`: log KVzip+ scores of the float64 brute-force reconstruction pass."""
    rows = [brute_scores(model, row.tolist(), True, REPEAT, 0, 4, 2048) for row in ids]  # (L, G, T) each
    scores = torch.stack(rows, dim=1)  # (L, B, G, T)
    return list(torch.log(scores.clamp_min(FLOOR)))


def reference_solution(
    model, data, args: GateTrainArgs, targets=attention_targets
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (layer, KV head): stack every evictable token's `[k_pre / sqrt(D), 1]` (keys from the qkv
    projection of the normed input of each block, captured by hooks) and its target, append the ridge
    rows `sqrt(lambda * mean diag) * I`, and solve with `torch.linalg.lstsq`."""
    c = model.config
    hs, nh, g = c.head_size, c.n_head, c.n_query_groups
    rows: dict[tuple[int, int], list] = {}
    for step in range(args.steps):
        ids = torch.stack([data[i][0] for i in batch_indices(len(data), args.batch_size, args.seed, step)])
        keys: list[torch.Tensor] = []
        hooks = [
            block.attn.qkv.register_forward_hook(
                lambda m, i, out, keys=keys: keys.append(out[..., nh * hs : (nh + g) * hs])
            )
            for block in model.transformer.h
        ]
        try:
            model(ids)
        finally:
            for hook in hooks:
                hook.remove()
        goals = targets(model, ids)
        mask = evictable(T, args.window, args.sinks, ids.device)
        for layer, (k, goal) in enumerate(zip(keys, goals, strict=True)):
            k = k.detach().double().view(ids.shape[0], T, g, hs)
            for head in range(g):
                x = torch.cat([k[:, mask, head] / hs**0.5, torch.ones(ids.shape[0], int(mask.sum()), 1)], -1)
                y = goal[:, head, mask]
                rows.setdefault((layer, head), []).append((x.reshape(-1, hs + 1), y.reshape(-1)))
    weight = torch.zeros(c.n_layer, g, hs, dtype=torch.float64)
    bias = torch.zeros(c.n_layer, g, dtype=torch.float64)
    for (layer, head), parts in rows.items():
        x = torch.cat([p[0] for p in parts])
        y = torch.cat([p[1] for p in parts])
        ridge = (RIDGE * (x * x).sum(0).mean()) ** 0.5 * torch.eye(hs + 1, dtype=torch.float64)
        theta = torch.linalg.lstsq(torch.cat([x, ridge]), torch.cat([y, torch.zeros(hs + 1, dtype=torch.float64)]))
        weight[layer, head] = theta.solution[:-1]  # the logit k . w / sqrt(D) + b is x . [w; b]
        bias[layer, head] = theta.solution[-1]
    return weight, bias


def test_lstsq_gates_equal_brute_force_ridge_solution():
    model = tiny_gpt(1, torch.float64, config=CONFIG)
    data = examples(5)
    args = GateTrainArgs(method="lstsq", steps=3, batch_size=2, window=WINDOW, sinks=SINKS)
    gates, logs = fit_gates_lstsq(model, data, args)
    weight, bias = reference_solution(model, data, args)
    assert torch.allclose(gates.weight.double(), weight, rtol=1e-4, atol=1e-5 * float(weight.abs().max()))
    assert torch.allclose(gates.bias.double(), bias, rtol=1e-4, atol=1e-5)
    assert weight.abs().max() > 0.1  # a solution that is not the zero gate
    assert [log.step for log in logs] == [0, 1, 2] and all(log.fit > 0 for log in logs)


@pytest.mark.slow
def test_lstsq_kvzip_target_equals_brute_force_ridge_solution():
    """`--learn.target kvzip`: the gates regress log KVzip+ scores (KVzap); equal to the ridge solve on the
    scores of the float64 brute-force reconstruction pass."""
    model = tiny_gpt(3, torch.float64, config=CONFIG)
    data = examples(4)
    args = GateTrainArgs(method="lstsq", steps=2, batch_size=2, window=WINDOW, sinks=SINKS, target="kvzip")
    gates, _ = fit_gates_lstsq(model, data, args, repeat=REPEAT)
    weight, bias = reference_solution(model, data, args, kvzip_targets)
    assert torch.allclose(gates.weight.double(), weight, rtol=1e-4, atol=1e-4 * float(weight.abs().max()))
    assert torch.allclose(gates.bias.double(), bias, rtol=1e-4, atol=1e-4)
    attention, _ = reference_solution(model, data, args)  # another target gives other gates
    assert (weight - attention).abs().max() > 0.1 * weight.abs().max()
    with pytest.raises(ValueError, match="fitted by method 'lstsq' only"):
        GateTrainArgs(method="regress", target="kvzip")
    with pytest.raises(ValueError, match="target must be one of"):
        GateTrainArgs(method="lstsq", target="nope")


def test_lstsq_is_the_minimum_adam_approaches():
    """`regress` (Adam on the same MSE and the same batches) ends no lower than the closed form."""
    model = tiny_gpt(2, config=CONFIG)
    data = examples(4)
    args = GateTrainArgs(method="lstsq", steps=2, batch_size=2, window=WINDOW, sinks=SINKS)
    gates, _ = fit_gates_lstsq(model, data, args)
    sums = NormalEquations(CONFIG.n_layer, CONFIG.n_query_groups, CONFIG.head_size)
    for step in range(args.steps):
        ids = torch.stack([data[i][0] for i in batch_indices(len(data), 2, args.seed, step)])
        mask = evictable(T, WINDOW, SINKS, ids.device)
        for layer, (k, mass) in enumerate(attention_mass(model, ids, WINDOW)):
            sums.add(layer, k[:, :, mask], torch.log(mass[:, :, mask].double() + 1e-4))
    best = sums.mse(gates.weight.double(), gates.bias.double())
    adam_args = GateTrainArgs(method="regress", steps=60, batch_size=4, window=WINDOW, sinks=SINKS, lr=0.05)
    adam, _ = train_gates(model, data, adam_args)
    assert sums.mse(adam.weight.double(), adam.bias.double()) > best
    nudged = gates.weight.double() + 0.05 * torch.randn(gates.weight.shape, generator=torch.Generator().manual_seed(0))
    assert sums.mse(nudged, gates.bias.double()) > best


def test_finetune_lstsq_writes_loadable_gates_and_refuses_checkpoints(tmp_path):
    from test_finetune import write_text
    from tiny_checkpoint import make_tiny_checkpoint

    from litkv.checkpoints.checkpoint import load_model
    from litkv.cli.finetune_cmd import finetune

    base = tmp_path / "base"
    make_tiny_checkpoint(base)
    text = write_text(tmp_path / "train.txt", 3000)
    argv = ["--checkpoint_dir", str(base), "--data.path", str(text), "--data.seq_length", "48", "--learn_eviction",
            "true", "--kv_cache.policy", "learned", "--learn.method", "lstsq", "--learn.steps", "2",
            "--learn.batch_size", "2", "--learn.window", "8", "--out_dir", str(tmp_path / "out")]  # fmt: skip
    jsonargparse.CLI(finetune, args=argv)
    final = tmp_path / "out" / "final"
    model = load_model(final)
    assert model.eviction_gates is not None and model.eviction_gates.window == 8
    assert model.eviction_gates.weight.abs().max() > 0
    with pytest.raises(ValueError, match="checkpoint_interval must be 0, got 5"):
        jsonargparse.CLI(finetune, args=argv + ["--overwrite", "true", "--learn.checkpoint_interval", "5"])
    with pytest.raises(ValueError, match="cannot --resume"):
        jsonargparse.CLI(finetune, args=argv + ["--overwrite", "true", "--resume", str(final)])


def test_lstsq_gate_logits_are_the_fitted_prediction():
    """The gates' own logits `k_pre . w / sqrt(D) + b` on the training tokens have the in-sample error the fit
    reports (a solve whose weights were scaled apart from the objective's would rank a head's tokens alike but
    put the heads on other scales)."""
    model = tiny_gpt(4, torch.float64, config=CONFIG)
    data = examples(2)
    args = GateTrainArgs(method="lstsq", steps=1, batch_size=2, window=WINDOW, sinks=SINKS)
    gates, logs = fit_gates_lstsq(model, data, args)
    ids = torch.stack([data[i][0] for i in batch_indices(len(data), 2, args.seed, 0)])
    mask = evictable(T, WINDOW, SINKS, ids.device)
    errors = []
    for layer, (k, mass) in enumerate(attention_mass(model, ids, WINDOW)):
        logits = gates.logits(layer, k[:, :, mask].double())
        goal = torch.log(mass[:, :, mask].double() + 1e-4)
        errors.append(((logits - goal) ** 2).mean(dim=(0, 2)))
    assert float(torch.cat(errors).mean()) == pytest.approx(logs[-1].fit, rel=1e-4)
