"""The model shipped in `litkv/assets/default/`: complete, small, loadable by LitGPT, and good enough.

Behaviour is checked against independent references: litgpt's own GPT on the same weights decides
the pass-key answers by plain argmax (no cache), and the sampled text is checked word by word against
the held-out Bible text shipped beside the model.
"""

from __future__ import annotations

import random
import re

import pytest
import torch
from litgpt.model import GPT as LitGPT

from litkv.checkpoints.checkpoint import (
    check_checkpoint_dir,
    default_checkpoint_dir,
    load_config,
    load_model,
    load_state_dict,
    load_tokenizer,
)
from litkv.eval.evaluate import recall_accuracy
from litkv.eval.recall import RecallTask
from litkv.inference.generate import generate
from litkv.inference.sampling import Sampling
from litkv.kvcache.config import KVCacheConfig

DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
SHIPPED = default_checkpoint_dir()


@pytest.fixture(scope="module")
def shipped() -> tuple:
    model = load_model(SHIPPED)
    tokenizer = load_tokenizer(SHIPPED)
    return model, tokenizer, RecallTask.from_checkpoint(SHIPPED, tokenizer)


def test_files_size_and_architecture() -> None:
    check_checkpoint_dir(SHIPPED)
    names = {p.name for p in SHIPPED.iterdir()}
    expected = {"model.safetensors", "model_config.yaml", "tokenizer.json", "tokenizer_config.json"}
    assert expected | {"recall_format.json", "heldout.txt", "README.md"} <= names
    total = sum(p.stat().st_size for p in SHIPPED.iterdir())
    assert total <= 25 * 2**20, f"shipped model is {total / 2**20:.1f} MiB, more than 25 MiB"
    config = load_config(SHIPPED)
    assert config.block_size >= 1024
    assert config.rotary_percentage > 0 and config.n_query_groups < config.n_head  # RoPE, GQA
    from tokenizers import Tokenizer

    assert type(Tokenizer.from_file(str(SHIPPED / "tokenizer.json")).model).__name__ == "BPE"


def _litgpt_recall(model: torch.nn.Module, examples: list) -> list[bool]:
    """Greedy answers decided by litgpt's GPT: argmax at every answer position, answer fed in."""
    ref = LitGPT(model.config)
    ref.load_state_dict(load_state_dict(SHIPPED / "model.safetensors"))
    ref.eval()
    hits = []
    with torch.inference_mode():
        for ex in examples:
            logits = ref(torch.tensor([ex.ids[:-1]]))[0]
            hits.append(logits[ex.answer_start - 1 :].argmax(-1).tolist() == ex.answer)
    return hits


@pytest.mark.slow
def test_dense_recalls_the_pass_key_at_full_context(shipped: tuple) -> None:
    """The bar: >= 90% of held-out pass keys recalled with a dense cache at the full context length."""
    model, _, task = shipped
    length = task.fmt.context_length
    assert length == model.config.block_size
    examples = task.examples(length, DEPTHS, per_depth=4, seed=7)
    dense = KVCacheConfig(policy="dense", cache_length=length, chunk_size=256)
    by_depth = recall_accuracy(model, examples, dense, batch_size=4)
    ours = sum(by_depth[d] * 4 for d in DEPTHS) / len(examples)
    reference = _litgpt_recall(model, examples)
    assert ours == pytest.approx(sum(reference) / len(reference))
    assert ours >= 0.9, f"dense recall {ours:.2f} at {length} tokens, by depth {by_depth}"


def test_a_small_window_forgets_an_early_key(shipped: tuple) -> None:
    """Policies differ measurably: a 64-slot recent window cannot see a key written 900 tokens earlier."""
    model, _, task = shipped
    examples = task.examples(task.fmt.context_length, (0.0,), per_depth=4, seed=3)
    recent = KVCacheConfig(policy="last-recent", cache_length=64, chunk_size=64)
    assert recall_accuracy(model, examples, recent, batch_size=4)[0.0] <= 0.25


def test_shipped_gates_keep_an_early_key_in_64_slots(shipped: tuple) -> None:
    """The shipped eviction gates load with the model and `learned` recalls, at 64 slots, the keys that
    the recent window of the same size forgets (seed 11: keys the gates were not trained on)."""
    model, _, task = shipped
    assert model.eviction_gates is not None and model.eviction_gates.n_layer == model.config.n_layer
    examples = task.examples(task.fmt.context_length, (0.0, 0.5), per_depth=3, seed=11)
    learned = KVCacheConfig(policy="learned", cache_length=64, chunk_size=64)
    by_depth = recall_accuracy(model, examples, learned, batch_size=3)
    assert min(by_depth.values()) >= 2 / 3, by_depth


def test_samples_read_as_bible_text(shipped: tuple) -> None:
    model, tokenizer, _ = shipped
    heldout = (SHIPPED / "heldout.txt").read_text(encoding="utf-8")
    known = set(re.findall(r"[a-z]+", heldout.lower()))
    prompt = tokenizer.encode("And God said unto Moses,").long()
    cache = KVCacheConfig(policy="h2o", cache_length=128)
    gen = torch.Generator().manual_seed(0)
    out = generate(model, [prompt], 200, cache, Sampling(temperature=0.8, top_k=40, generator=gen))
    words = re.findall(r"[a-z]+", tokenizer.decode(out[0]).lower())
    assert len(words) >= 60
    share = sum(w in known for w in words) / len(words)
    assert share >= 0.85, f"only {share:.0%} of sampled words occur in the held-out text: {words}"
    rng = random.Random(0)  # control: random tokens do not pass the same check
    noise = tokenizer.decode(torch.tensor([rng.randrange(model.config.vocab_size) for _ in range(200)]))
    noise_words = re.findall(r"[a-z]+", noise.lower())
    assert sum(w in known for w in noise_words) / len(noise_words) < 0.6
