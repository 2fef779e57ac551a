"""Evaluation that prefills once (`litkv.eval.oneshot`): the answers of every (one-shot policy, budget)
from one prefill per batch equal those of a separate run per (policy, budget), whether the whole prompt is
compressed or the context alone (the question fed after it, uncompressed, as kvpress's pipeline)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_checkpoint import TEXT, make_tiny_checkpoint

from litkv.checkpoints.checkpoint import load_model, load_tokenizer
from litkv.eval.evaluate import cache_config, evaluate_policies, evaluate_ruler, ruler_score
from litkv.eval.oneshot import is_one_shot, oneshot_answers
from litkv.eval.ruler import FALLBACK_WORDS, generate_samples
from litkv.inference.generate import decode_greedy, generate, pad_prompts
from litkv.inference.kvzip_reconstruction import RepeatPrompt, kvzip_compress
from litkv.kvcache.config import ChunkPlan, KVCacheConfig
from litkv.modeling.model import GPT
from litkv.modeling.runner import run_chunks

BUDGETS = (6, 12, 20)
NEW = 7
REPEAT = RepeatPrompt(first=(5, 6, 7), later=(8, 9), suffix=(10, 11), prefix_length=2, overlap=4)
TEMPLATE = KVCacheConfig(chunk_size=9)


def _prompts() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(12, 128, (n,), generator=gen) for n in (40, 33, 47)]


def _questions() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(12)
    return [torch.randint(12, 128, (n,), generator=gen) for n in (9, 13, 8)]


def _configs(policy: str, options: dict[str, Any], length: int) -> dict[int, KVCacheConfig]:
    opts = {**options, "mode": "one-shot"}
    return {b: cache_config(TEMPLATE, policy, length, {**opts, "budget": b}) for b in BUDGETS}


def _alone(
    model: GPT, prompts: list[torch.Tensor], cfg: KVCacheConfig, questions: list[torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """One (policy, budget) in its own run: `generate`, or prefill + compression (kvzip: its reconstruction
    pass) + decode; with `questions`, each row's context prefilled and compressed alone, then its question fed
    at the positions after it and the answer decoded (kvpress's pipeline), one row at a time."""
    if questions is None and cfg.policy != "kvzip":
        return generate(model, prompts, NEW, cfg)
    if questions is None:
        idx, pos = pad_prompts(prompts, torch.device("cpu"))
        with torch.inference_mode(), model.kv_caches_attached(cfg, len(prompts)):
            hidden = run_chunks(model, idx, pos, ChunkPlan.of(cfg), lm_head=False, last_only=True)
            kvzip_compress(model, prompts, REPEAT, REPEAT.prefix_length)
            return decode_greedy(model, hidden, pos[:, -1] + 1, NEW)
    out = []
    for context, question in zip(prompts, questions, strict=True):
        n, m = len(context), len(question)
        with torch.inference_mode(), model.kv_caches_attached(cfg, 1):
            run_chunks(model, context[None], torch.arange(n)[None], ChunkPlan.of(cfg), lm_head=False)
            if cfg.policy == "kvzip":
                kvzip_compress(model, [context], REPEAT, REPEAT.prefix_length)
            else:
                model.caches.end_prefill()
            at = torch.arange(n, n + m)[None]
            hidden = run_chunks(model, question[None], at, ChunkPlan.of(cfg), lm_head=False, last_only=True)
            out += decode_greedy(model, hidden, torch.tensor([n + m]), NEW)
    return out


CASES = [
    ("h2o", {"normalize_scores": True, "recent": 0}),
    ("snapkv", {"window": 4, "kernel": 3}),
    ("tova", {}),
    ("expected-attention", {"recent": 0}),
    ("kvzip", {}),
    ("kvzip", {"kvzip_plus": True, "layerwise": True, "chunk_size": 16}),
]


@pytest.mark.parametrize("compress", ["prompt", "context"])
@pytest.mark.parametrize(("policy", "options"), CASES, ids=[f"{p}-{i}" for i, (p, _) in enumerate(CASES)])
def test_shared_prefill_answers_equal_separate_runs(
    tiny_model, policy: str, options: dict[str, Any], compress: str
) -> None:
    model = tiny_model(9)
    prompts, questions = _prompts(), (_questions() if compress == "context" else None)
    whole = prompts if questions is None else [torch.cat(pq) for pq in zip(prompts, questions, strict=True)]
    length = max(len(p) for p in whole) + NEW
    configs = _configs(policy, options, length)
    seen: list[int] = []
    shared = oneshot_answers(model, prompts, NEW, configs, REPEAT, seen.append, questions)
    assert seen == list(BUDGETS)
    answers = {}
    for budget, cfg in configs.items():
        alone = _alone(model, prompts, cfg, questions)
        assert [a.tolist() for a in shared[budget]] == [a.tolist() for a in alone], (policy, budget)
        answers[budget] = [a.tolist() for a in alone]
    dense = generate(model, whole, NEW, KVCacheConfig("dense", cache_length=length, chunk_size=9))
    # the check is not empty: the budgets change what is kept, and some answer differs from dense's
    assert any(answers[b] != [d.tolist() for d in dense] for b in BUDGETS)


@pytest.mark.parametrize("policy", ["knorm", "tova", "kvzip"])
def test_context_only_keeps_every_question_token(tiny_model, policy: str) -> None:
    """Context-only compression at a budget smaller than the questions: after the question is fed, every
    layer, row and KV head holds every question position and at most `budget` context positions; the answers
    differ from those of the whole prompt compressed to the same budget (which evicts question tokens). With
    a budget as large as every context nothing is evicted and the answers are dense's (an independent run
    through a dense cache)."""
    model = tiny_model(9)
    prompts, questions = _prompts(), _questions()
    whole = [torch.cat(pq) for pq in zip(prompts, questions, strict=True)]
    length = max(len(p) for p in whole) + NEW
    budget = 6  # < every question (8..13 tokens)
    cfg = _configs(policy, {}, length)[budget]
    held: list[list[torch.Tensor]] = []

    def check(_: int) -> None:
        held.append([c.positions.clone() for c in model.caches.policy_caches])

    ctx_only = oneshot_answers(model, prompts, NEW, {budget: cfg}, REPEAT, check, questions)[budget]
    assert len(held) == 1
    for positions in held[0]:  # (B, G, L) of one layer, after the question's call (before the answer's)
        for row, (context, question) in enumerate(zip(prompts, questions, strict=True)):
            n, m = len(context), len(question)
            for head in positions[row]:
                kept = set(head[head >= 0].tolist())
                assert set(range(n, n + m)) <= kept, (policy, row)
                assert len({p for p in kept if p < n}) <= (budget if policy != "kvzip" else n)
    whole_prompt = oneshot_answers(model, whole, NEW, {budget: cfg}, REPEAT)[budget]
    assert [a.tolist() for a in ctx_only] != [a.tolist() for a in whole_prompt]
    big = max(len(p) for p in prompts)
    big_cfg = cache_config(TEMPLATE, policy, length, {"mode": "one-shot", "budget": big})
    everything = oneshot_answers(model, prompts, NEW, {big: big_cfg}, REPEAT, None, questions)[big]
    dense = generate(model, whole, NEW, KVCacheConfig("dense", cache_length=length, chunk_size=9))
    assert [a.tolist() for a in everything] == [d.tolist() for d in dense]


def test_is_one_shot_and_kvzip_outside_ruler_is_refused(tiny_model) -> None:
    assert is_one_shot("kvzip", None) and is_one_shot("h2o", {"mode": "one-shot"})
    assert not is_one_shot("h2o", {}) and not is_one_shot("kvzip", {"mode": "continuous"})
    windows = torch.randint(0, 128, (1, 33))
    with pytest.raises(ValueError, match="evaluate it on RULER tasks"):
        evaluate_policies(tiny_model(1), windows, ["kvzip"], [8])


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ckpt")
    make_tiny_checkpoint(path, block_size=512)
    (path / "heldout.txt").write_text(TEXT * 3)
    return path


def test_evaluate_ruler_one_shot_rows_equal_ruler_score_alone(ckpt: Path) -> None:
    tokenizer = load_tokenizer(ckpt)
    model: GPT = load_model(ckpt, device=torch.device("cpu"), dtype=torch.float32)
    rows = generate_samples(["niah_single_1"], tokenizer, FALLBACK_WORDS, 256, 3, seed=4)
    options = {"h2o": {"mode": "one-shot"}}
    template = KVCacheConfig(chunk_size=32)
    results = evaluate_ruler(
        model, tokenizer, rows, ["h2o", "last-recent"], [32, 64], template, 2, False, options, 256, None, "prompt"
    )
    assert [(r.policy, r.cache_length) for r in results] == [
        ("dense", 256),
        ("h2o", 32),
        ("h2o", 64),
        ("last-recent", 32),
        ("last-recent", 64),
    ]
    for r in results[1:3]:
        cfg = cache_config(template, "h2o", 256, {"mode": "one-shot", "budget": r.cache_length})
        assert r.scores["niah_single_1"] == ruler_score(model, tokenizer, rows["niah_single_1"], cfg, 2)


def test_evaluate_cli_runs_kvzip(ckpt: Path, tmp_path: Path) -> None:
    from litkv.__main__ import main
    from litkv.cli.evaluate_cmd import evaluate

    with pytest.raises(ValueError, match="oneshot_compress must be 'context'.*got 'question'"):
        evaluate(ckpt, tasks="niah_single_1", oneshot_compress="question", out_dir=tmp_path / "no")
    assert not (tmp_path / "no").exists()

    argv = ["evaluate", str(ckpt), "--tasks", "niah_single_1", "--policies", "[kvzip, h2o]", "--budgets", "[32, 64]"]
    main([*argv, "--task_samples", "2", "--device", "cpu", "--out_dir", str(tmp_path)])
    data = json.loads((tmp_path / "ruler.json").read_text())
    assert [(r["policy"], r["cache_length"]) for r in data["results"]][1:] == [
        ("kvzip", 32),
        ("kvzip", 64),
        ("h2o", 32),
        ("h2o", 64),
    ]
