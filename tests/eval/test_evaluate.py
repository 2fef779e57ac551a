"""litkv.eval.evaluate and litkv.eval.recall, checked against independent float64 references (tests/helpers.py)
and against the task builder of scripts/train_default_model.py."""

from __future__ import annotations

import importlib.util
import json
import math
import random
import sys
from pathlib import Path

import pytest
import torch
from helpers import chunked_last_recent_mask, reference_forward, tiny_gpt
from tiny_checkpoint import TEXT, make_tiny_checkpoint

from litkv.__main__ import main
from litkv.checkpoints.checkpoint import load_tokenizer
from litkv.cli.evaluate_cmd import evaluate, format_table, plot_results
from litkv.core.tokens import encode_plain
from litkv.eval.evaluate import (
    PolicyResult,
    cache_config,
    decode_speed,
    evaluate_policies,
    recall_accuracy,
    text_windows,
)
from litkv.eval.recall import MULTIKEY_WORDS, RecallExample, RecallFormat, RecallTask
from litkv.kvcache import known_policies
from litkv.kvcache.config import ChunkPlan, KVCacheConfig

REPO = Path(__file__).resolve().parents[2]
FORMAT = {
    "name": "passkey",
    "needle": "\nThe pass key is {key}. Remember it. {key} is the pass key.\n",
    "question": "\nWhat is the pass key? The pass key is",
    "answer": " {key}",
    "num_digits": 5,
    "digits": "0123456789",
    "first_digit_nonzero": True,
    "distinct_digits": True,
    "filler_file": "heldout.txt",
    "context_length": 96,
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ckpt")
    make_tiny_checkpoint(path, gates_seed=0)  # eviction gates: `--policies all` runs `learned` too
    (path / "recall_format.json").write_text(json.dumps(FORMAT))
    (path / "heldout.txt").write_text(TEXT * 3)
    return path


def test_text_windows() -> None:
    ids = torch.arange(100)
    w = text_windows(ids, 9, 4)
    assert w.shape == (4, 10) and w.dtype == torch.long
    assert w[0, 0] == 0 and w[-1, -1] == 99  # spread over the whole text
    assert all(bool((row[1:] - row[:-1] == 1).all()) for row in w)
    with pytest.raises(ValueError, match="fewer than 20 windows"):
        text_windows(ids, 9, 20)


def test_cache_config_clips_chunks_and_passes_storage_through() -> None:
    template = KVCacheConfig(chunk_size=64, prefill_length=128, cache_length=1024)
    cfg = cache_config(template, "h2o", 32, {"sinks": 4})
    assert (cfg.policy, cfg.cache_length, cfg.chunk_size, cfg.prefill_length) == ("h2o", 32, 32, 32)
    assert cfg.policy_options.sinks == 4 and template.options == {}
    assert cache_config(template, "qh2o", 64).storage == "float"  # qh2o switches to int4 itself
    assert cache_config(KVCacheConfig(storage="int8"), "qh2o", 64).storage == "int8"
    with pytest.raises(ValueError, match="unknown KV cache policy 'nope'"):
        cache_config(template, "nope", 64)
    with pytest.raises(ValueError, match="has no option 'bogus'"):
        cache_config(template, "h2o", 64, {"bogus": 1})


def test_template_with_policy_options_is_refused() -> None:
    model = tiny_gpt(3, config="pythia-14m")
    template = KVCacheConfig(policy="h2o", options={"sinks": 4})
    with pytest.raises(ValueError, match="must not hold policy options.*--policy_options"):
        evaluate_policies(model, torch.zeros(1, 17, dtype=torch.long), ["h2o"], [8], template=template)
    with pytest.raises(ValueError, match="must not hold policy options"):
        cache_config(template, "h2o", 8)


def test_policy_options_apply_to_their_policy_only() -> None:
    model = tiny_gpt(3, config="pythia-14m")
    torch.manual_seed(0)
    windows = torch.randint(0, 128, (2, 41))
    run = dict(template=KVCacheConfig(chunk_size=8), batch_size=2)
    plain = evaluate_policies(model, windows, ["last-recent", "h2o"], [16], **run)
    sinks = evaluate_policies(
        model, windows, ["last-recent", "h2o"], [16], policy_options={"last-recent": {"sinks": 4}}, **run
    )
    assert sinks[1].perplexity != pytest.approx(plain[1].perplexity, rel=1e-6)  # last-recent changed
    assert sinks[2].perplexity == pytest.approx(plain[2].perplexity, rel=1e-6)  # h2o did not
    assert sinks[0].perplexity == pytest.approx(plain[0].perplexity, rel=1e-6)  # nor dense
    with pytest.raises(ValueError, match=r"names policies \['tova'\] that are not evaluated"):
        evaluate_policies(model, windows, ["h2o"], [16], policy_options={"tova": {}}, **run)
    with pytest.raises(ValueError, match="'h2o' has no option 'window'"):
        evaluate_policies(model, windows, ["h2o"], [16], policy_options={"h2o": {"window": 3}}, **run)


def test_decode_speed_is_positive_and_checked() -> None:
    model = tiny_gpt(3, config="pythia-14m")
    windows = torch.randint(0, 128, (1, 33))
    res = evaluate_policies(model, windows, ["h2o"], [8], template=KVCacheConfig(chunk_size=8), decode_tokens=4)
    assert all(r.decode_tps > 0 and math.isfinite(r.decode_tps) for r in res)
    assert all(math.isnan(r.decode_tps) for r in evaluate_policies(model, windows, ["h2o"], [8]))
    with pytest.raises(ValueError, match="decode_tokens must be 0 .* or an int >= 2, got 1"):
        evaluate_policies(model, windows, ["h2o"], [8], decode_tokens=1)
    with pytest.raises(ValueError, match="new_tokens must be an int >= 2"):
        decode_speed(model, windows[0], KVCacheConfig(cache_length=64), 1)


def _metrics(logits: torch.Tensor, ref: torch.Tensor, targets: torch.Tensor) -> tuple[float, float, float]:
    """Perplexity, mean KL(ref || logits), top-1 agreement, written out with plain formulas."""
    p_ref = torch.softmax(ref.double(), -1)
    logp = torch.log_softmax(logits.double(), -1)
    nll = -logp.gather(-1, targets[..., None]).mean()
    kl = (p_ref * (torch.log(p_ref) - logp)).sum(-1).mean()
    top1 = (logits.argmax(-1) == ref.argmax(-1)).double().mean()
    return math.exp(float(nll)), float(kl), float(top1)


def test_quality_metrics_match_float64_reference() -> None:
    model = tiny_gpt(3, config="pythia-14m")
    torch.manual_seed(0)
    windows = torch.randint(0, 128, (3, 41))
    template = KVCacheConfig(chunk_size=8)
    results = evaluate_policies(model, windows, ["dense", "last-recent"], [16, 64], template=template, batch_size=2)
    assert [(r.policy, r.cache_length) for r in results] == [("dense", 40), ("last-recent", 16), ("last-recent", 64)]
    inputs, targets = windows[:, :-1], windows[:, 1:]
    starts = [s for s, _ in ChunkPlan.of(cache_config(template, "last-recent", 16)).bounds(40)]
    with torch.no_grad():
        dense = reference_forward(model, inputs).logits
        evicting = reference_forward(model, inputs, chunked_last_recent_mask(16, 0, starts)).logits
    for res, logits in zip(results, (dense, evicting, dense), strict=True):
        ppl, kl, top1 = _metrics(logits, dense, targets)
        assert res.perplexity == pytest.approx(ppl, rel=1e-4)
        assert res.kl == pytest.approx(kl, rel=1e-3, abs=1e-6)
        assert res.top1 == pytest.approx(top1, abs=1e-9)
    assert results[1].kl > 1e-3 and results[1].top1 < 1.0  # eviction shows
    assert results[0].kl == pytest.approx(0.0, abs=1e-6) and results[0].top1 == 1.0
    bytes_per_slot = 2 * 2 * model.config.n_query_groups * model.config.head_size * 4  # layers, K+V, fp32
    assert results[1].cache_bytes == 16 * bytes_per_slot


def _greedy(model: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    """Greedy continuation with plain full forward passes (no cache)."""
    ids = list(ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[-n:]


def test_recall_accuracy_scores_greedy_answers() -> None:
    model = tiny_gpt(1, config="pythia-14m")
    rng = random.Random(0)
    examples = []
    for i in range(6):
        prompt = [rng.randrange(128) for _ in range(20 + i)]
        answer = _greedy(model, prompt, 3)
        if i % 2:  # a wrong last digit must fail the example
            answer[-1] = (answer[-1] + 1) % 128
        examples.append(RecallExample(prompt + answer, len(prompt), depth=float(i % 2), key=str(i)))
    acc = recall_accuracy(model, examples, KVCacheConfig(cache_length=64, chunk_size=8), batch_size=4)
    assert acc == {0.0: 1.0, 1.0: 0.0}


def test_recall_task_builds_the_documented_layout(ckpt: Path) -> None:
    tok = load_tokenizer(ckpt)
    task = RecallTask.from_checkpoint(ckpt, tok)
    examples = task.examples(96, [0.0, 0.5, 1.0], per_depth=2, seed=7)
    assert len(examples) == 6 and {e.depth for e in examples} == {0.0, 0.5, 1.0}
    for ex in examples:
        assert len(ex.ids) == 96 and len(set(ex.key)) == 5 and ex.key[0] != "0"
        assert ex.answer == encode_plain(tok, f" {ex.key}")
        assert tok.decode(torch.tensor(ex.ids)).endswith(f"What is the pass key? The pass key is {ex.key}")
        needle = encode_plain(tok, FORMAT["needle"].format(key=ex.key))
        at = next(i for i in range(len(ex.ids)) if ex.ids[i : i + len(needle)] == needle)
        n_fill = 96 - len(needle) - len(task.question_ids) - len(ex.answer)
        assert at == round(ex.depth * n_fill)
    assert examples == task.examples(96, [0.0, 0.5, 1.0], per_depth=2, seed=7)  # seeded
    with pytest.raises(ValueError, match="depth must be in"):
        task.make_example(task.filler_ids, 96, 1.5, "12345")


def _training_script(monkeypatch: pytest.MonkeyPatch):
    script = REPO / "scripts" / "train_default_model.py"
    spec = importlib.util.spec_from_file_location("train_default_model", script)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def test_training_script_rows_are_the_recall_task(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default model's training rows are litkv.eval.recall's pass-key task (the one `litkv evaluate`
    scores), read back from the decoded text, and its copy rows repeat one digit string."""
    module = _training_script(monkeypatch)
    tok = load_tokenizer(ckpt)
    task = module.recall_task(tok.processor)
    data = torch.tensor(encode_plain(tok, TEXT * 4))
    rng = random.Random(3)
    for _ in range(6):
        ids, targets = module.sample_row(tok.processor, task, data, 150, (1.0, 0.0), rng)
        text = tok.decode(torch.tensor(ids))
        key = text.rsplit("The pass key is ", 1)[1]
        assert len(ids) == 151 and len(set(key)) == 5 and key[0] != "0"
        assert f"The pass key is {key}. Remember it. {key} is the pass key." in text
        assert text.endswith(f"What is the pass key? The pass key is {key}")
        assert [ids[t] for t in targets] == encode_plain(tok, f" {key}")
    for _ in range(6):
        ids, targets = module.sample_row(tok.processor, task, data, 150, (0.0, 1.0), rng)
        copied = tok.decode(torch.tensor([ids[targets[0] - 1]] + [ids[t] for t in targets]))
        assert len(ids) == 151 and copied.strip().isdigit() and 5 <= len(copied.strip()) <= 10
        assert tok.decode(torch.tensor(ids)).count(copied) == 2


def test_recall_format_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="lacks the fields"):
        RecallFormat.from_dict({"needle": "{key}"})
    with pytest.raises(ValueError, match="'answer' must contain"):
        RecallFormat.from_dict({**FORMAT, "answer": "no key"})
    with pytest.raises(FileNotFoundError, match="does not exist"):
        RecallFormat.load(tmp_path / "recall_format.json")


def test_multikey_examples_hide_several_needles_and_ask_one(ckpt: Path) -> None:
    tok = load_tokenizer(ckpt)
    task = RecallTask.from_checkpoint(ckpt, tok)
    examples = task.multikey_examples(300, 6, num_keys=4, seed=3)
    assert len(examples) == 6 and examples == task.multikey_examples(300, 6, num_keys=4, seed=3)
    asked_words = set()
    for ex in examples:
        text = tok.decode(torch.tensor(ex.prompt))
        found = [
            (w, text.split(f"The pass key of {w} is ", 1)[1][:5]) for w in MULTIKEY_WORDS if f"key of {w} is " in text
        ]
        found = [(w, k) for w, k in found if f"The pass key of {w} is {k}." in text]
        assert len(found) == 4 and len({k for _, k in found}) == 4  # 4 needles, distinct keys
        assert text.count("What is the pass key") == 1 and text.endswith(
            f"What is the pass key of {ex.word}? The pass key of {ex.word} is"
        )
        assert (ex.word, ex.key) in found and len(ex.ids) == 300
        assert ex.answer == encode_plain(tok, f" {ex.key}")
        asked_words.add(ex.word)
    assert len(asked_words) > 1
    with pytest.raises(ValueError, match="asked must index one of the 1 needles"):
        task.make_multikey_example(task.filler_ids, 160, [(0.5, "apple", "12345")], 1)
    with pytest.raises(ValueError, match="num_keys must be in"):
        task.multikey_examples(160, 1, num_keys=0)
    with pytest.raises(ValueError, match="needles, question and answer take"):
        task.multikey_examples(60, 1, num_keys=4)


@pytest.mark.filterwarnings("ignore:policy 'qh2o' needs quantised storage")
def test_evaluate_command_writes_table_json_and_plot(ckpt: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    results = evaluate(
        ckpt,
        budgets=[16, 32],
        num_windows=2,
        recall_depths=[0.0, 1.0],
        recall_cases=2,
        multikey_cases=2,
        multikey_keys=1,
        decode_tokens=4,
        out_dir=out,
        device="cpu",
    )
    assert [(r.policy, r.cache_length) for r in results][:3] == [
        ("dense", 96),
        ("last-recent", 16),
        ("last-recent", 32),
    ]
    assert {r.policy for r in results} == {"dense", "last-recent", "h2o", "qh2o"}
    printed = capsys.readouterr().out
    head = printed.splitlines()[0].split()
    assert head[:6] == ["policy", "budget", "cache", "MiB", "ppl", "KL"] and head[-2:] == ["multikey", "tok/s"]
    assert all(float(line.split()[-1]) > 0 for line in printed.splitlines()[1 : 1 + len(results)])
    assert "dense" in printed and "96 (full)" in printed and "rec@0" in printed and "shared CPU" in printed
    qh2o = next(r for r in results if r.policy == "qh2o" and r.cache_length == 16)
    h2o = next(r for r in results if r.policy == "h2o" and r.cache_length == 16)
    assert qh2o.cache_bytes <= h2o.cache_bytes / 4  # int4 storage, measured from the built caches
    data = json.loads((out / "evaluate.json").read_text())
    assert data["window"] == 96 and data["recall_examples"] == 4 and data["multikey_cases"] == 2
    assert data["torch_version"] == torch.__version__ and data["litkv_version"]
    assert isinstance(data["command"], str) and data["policies"] == ["last-recent", "h2o", "qh2o"]
    assert [r["policy"] for r in data["results"]] == [r.policy for r in results]
    assert set(data["results"][0]["recall"]) == {"0", "1"}
    assert all(r["decode_tps"] > 0 and 0 <= r["multikey"] <= 1 for r in data["results"])
    assert (out / "evaluate.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.filterwarnings("ignore:policy 'qh2o' needs quantised storage")
def test_evaluate_cli_all_policies_and_policy_options(ckpt: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    argv = ["evaluate", str(ckpt), "--policies", "all", "--budgets", "[16]", "--num_windows", "1"]
    argv += ["--recall_cases", "0", "--multikey_cases", "0", "--decode_tokens", "0", "--device", "cpu"]
    argv += ["--policy_options", '{"h2o": {"recent": 8}}', "--policy_options.last-recent.sinks", "4"]
    monkeypatch.setattr(sys, "orig_argv", ["python", "-m", "litkv", *argv])
    main([*argv, "--out_dir", str(tmp_path)])
    data = json.loads((tmp_path / "evaluate.json").read_text())
    continuous = [p for p in known_policies() if p != "kvzip"]  # kvzip runs on RULER tasks (--tasks) only
    assert data["policies"] == continuous and len(continuous) >= 9
    # dense first (the reference), then one budget of each other registered policy (other tests may have
    # registered example policies, which sort before "dense")
    expected = ["dense", *(p for p in continuous if p != "dense")]
    assert [r["policy"] for r in data["results"]] == expected
    assert data["policy_options"] == {"h2o": {"recent": 8}, "last-recent": {"sinks": 4}}
    assert data["command"].startswith("python -m litkv evaluate") and "'[16]'" in data["command"]
    assert "tok/s" not in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([*argv[:-4], "--policy_options", '{"h2o": 3}', "--out_dir", str(tmp_path)])
    assert "policy_options['h2o'] must be a dict" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*argv[:-4], "--multikey_cases", "-1", "--out_dir", str(tmp_path)])
    assert "multikey_cases must be an int >= 0 (0: skip that task), got -1" in capsys.readouterr().err


def test_format_table_and_plot_without_recall(tmp_path: Path) -> None:
    results = [PolicyResult("dense", 64, 10.0, 0.0, 1.0), PolicyResult("h2o", 16, 12.5, 0.25, 0.75)]
    table = format_table(results).splitlines()
    assert table[1].split() == ["dense", "64", "(full)", "0.00", "10.000", "0", "1.000"]
    assert table[2].split() == ["h2o", "16", "0.00", "12.500", "0.25", "0.750"]
    plot_results(results, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000
