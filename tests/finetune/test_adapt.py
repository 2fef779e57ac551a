"""The fine-tune-for-a-cache-budget recipe (`configs/adapt_*.yaml`, `scripts/adapt_to_budget.py`) on a
tiny model: the recall/copy data mix, exact gradients through the cache on that data, the policy's
loss going down, and the fine-tuned checkpoint loading in `litkv evaluate` and `litkv generate`.
"""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path

import jsonargparse
import pytest
import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import load_file
from tiny_checkpoint import TEXT

import litkv
from litkv.__main__ import main as litkv_main
from litkv.checkpoints.checkpoint import load_model, load_tokenizer
from litkv.cli.finetune_cmd import finetune
from litkv.core.tokens import encode_plain
from litkv.finetune.data import IGNORE_INDEX, DataArgs, collate, load_examples
from litkv.finetune.loop import chunked_loss_sum
from litkv.finetune.lora import LoRAArgs, apply_lora, mark_only_lora_as_trainable
from litkv.finetune.recall_data import copy_row, load_recall_task, mix_recall_rows, recall_row
from litkv.gradient import chunked_loss_backward
from litkv.kvcache.config import KVCacheConfig

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "configs" / "adapt_h2o_256.yaml"
SHIPPED_FORMAT = ROOT / "litkv" / "assets" / "default" / "recall_format.json"
SEQ, CACHE, CHUNK = 96, 24, 8
TOLERANCE = 1e-4  # as tests/gradient/test_chunked_backward.py


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt: Path) -> Path:
    """A tiny checkpoint with the shipped pass-key task (`recall_format.json` + `heldout.txt`)."""
    path = tiny_ckpt
    fmt = json.loads(SHIPPED_FORMAT.read_text())
    (path / "recall_format.json").write_text(json.dumps({**fmt, "context_length": SEQ}))  # short evaluations
    (path / "heldout.txt").write_text(TEXT[: len(TEXT) // 2])
    return path


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "train.txt"
    path.write_text(TEXT * 2)
    return path


def recipe_args(ckpt: Path, text: Path, out: Path, *extra: str) -> list[str]:
    """The shipped recipe, shrunk to the tiny model (sequence, cache and chunk lengths, steps)."""
    return ["--config", str(RECIPE), "--checkpoint_dir", str(ckpt), "--data.path", str(text),
            "--data.seq_length", str(SEQ), "--data.val_fraction", "0", "--kv_cache.cache_length", str(CACHE),
            "--kv_cache.chunk_size", str(CHUNK), "--train.warmup_steps", "0", "--out_dir", str(out),
            *extra]  # fmt: skip


def recipe_data(ckpt: Path, text: Path) -> tuple[list, KVCacheConfig]:
    """The recipe's examples (same data settings and seed as `litkv finetune`) and its cache."""
    raw = yaml.safe_load(RECIPE.read_text())
    data = DataArgs(**{**raw["data"], "path": text, "seq_length": SEQ, "val_fraction": 0.0})
    examples = load_examples(data, load_tokenizer(ckpt), seed=raw["seed"], checkpoint_dir=ckpt)
    kv = KVCacheConfig(**{**raw["kv_cache"], "cache_length": CACHE, "chunk_size": CHUNK})
    return examples, kv


def mean_loss(model: litkv.GPT, examples: list, kv: KVCacheConfig) -> float:
    """Mean cross-entropy per scored token of the chunked computation through `kv`."""
    total, count = 0.0, 0.0
    for i in range(0, len(examples), 4):
        loss, n = chunked_loss_sum(model, *collate(examples[i : i + 4]), kv)
        total, count = total + float(loss), count + float(n)
    return total / count


# -- data mix ---------------------------------------------------------------------------------------


def test_recall_and_copy_rows(ckpt):
    tokenizer = load_tokenizer(ckpt)
    task = load_recall_task(ckpt / "recall_format.json", tokenizer)
    window = encode_plain(tokenizer, TEXT)[: SEQ + 1]
    ids, targets = recall_row(task, window, 0.5, "48213")
    full = torch.cat([ids, targets[-1:]])
    answer = encode_plain(tokenizer, " 48213")
    scored = (targets != IGNORE_INDEX).nonzero().flatten()
    assert ids.shape == targets.shape == (SEQ,)
    assert full[-len(answer) :].tolist() == answer  # the answer closes the row ...
    assert scored.tolist() == list(range(SEQ - len(answer), SEQ))  # ... and is all that is scored
    assert torch.equal(targets[scored], full[scored + 1])
    needle = encode_plain(tokenizer, task.fmt.needle.format(key="48213"))
    assert any(full[i : i + len(needle)].tolist() == needle for i in range(SEQ))

    ids, targets = copy_row(tokenizer, window, random.Random(0))
    full = torch.cat([ids, targets[-1:]])
    scored = (targets != IGNORE_INDEX).nonzero().flatten()
    assert 4 <= scored.numel() <= 9 and torch.equal(targets[scored], full[scored + 1])
    copied = full[scored + 1].tolist()  # the predicted digits appear earlier in the row too
    assert any(full[i : i + len(copied)].tolist() == copied for i in range(int(scored[0])))


def test_mix_is_seeded_and_keeps_text_rows(ckpt, text):
    tokenizer = load_tokenizer(ckpt)
    plain = load_examples(DataArgs(path=text, seq_length=SEQ), tokenizer)
    task = load_recall_task(ckpt / "recall_format.json", tokenizer)
    a = mix_recall_rows(plain, task, 0.5, 0.25, seed=3)
    b = mix_recall_rows(plain, task, 0.5, 0.25, seed=3)
    assert all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b, strict=True))
    kinds = [int((t != IGNORE_INDEX).sum()) for _, t in a]
    assert SEQ in kinds and any(k < 12 for k in kinds)  # plain text rows and recall/copy rows
    assert all(torch.equal(p[0], m[0]) for p, m, k in zip(plain, a, kinds, strict=True) if k == SEQ)
    assert mix_recall_rows(plain, task, 0.0, 0.0, seed=3) == plain


