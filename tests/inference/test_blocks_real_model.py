"""KV blocks on SmolLM2-135M-Instruct (the checkpoint of `litkv download smollm2-135m-instruct`): a needle
found in a spliced document, and the splice at r = 1 giving the full prefill's greedy answer.

Skipped where the checkpoint has not been downloaded and converted.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from litkv import BlockStore, KVCacheConfig, generate
from litkv.checkpoints.checkpoint import load_model, load_tokenizer
from litkv.checkpoints.download import known_checkpoint_dir
from litkv.eval.ruler import FALLBACK_WORDS, NOISE
from litkv.inference.blocks import prompt_segments
from litkv.inference.chat_template import load_format

NAME = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def real() -> Path:
    try:
        path = known_checkpoint_dir(NAME)
    except FileNotFoundError:
        path = None
    if path is None or not path.is_dir():
        pytest.skip(f"the {NAME} checkpoint is not here: run `litkv download {NAME}`")
    return path


@pytest.mark.slow
@torch.inference_mode()
def test_needle_in_a_spliced_document(real: Path) -> None:
    model, tokenizer = load_model(real), load_tokenizer(real)
    fmt = load_format(real, tokenizer, None)
    rng = random.Random(3)
    key, value = rng.choice(FALLBACK_WORDS), str(rng.randint(10**6, 10**7 - 1))
    docs = [f"Document {i}.\n" + NOISE * 3 + "\n" for i in range(2)]
    docs[1] = docs[1].replace("Here we go.", f"One of the special magic numbers for {key} is: {value}.", 1)
    question = (
        f"\nWhat is the special magic number for {key} mentioned in the provided text? Answer with the number only."
    )
    segments = prompt_segments(fmt, tokenizer, docs, question)
    cfg = KVCacheConfig("dense", cache_length=512, chunk_size=64)
    full = generate(model, [torch.cat([s.ids for s in segments])], 20, cfg)[0]
    assert value in tokenizer.decode(full)
    store = BlockStore(1 << 30)
    spliced = generate(model, [segments], 20, cfg, block_store=store, recompute=0.15)[0]
    assert value in tokenizer.decode(spliced)
    assert torch.equal(generate(model, [segments], 20, cfg, block_store=store, recompute=1.0)[0], full)
    assert store.hits == store.misses  # the documents were computed once, restored at the second use
