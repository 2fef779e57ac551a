"""`kvzip` wherever a policy name is accepted: the Python `generate` and `litkv generate` run its reconstruction
pass and answer what `litkv evaluate`'s one-shot path answers (`litkv.eval.oneshot.oneshot_answers`, the whole
prompt compressed) with the kept slots of `kvzip_compress` (checked against a float64 brute force in
tests/kvcache/test_kvzip.py); chat and serve refuse it in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from litkv.__main__ import main
from litkv.checkpoints.checkpoint import load_model, load_tokenizer
from litkv.cli.generate_cmd import fit_kvzip
from litkv.cli.generate_cmd import generate as generate_cli
from litkv.eval.oneshot import oneshot_answers
from litkv.inference.chat_template import RawFormat
from litkv.inference.conversation import Conversation
from litkv.inference.generate import generate, pad_prompts
from litkv.inference.kvzip_reconstruction import RepeatPrompt, kvzip_compress
from litkv.modeling.config import KVCacheConfig
from litkv.modeling.runner import ChunkPlan, run_chunks
from litkv.serve import ConversationStore, Engine

REPEAT = RepeatPrompt(first=(5, 6, 7), later=(8, 9), suffix=(10, 11), overlap=3)
LENGTHS = (29, 21)
NEW = 6


def _prompts() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(12, 128, (n,), generator=gen) for n in LENGTHS]


def _config(budget: int = 7, **options: object) -> KVCacheConfig:
    opts = {"budget": budget, "chunk_size": 9, **options}  # two reconstruction chunks per prompt
    return KVCacheConfig("kvzip", cache_length=max(LENGTHS) + NEW, chunk_size=5, options=opts)


def _kept_prompt_slots(model, lengths: list[int]) -> list[list[list[list[int]]]]:
    """Per layer, row and KV head, the sorted prompt positions the caches hold."""
    return [
        [[sorted(p[(p >= 0) & (p < n)].tolist()) for p in cache.positions[row]] for row, n in enumerate(lengths)]
        for cache in model.caches
    ]


@pytest.mark.parametrize("layerwise", [False, True], ids=["across_layers", "layerwise"])
def test_generate_runs_the_pass_and_equals_evaluate_one_shot(tiny_model, layerwise: bool) -> None:
    model = tiny_model(4)
    prompts = _prompts()
    cfg = _config(layerwise=layerwise)
    seen: list = []

    def first_step(tokens: torch.Tensor) -> None:
        if not seen:  # the caches right after the compression (and the first decode step)
            seen.append(_kept_prompt_slots(model, list(LENGTHS)))

    got = generate(model, prompts, NEW, cfg, on_tokens=first_step, kvzip_repeat=REPEAT)
    want = oneshot_answers(model, prompts, NEW, {7: cfg}, REPEAT)[7]
    assert [g.tolist() for g in got] == [w.tolist() for w in want]
    with torch.inference_mode(), model.kv_caches_attached(cfg, len(prompts)):
        idx, pos = pad_prompts(prompts, torch.device("cpu"))
        run_chunks(model, idx, pos, ChunkPlan.of(cfg), lm_head=False, last_only=True)
        kvzip_compress(model, prompts, REPEAT)
        assert seen[0] == _kept_prompt_slots(model, list(LENGTHS))
        total = sum(len(h) for layer in seen[0] for row in layer[:1] for h in row)
        assert total == 7 * model.config.n_query_groups * model.config.n_layer  # the budget, over all layers


def test_generate_refuses_what_cannot_be_kvzip(tiny_model) -> None:
    model = tiny_model(4)
    with pytest.raises(ValueError, match=r"^kvzip needs its reconstruction prompt"):
        generate(model, _prompts(), 2, _config())
    with pytest.raises(ValueError, match=r"^kvzip has no mode='continuous'"):
        _config(mode="continuous")
    with pytest.raises(ValueError, match=r"^kvzip compresses every layer at once"):
        generate(model, _prompts(), 2, [_config(), *[KVCacheConfig("h2o", 16)] * (model.config.n_layer - 1)])


def test_cli_generate_equals_evaluate_one_shot(ckpt: Path, capsys: pytest.CaptureFixture) -> None:
    """`litkv generate --kv-cache kvzip --kv_cache.cache_length 6`: cache_length is the budget kept, the
    cache holds the whole prompt until the reconstruction pass; greedy tokens equal evaluate's one-shot path."""
    text = "the quick brown fox jumps over the lazy dog and the cat sat on the mat again"
    args = {"prompt": [text], "max_new_tokens": NEW, "temperature": 0.0, "chat_template": False}
    kv = KVCacheConfig("kvzip", cache_length=6, chunk_size=4, options={"chunk_size": 8})
    out = generate_cli(ckpt, kv_cache=kv, **args)[0]
    assert "cache: kvzip" in capsys.readouterr().err
    tokenizer = load_tokenizer(ckpt)
    ids = tokenizer.encode(text).long()
    cfg = fit_kvzip(kv, ids.numel(), NEW)
    assert cfg.policy_options.budget == 6 and cfg.cache_length == ids.numel() + NEW - 1
    model = load_model(ckpt).eval()
    want = oneshot_answers(model, [ids], NEW, {6: cfg}, RepeatPrompt.build(tokenizer, None))[6][0].tolist()
    stops = set(RawFormat(tokenizer).stop_ids)
    cut = next((i + 1 for i, t in enumerate(want) if t in stops), len(want))
    assert out.tolist() == want[:cut]


def test_chat_and_serve_refuse_kvzip_in_one_line(tiny_model, ckpt: Path, capsys: pytest.CaptureFixture) -> None:
    model = tiny_model(4)
    tokenizer = load_tokenizer(ckpt)
    kv = KVCacheConfig("kvzip", cache_length=32)
    with pytest.raises(ValueError, match=r"^litkv chat does not run kvzip \(mode='one-shot'"):
        Conversation(model, RawFormat(tokenizer), kv)
    with pytest.raises(ValueError, match=r"^litkv serve does not run kvzip \(mode='one-shot'"):
        Engine(model, tokenizer, kv, ConversationStore(1 << 20, model=model, kv_cache=kv))
    for command in ("chat", "serve"):
        with pytest.raises(SystemExit) as exc:
            main([command, str(ckpt), "--kv-cache", "kvzip"])
        assert exc.value.code == 1
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert lines == [lines[0]] and lines[0].startswith(f"error: litkv {command} does not run kvzip")