def test_mix_errors(ckpt, text, tmp_path):
    with pytest.raises(ValueError, match=r"recall_share must be a number in \[0, 1\], got 1.5"):
        DataArgs(path=text, recall_share=1.5)
    with pytest.raises(ValueError, match=r"must be <= 1, got 0.75 \+ 0.5"):
        DataArgs(path=text, recall_share=0.75, copy_share=0.5)
    with pytest.raises(ValueError, match="apply to a text file"):
        DataArgs(path=tmp_path / "d.json", recall_share=0.5)
    with pytest.raises(FileNotFoundError, match="recall_format"):
        load_examples(DataArgs(path=text, seq_length=SEQ, recall_share=0.5), load_tokenizer(ckpt), 0, tmp_path)
    with pytest.raises(ValueError, match="cannot build a recall example of 20 tokens"):
        load_examples(DataArgs(path=text, seq_length=19, recall_share=1.0), load_tokenizer(ckpt), 0, ckpt)


# -- the recipe -------------------------------------------------------------------------------------


def recipe_model(ckpt: Path) -> litkv.GPT:
    """The tiny model set up as the recipe trains it (`mode`, LoRA adapters), adapters made non-zero."""
    raw = yaml.safe_load(RECIPE.read_text())
    model = load_model(ckpt).train()
    if raw["mode"] == "full":
        return model.requires_grad_(True)
    apply_lora(model, LoRAArgs(**raw["lora"]))
    mark_only_lora_as_trainable(model)
    torch.manual_seed(0)
    with torch.no_grad():  # a fresh lora_B is zero, which would leave lora_A without gradient
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(0, 0.05)
    return model


