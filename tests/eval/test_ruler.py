"""litkv.eval.ruler (offline RULER tasks): generators, scorers, evaluate_ruler and `litkv evaluate --tasks`."""

from __future__ import annotations

import json
import re
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_checkpoint import TEXT, make_tiny_checkpoint

from litkv.__main__ import main
from litkv.checkpoints.checkpoint import load_tokenizer
from litkv.core.tokens import encode_plain
from litkv.eval.evaluate import RulerResult, evaluate_ruler, ruler_score
from litkv.eval.recall import RecallFormat
from litkv.eval.ruler import (
    FALLBACK_WORDS,
    NOISE,
    TASKS,
    NiahFormat,
    RulerSample,
    generate_samples,
    resolve_tasks,
    string_match_all,
    string_match_part,
    word_list,
)
from litkv.eval.ruler_report import format_ruler_table, near_zero_tasks, needs_text
from litkv.kvcache.config import KVCacheConfig
from litkv.modeling.model import GPT

LENGTH = 800
RECALL = {
    "needle": "\nThe pass key is {key}. Remember it. {key} is the pass key.\n",
    "question": "\nWhat is the pass key? The pass key is",
    "answer": " {key}",
    "distinct_digits": True,
    "context_length": 256,
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ckpt")
    make_tiny_checkpoint(path, block_size=512)
    (path / "recall_format.json").write_text(json.dumps(RECALL))
    (path / "heldout.txt").write_text(TEXT * 3)
    return path


@pytest.fixture(scope="module")
def tokenizer(ckpt: Path) -> Any:
    return load_tokenizer(ckpt)


@pytest.fixture(scope="module")
def samples(tokenizer: Any) -> dict[str, list[RulerSample]]:
    return generate_samples(["ruler"], tokenizer, FALLBACK_WORDS, LENGTH, 3, seed=0)


def test_generators_are_deterministic_and_differ_across_seeds(tokenizer: Any, samples: dict) -> None:
    again = generate_samples(list(TASKS), tokenizer, FALLBACK_WORDS, LENGTH, 3, seed=0)
    other = generate_samples(["ruler"], tokenizer, FALLBACK_WORDS, LENGTH, 3, seed=1)
    assert list(samples) == list(TASKS)
    for task in TASKS:
        assert samples[task] == again[task]
        assert [s.prompt for s in samples[task]] != [s.prompt for s in other[task]], task
        assert len({s.prompt for s in samples[task]}) == 3, f"{task}: samples of one seed must differ"


def test_generated_lengths_fit_the_target(tokenizer: Any, samples: dict) -> None:
    for task, rows in samples.items():
        for s in rows:
            assert s.ids == encode_plain(tokenizer, s.prompt)
            assert s.max_new_tokens == TASKS[task].max_new_tokens
            total = len(s.ids) + s.max_new_tokens
            assert LENGTH - 80 < total <= LENGTH, f"{task}: {total} tokens for a target of {LENGTH}"
    short = generate_samples(["niah_single_2"], tokenizer, FALLBACK_WORDS, 256, 1)["niah_single_2"][0]
    assert len(short.ids) + short.max_new_tokens <= 256 < len(samples["niah_single_2"][0].ids)
    with pytest.raises(ValueError, match="does not fit in"):
        generate_samples(["vt"], tokenizer, FALLBACK_WORDS, 64, 1)


# kvpress's split of RULER's prompts (its benchmarks' dataset script): the question starts at these patterns
QUESTION_PATTERNS = {
    "niah": r"What (?:is|are all) the special magic",
    "vt": r"Question: Find all variables that are assigned the value",
    "cwe": r"Question: What are the 10 most common words in the above list\?",
    "fwe": r"Question: Do not provide any explanation\.",
}


def test_context_and_question_split_where_kvpress_splits(tokenizer: Any, samples: dict) -> None:
    """Each sample's ids are its context's then its question's, each tokenized alone, cut where kvpress's
    patterns find the question (the whitespace before it in the context)."""
    for task, rows in samples.items():
        for s in rows:
            found = list(re.finditer(QUESTION_PATTERNS[TASKS[task].kind], s.prompt))
            assert len(found) == 1, task
            at = found[0].start()
            assert s.ids[: s.context_length] == encode_plain(tokenizer, s.prompt[:at]), task
            assert s.ids[s.context_length :] == encode_plain(tokenizer, s.prompt[at:]), task
    with pytest.raises(ValueError, match="context_length must be in"):
        RulerSample("vt", "x", [1, 2], ["a"], 4, 2)


def _context(prompt: str) -> str:
    return prompt[: prompt.rindex("\nWhat")] if "\nWhat" in prompt else prompt[: prompt.index("\nQuestion:")]


def test_niah_answers_are_hidden_where_they_must_be(samples: dict) -> None:
    for task in ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multiquery"):
        spec = TASKS[task]
        for s in samples[task]:
            context, question = _context(s.prompt), s.prompt[len(_context(s.prompt)) :]
            needles = re.findall(r"One of the special magic numbers for (\w+) is: ([\w-]+)\.", context)
            assert len(needles) == spec.num_keys * spec.num_values
            assert len(s.references) == spec.num_queries * spec.num_values
            for ref in s.references:
                key = next(k for k, v in needles if v == ref)  # each answer is a needle's value ...
                assert key in question  # ... of a key the question asks for
            asked = [k for k, _ in needles if k in question.split("for ")[1]]
            assert len(set(asked)) == spec.num_queries
            pattern = r"^\d{7}$" if spec.value_type == "numbers" else r"^[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}$"
            assert all(re.match(pattern, v) for _, v in needles)
            if spec.haystack == "noise":
                assert context.count(NOISE) > 3
    for s in samples["niah_multivalue"]:
        key = re.search(r"numbers for (\w+) mentioned", s.prompt).group(1)
        assert sorted(s.references) == sorted(re.findall(rf"numbers for {key} is: (\d+)\.", s.prompt))


def test_vt_cwe_fwe_answers_follow_from_the_context(samples: dict) -> None:
    for s in samples["vt"]:
        value = re.search(r"assigned the value (\d+) in the text", s.prompt).group(1)
        chain = re.findall(r"VAR ([A-Z]{5}) = (VAR [A-Z]{5}|\d+)\.", s.prompt)
        assigned = {name: source for name, source in chain}
        assert assigned[s.references[0]] == value and len(s.references) == 5
        for prev, name in zip(s.references, s.references[1:], strict=False):
            assert assigned[name] == f"VAR {prev}"
    for s in samples["cwe"]:
        counts = Counter(re.findall(r"\d+\. (\w+)", _context(s.prompt)))
        assert len(s.references) == 10
        assert min(counts[w] for w in s.references) > max(c for w, c in counts.items() if w not in s.references)
    for s in samples["fwe"]:
        counts = Counter(_context(s.prompt).split("\n", 1)[1].split())
        top = sorted(counts.values(), reverse=True)[:3]
        assert [counts[w] for w in s.references] == top


def test_niah_format_from_the_checkpoint_recall_format(tokenizer: Any) -> None:
    fmt = NiahFormat.from_recall(RecallFormat.from_dict(RECALL))
    one = generate_samples(["niah_single_1"], tokenizer, FALLBACK_WORDS, LENGTH, 1, niah_format=fmt)
    s = one["niah_single_1"][0]
    key = s.references[0]
    assert f"The pass key is {key}. Remember it. {key} is the pass key." in s.prompt
    assert s.prompt.endswith("\nWhat is the pass key? The pass key is") and len(set(key)) == 5
    multi = generate_samples(["niah_multikey_1"], tokenizer, FALLBACK_WORDS, LENGTH, 1, niah_format=fmt)
    m = multi["niah_multikey_1"][0]
    assert len(re.findall(r"The pass key of \w+ is \d{5}\. Remember it\.", m.prompt)) == 4
    assert re.search(r"What is the pass key of (\w+)\? The pass key of \1 is$", m.prompt)
    with pytest.raises(ValueError, match=r"NiahFormat.needle must contain \['\{value\}'\]"):
        NiahFormat(needle="{key} only")


def test_scorers_on_hand_made_answers() -> None:
    refs = [["48213"], ["apple", "river", "stone"]]
    assert string_match_all([" 48213. Remember", "Apple, RIVER and stone"], refs) == 1.0  # exact, any case
    assert string_match_all([" 4821", "apple and river"], refs) == pytest.approx((0 + 2 / 3) / 2)  # partial
    assert string_match_all(["nothing", "nothing"], refs) == 0.0  # missing
    assert string_match_part([" 4821", "only river here"], refs) == 0.5  # any reference counts
    assert string_match_part(["48213", "STONE"], refs) == 1.0
    with pytest.raises(ValueError, match="need as many predictions as reference lists"):
        string_match_all(["a"], refs)
    with pytest.raises(ValueError, match="at least one reference"):
        string_match_part(["a"], [[]])


def test_resolve_tasks_and_word_list() -> None:
    assert resolve_tasks("ruler") == list(TASKS)
    assert resolve_tasks("vt, cwe,vt") == ["vt", "cwe"]
    with pytest.raises(ValueError, match=r"unknown RULER task\(s\) \['qa_1'\]"):
        resolve_tasks("vt,qa_1")
    assert word_list("tiny text") == list(FALLBACK_WORDS)
    text = " ".join(f"{w} the and" for w in FALLBACK_WORDS * 2) + " Zebra"
    assert word_list(text, skip_frequent=2) == sorted([*FALLBACK_WORDS, "zebra"])


def test_ruler_score_and_evaluate_ruler(ckpt: Path, tokenizer: Any) -> None:
    from litkv.checkpoints.checkpoint import load_model

    model: GPT = load_model(ckpt, device=torch.device("cpu"), dtype=torch.float32)
    rows = generate_samples(["niah_single_1", "vt"], tokenizer, FALLBACK_WORDS, 512, 2, seed=3)
    results = evaluate_ruler(model, tokenizer, rows, ["h2o"], [32, 64], KVCacheConfig(chunk_size=32), length=512)
    assert [(r.policy, r.cache_length) for r in results] == [("dense", 512), ("h2o", 32), ("h2o", 64)]
    assert all(set(r.scores) == {"niah_single_1", "vt"} and 0 <= r.mean <= 1 for r in results)
    # a sample whose reference is any string the model writes scores 1
    gen = rows["vt"][0]
    always = RulerSample("vt", gen.prompt, gen.ids, [""], 4, gen.context_length)
    assert ruler_score(model, tokenizer, [always], KVCacheConfig(policy="dense", cache_length=512)) == 1.0
    with pytest.raises(ValueError, match="budgets must be a non-empty list"):
        evaluate_ruler(model, tokenizer, rows, ["h2o"], [])


def test_table_marks_tasks_dense_cannot_do() -> None:
    results = [
        RulerResult("dense", 1024, {"niah_single_1": 1.0, "vt": 0.05}),
        RulerResult("h2o", 128, {"niah_single_1": 0.5, "vt": 0.0}),
    ]
    table = format_ruler_table(results)
    assert near_zero_tasks(results) == ["vt"]
    assert table.splitlines()[0].split() == ["policy", "budget", "niah_single_1", "vt*", "mean"]
    assert "1024 (full)" in table and "0.53" in table and "stronger model" in table.splitlines()[-1]


def test_evaluate_cli_tasks(ckpt: Path, tmp_path: Path, capsys) -> None:
    argv = ["evaluate", str(ckpt), "--tasks", "niah_single_1,niah_single_2", "--policies", "[last-recent, h2o]"]
    argv += ["--budgets", "[32]", "--task_samples", "2", "--device", "cpu", "--out_dir", str(tmp_path)]
    main(argv)
    printed = capsys.readouterr().out
    assert printed.splitlines()[0].split()[:2] == ["policy", "budget"] and "256 (full)" in printed
    data = json.loads((tmp_path / "ruler.json").read_text())
    assert data["tasks"] == ["niah_single_1", "niah_single_2"] and data["length"] == 256 and data["num_samples"] == 2
    assert [(r["policy"], r["cache_length"]) for r in data["results"]] == [
        ("dense", 256),
        ("last-recent", 32),
        ("h2o", 32),
    ]
    assert data["niah_format"]["single_question"] == RECALL["question"]
    assert (tmp_path / "ruler.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit):
        main([*argv[:3], "vt,nope", "--out_dir", str(tmp_path)])
    assert "unknown RULER task(s) ['nope']" in capsys.readouterr().err


def test_tasks_without_a_text_need_no_text_file(ckpt: Path, tmp_path: Path, capsys) -> None:
    """A checkpoint without heldout.txt (the real model's): niah_single_1 (noise haystack) runs without
    --text_file (fwe too: coded words); a task whose haystack is text asks for it, naming the task."""
    bare = tmp_path / "bare"
    shutil.copytree(ckpt, bare)
    (bare / "heldout.txt").unlink(missing_ok=True)
    argv = ["evaluate", str(bare), "--tasks", "niah_single_1", "--policies", "[h2o]", "--budgets", "[32]"]
    argv += ["--task_samples", "1", "--device", "cpu", "--out_dir", str(tmp_path / "out")]
    main(argv)
    data = json.loads((tmp_path / "out" / "ruler.json").read_text())
    assert data["tasks"] == ["niah_single_1"] and data["words_from"].startswith("FALLBACK_WORDS")
    assert [needs_text(name) for name in TASKS] == [name not in ("niah_single_1", "fwe") for name in TASKS]
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main([*argv[:3], "niah_single_1,vt", *argv[4:-1], str(tmp_path / "out2")])
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: RULER task(s) vt draw their haystack from a text") and "--text_file" in err