def test_recipe_gradients_equal_naive_autograd(ckpt, text):
    """On the recipe's own data (recall rows scored on the answer only), cache and trainable
    parameters, the engine's gradient of an optimizer step's micro-batches equals autograd through
    `forward_chunked`."""
    examples, kv = recipe_data(ckpt, text)
    batch = examples[:4]
    assert any(int((t != IGNORE_INDEX).sum()) < SEQ for _, t in batch)  # a recall or copy row is in it
    model = recipe_model(ckpt)
    for ids, targets in batch:  # micro-batch size 1, as in the recipe; loss averaged over the step
        chunked_loss_backward(model, ids[None], targets[None], kv, loss_scale=1 / len(batch))
    engine = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    for ids, targets in batch:
        logits = litkv.forward_chunked(model, ids[None], kv)
        (F.cross_entropy(logits.flatten(0, 1), targets, ignore_index=IGNORE_INDEX) / len(batch)).backward()
    naive = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert engine.keys() == naive.keys() and len(naive) > 0
    for name, grad in naive.items():
        scale = grad.abs().max()
        assert scale > 0, name
        assert float((engine[name] - grad).abs().max() / scale) <= TOLERANCE, name
    with torch.no_grad():  # and the cache does evict: the result differs from a dense cache's
        dense = KVCacheConfig(cache_length=SEQ, chunk_size=CHUNK)
        ids = batch[0][0][None]
        assert not torch.allclose(litkv.forward_chunked(model, ids, dense), litkv.forward_chunked(model, ids, kv))


@pytest.mark.slow
def test_recipe_lowers_the_policy_loss(ckpt, text, tmp_path):
    examples, kv = recipe_data(ckpt, text)
    before = mean_loss(load_model(ckpt), examples, kv)
    jsonargparse.CLI(finetune, args=recipe_args(ckpt, text, tmp_path, "--train.max_steps", "6", "--train.lr", "0.02"))
    after = mean_loss(load_model(tmp_path / "final"), examples, kv)
    assert after < before - 0.05, (before, after)  # measured: 5.968 -> 5.863


@pytest.mark.slow
def test_adapted_lora_checkpoint_loads_in_evaluate_and_generate(ckpt, text, tmp_path, capsys):
    out = tmp_path / "run"
    jsonargparse.CLI(finetune, args=recipe_args(ckpt, text, out, "--mode", "lora", "--train.max_steps", "1"))
    final = out / "final"
    assert (final / "lora.safetensors").is_file()
    assert (final / "recall_format.json").read_text() == (ckpt / "recall_format.json").read_text()
    assert (final / "heldout.txt").read_text() == (ckpt / "heldout.txt").read_text()
    base, merged = load_file(str(ckpt / "model.safetensors")), load_file(str(final / "model.safetensors"))
    assert any(not torch.equal(base[k], merged[k]) for k in base)  # adapters merged into the weights
    litkv_main(["evaluate", str(final), "--policies", "h2o", "--budgets", f"[{CACHE}]", "--kv_cache.chunk_size",
                str(CHUNK), "--num_windows", "1", "--recall_cases", "1", "--multikey_cases", "0",
                "--decode_tokens", "0", "--out_dir", str(tmp_path / "eval")])  # fmt: skip
    report = json.loads((tmp_path / "eval" / "evaluate.json").read_text())
    assert report["recall_examples"] == 5 and [r["policy"] for r in report["results"]] == ["dense", "h2o"]
    assert all(r["recall"] for r in report["results"])  # recall measured on the adapted checkpoint
    capsys.readouterr()
    litkv_main(["generate", str(final), "--prompt", "The quick", "--max_new_tokens", "4", "--kv-cache", "h2o",
                "--kv_cache.cache_length", str(CACHE), "--kv_cache.chunk_size", str(CHUNK)])  # fmt: skip
    captured = capsys.readouterr()
    assert "The quick" in captured.err and "The quick" not in captured.out and captured.out.endswith("\n")


# -- the script -------------------------------------------------------------------------------------


def _script():
    spec = importlib.util.spec_from_file_location("adapt_to_budget", ROOT / "scripts" / "adapt_to_budget.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_script_end_to_end(ckpt, text, tmp_path, capsys):
    raw = yaml.safe_load(RECIPE.read_text())
    raw["data"].update(seq_length=SEQ, val_fraction=0.0)
    raw["kv_cache"].update(cache_length=CACHE, chunk_size=CHUNK)
    raw["train"].update(warmup_steps=0, lr=0.003)
    config = tmp_path / "adapt.yaml"
    config.write_text(yaml.safe_dump(raw))
    script = _script()
    script.main(["--config", str(config), "--checkpoint_dir", str(ckpt), "--text", str(text), "--max_steps", "2",
                 "--out_dir", str(tmp_path / "out"), "--tag", "t", "--recall_cases", "1", "--num_windows", "1",
                 "--skip_control"])  # fmt: skip
    report = json.loads((tmp_path / "out" / "t" / "adapt.json").read_text())
    assert list(report["models"]) == ["shipped", "adapted"] and report["models"]["adapted"]["steps"] == 2
    assert all(0 <= m["recall"] <= 1 and m["dense_recall"] >= 0 for m in report["models"].values())
    kept = report["models"]["shipped"]["digits_kept"]  # key digit tokens held per layer, per needle depth
    assert list(kept) == ["0", "0.25", "0.5", "0.75"] and all(len(v) == 2 for v in kept.values())
    assert all(0 <= x <= 10 for v in kept.values() for x in v)  # of the 2 x 5 digit tokens
    assert (tmp_path / "out" / "t" / "adapt.png").stat().st_size > 0
    hparams = yaml.safe_load((tmp_path / "out" / "t" / "policy" / "final" / "hyperparameters.yaml").read_text())
    assert hparams["kv_cache"]["policy"] == "h2o" and hparams["train"]["max_steps"] == 2
    printed = capsys.readouterr().out
    assert "adapted" in printed and "KL(dense || policy) fall" in printed
    script.main(["--plot_from", str(tmp_path / "out" / "t" / "adapt.json"), "--plot_out", str(tmp_path / "all.png")])
    assert (tmp_path / "all.png").stat().st_size > 0


def test_script_control_and_targets(tmp_path):
    script = _script()
    args = script.parse_args(["--config", str(RECIPE), "--max_steps", "7", "--lr", "0.002"])
    config = script.load_config(RECIPE)
    argv = script.finetune_argv(args, config, tmp_path / "t.txt", tmp_path / "c", dense=True)
    parser = jsonargparse.ArgumentParser()
    parser.add_argument("--config", action="config")
    parser.add_function_arguments(finetune)
    control = parser.parse_args(argv)
    assert (control.kv_cache.policy, control.kv_cache.cache_length, control.kv_cache.options) == ("dense", 1024, {})
    assert control.kv_cache.chunk_size == config["kv_cache"]["chunk_size"] and control.mode == config["mode"]
    assert (control.train.max_steps, control.train.lr) == (7, 0.002)
    assert control.train.min_lr == pytest.approx(0.002 * config["train"]["min_lr"] / config["train"]["lr"])
    base = {"recall": 0.2, "kl": 0.01, "dense_ppl": 30.0}
    adapted = {"recall": 0.6, "kl": 0.006, "dense_ppl": 31.0}
    verdict = script.assess(base, adapted, {"recall": 0.3, "kl": 0.009, "dense_ppl": 30.0})
    assert verdict["adapted"]["recall_gain"] == pytest.approx(0.4) and verdict["adapted"]["kl_fall"] == pytest.approx(
        0.4
    )
    assert verdict["met"] == {
        "recall_gain": True,
        "kl_fall": True,
        "dense_ppl_change": True,
        "control_gains_less": True,
    }
    verdict = script.assess(base, {**adapted, "dense_ppl": 31.6}, {"recall": 0.5, "kl": 0.009, "dense_ppl": 30.0})
    assert not verdict["met"]["dense_ppl_change"] and not verdict["met"]["control_gains_less"]


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("adapt_*.yaml")), ids=lambda p: p.name)
def test_shipped_recipes_parse_and_keep_heldout_out(path):
    parser = jsonargparse.ArgumentParser()
    parser.add_argument("--config", action="config")
    parser.add_function_arguments(finetune)
    cfg = parser.parse_args(["--config", str(path)])
    policy, budget = path.stem.split("_")[1:]
    assert (cfg.kv_cache.policy, cfg.kv_cache.cache_length, cfg.kv_cache.chunk_size) == (policy, int(budget), 64)
    assert cfg.data.seq_length == 1024 and cfg.data.recall_share == 0.5 and cfg.data.copy_share == 0.25
    assert Path(cfg.data.path).name != "heldout.txt"  # the evaluation text is never trained on
