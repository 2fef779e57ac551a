"""`litkv convert FILE.gguf`: small GGUF files written here (every tensor type `gguf` reads, tied and
untied, GQA, llama/qwen2/qwen3) become checkpoints whose logits equal transformers' own GGUF load and
whose tokenizer gives transformers' GGUF tokenizer's ids; bad files fail in one line with no output."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from gguf_files import (
    LLAMA_CPP_REGEXES,
    SPECIALS,
    TinyGGUF,
    dequantizable_types,
    llama_cpp_split,
    train_bpe,
    write_gguf,
)
from tokenizers import Tokenizer

from litkv.__main__ import main
from litkv.checkpoints.checkpoint import load_model, load_state_dict, load_tokenizer
from litkv.checkpoints.gguf_convert import convert_gguf
from litkv.checkpoints.gguf_tokenizer import tokenizer_files
from litkv.core.atomic import temp_files

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world! The quick brown fox, 12345 and 3.14159.",
    "naïve café 日本語 🎉🚀 Привет, мир — αβγ",
    "  two spaces,\tthen a tab\n\n\nthree newlines   and trailing   ",
    "We're they'll DON'T I'M you've 1,000,000 x=42;y=7*6",
    "digits 0 12 345 6789 01234567890 a1b2c3",
    "a chat: <|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nok",
    "\r\n\r\n  \u00a0nbsp and\u3000ideographic space",
]
# Relative Frobenius error of a dequantized weight to the float weight that was quantized; a wrong
# row order or a lost permutation gives about 1.4.
QUANT_ERROR = {"F32": 0.0, "F16": 1e-3, "BF16": 1e-2, "Q8_0": 2e-2, "Q5_0": 0.1, "Q5_1": 0.1, "Q4_0": 0.2,
               "Q4_1": 0.2, "MXFP4": 0.3, "TQ1_0": 0.9, "TQ2_0": 0.9}  # fmt: skip


def _convert(tmp_path: Path, spec: TinyGGUF, name: str = "model") -> tuple[Path, Path, dict, dict]:
    gguf_file = tmp_path / f"{name}.gguf"
    weights, types = write_gguf(gguf_file, spec)
    out = tmp_path / f"{name}-litkv"
    convert_gguf(gguf_file, out)
    return gguf_file, out, weights, types


def _hf_logits(gguf_file: Path, ids: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        return model(ids).logits


def _assert_logits_match(gguf_file: Path, out: Path) -> None:
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    expected = _hf_logits(gguf_file, ids)
    with torch.no_grad():
        actual = load_model(out)(ids)
    torch.testing.assert_close(actual, expected, atol=1e-4 * expected.abs().max().item(), rtol=1e-4)


def test_every_tensor_type_gives_transformers_logits(tmp_path: Path) -> None:
    """One llama file (GQA 4/2, untied) whose 30 matrices cycle through all 26 types gguf dequantizes."""
    types = dequantizable_types()
    assert {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q6_K"} <= set(types)
    spec = TinyGGUF(n_layer=4, qtypes=types)
    gguf_file, out, weights, stored = _convert(tmp_path, spec)
    assert set(types) <= set(stored.values())  # every type is in the file
    _assert_logits_match(gguf_file, out)
    # The weights that gguf can quantize come back as the float weights (in litgpt's layout) within
    # their quantization error: the permutation is undone and q, k, v land in their rows.
    state = load_state_dict(out / "model.safetensors")
    q, kv = spec.n_head * spec.head_size, spec.n_kv * spec.head_size
    rows = {"attn_q": slice(0, q), "attn_k": slice(q, q + kv), "attn_v": slice(q + kv, q + 2 * kv)}
    keys = {"ffn_gate": "mlp.fc_1", "ffn_up": "mlp.fc_2", "ffn_down": "mlp.proj", "attn_output": "attn.proj"}
    checked = set()
    for name, qtype in stored.items():
        if qtype not in QUANT_ERROR or weights[name].ndim != 2:
            continue
        if name.startswith("blk."):
            _, layer, part, _ = name.split(".")
            if part in rows:
                actual = state[f"transformer.h.{layer}.attn.qkv.weight"][rows[part]]
            else:
                actual = state[f"transformer.h.{layer}.{keys[part]}.weight"]
        else:
            actual = state[{"token_embd.weight": "transformer.wte.weight", "output.weight": "lm_head.weight"}[name]]
        original = torch.from_numpy(weights[name])
        error = ((actual - original).norm() / original.norm()).item()
        assert error <= QUANT_ERROR[qtype], (name, qtype, error)
        checked.add(name.split(".")[2] if name.startswith("blk.") else name)
    assert {"attn_q", "attn_k", "attn_v", "token_embd.weight"} <= checked  # the permuted ones among them


@pytest.mark.parametrize(
    "spec",
    [
        TinyGGUF(tied=True, n_kv=4, qtypes=("Q8_0", "F16")),  # tied, multi-head (no GQA)
        TinyGGUF(arch="qwen2", tied=True, pre="qwen2", qtypes=("Q4_1", "F32")),  # attention biases
        TinyGGUF(arch="qwen3", head_dim=128, pre="qwen2", qtypes=("Q5_0", "BF16")),  # q/k norms
    ],
    ids=["llama-tied-mha", "qwen2-tied-bias", "qwen3"],
)
def test_architectures_give_transformers_logits(tmp_path: Path, spec: TinyGGUF) -> None:
    gguf_file, out, _, stored = _convert(tmp_path, spec)
    assert ("output.weight" in stored) == (not spec.tied)
    _assert_logits_match(gguf_file, out)
    config = yaml.safe_load((out / "model_config.yaml").read_text())
    assert (config["n_query_groups"], config["attn_bias"], config["norm_qk"]) == (
        spec.n_kv, spec.arch == "qwen2", spec.arch == "qwen3")  # fmt: skip


def test_litgpt_loads_the_checkpoint(tmp_path: Path) -> None:
    """LitGPT's own GPT and Tokenizer read the directory; its logits equal litkv's."""
    import litgpt

    _, out, _, _ = _convert(tmp_path, TinyGGUF(tied=True, qtypes=("Q4_0",)))
    config = litgpt.Config(**yaml.safe_load((out / "model_config.yaml").read_text()))
    model = litgpt.GPT(config).eval()
    model.load_state_dict(load_state_dict(out / "model.safetensors"), strict=True)
    tokenizer = litgpt.Tokenizer(out)
    ids = tokenizer.encode(TEXTS[0]).unsqueeze(0).long()
    assert ids.tolist()[0] == load_tokenizer(out).encode(TEXTS[0]).tolist()
    with torch.no_grad():
        torch.testing.assert_close(model(ids), load_model(out)(ids), atol=1e-5, rtol=1e-5)


def test_dtype_option(tmp_path: Path) -> None:
    gguf_file = tmp_path / "m.gguf"
    write_gguf(gguf_file, TinyGGUF(n_layer=1, qtypes=("Q8_0",)))
    convert_gguf(gguf_file, tmp_path / "bf16", dtype=torch.bfloat16)
    convert_gguf(gguf_file, tmp_path / "f32")
    low, full = (
        load_state_dict(tmp_path / "bf16" / "model.safetensors"),
        load_state_dict(tmp_path / "f32" / "model.safetensors"),
    )
    assert {t.dtype for t in low.values()} == {torch.bfloat16}
    assert all(torch.equal(low[k], full[k].to(torch.bfloat16)) for k in full)


@pytest.mark.parametrize(("arch", "pre"), [("llama", "gpt2"), ("llama", "smollm"), ("qwen2", "qwen2")])
def test_tokenizer_ids_equal_transformers_gguf_tokenizer(tmp_path: Path, arch: str, pre: str) -> None:
    spec = TinyGGUF(arch=arch, pre=pre, n_layer=1, tied=True)
    gguf_file, out, _, _ = _convert(tmp_path, spec)
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=gguf_file.name)
    ours = load_tokenizer(out)
    hf_of_ours = transformers.AutoTokenizer.from_pretrained(str(out))
    for text in TEXTS:
        expected = reference(text, add_special_tokens=False).input_ids
        assert ours.processor.encode(text).ids == expected, text
        assert hf_of_ours(text, add_special_tokens=False).input_ids == expected, text
        assert ours.encode(text).tolist() == expected, text  # litgpt: add_bos_token is false
        if "<|" not in text:
            assert ours.decode(torch.tensor(expected)) == text
    assert ours.processor.encode("<|im_start|>").ids == [1]  # control tokens are special added tokens:
    assert ours.decode(torch.tensor(reference("<|im_start|>hi<|im_end|>").input_ids)) == "hi"  # dropped by decode
    assert (ours.bos_id, ours.eos_id, ours.use_bos) == (1, 2, False)


def _byte_chars(text: str) -> str:
    """GPT-2's byte -> printable character mapping of `text`'s UTF-8 bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b], extra = chr(256 + extra), extra + 1
    return "".join(chars[b] for b in text.encode("utf-8"))


@pytest.mark.parametrize("pre", sorted(LLAMA_CPP_REGEXES))
def test_pre_tokenizer_splits_as_llama_cpp(pre: str) -> None:
    """The tokenizer.json pre-tokenizer splits text where llama.cpp's regexes do (`regex` module)."""
    tokens, merges = train_bpe("gpt2")
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": list(tokens),
            "tokenizer.ggml.merges": list(merges)}  # fmt: skip
    tokenizer = Tokenizer.from_str(tokenizer_files(meta, 512, "test")["tokenizer.json"])
    for text in [*TEXTS, "x" * 3 + "1234567" + " 89\n\n\n  \n q'S Q'LL", "é" + unicodedata.normalize("NFD", "é")]:
        normalized = unicodedata.normalize("NFC", text) if pre == "qwen2" else text
        expected = [_byte_chars(p) for p in llama_cpp_split(normalized, LLAMA_CPP_REGEXES[pre])]
        if tokenizer.normalizer is not None:
            text = tokenizer.normalizer.normalize_str(text)
        assert [p for p, _ in tokenizer.pre_tokenizer.pre_tokenize_str(text)] == expected, (pre, text)


def test_tokenizer_config_chat_template_and_bos(tmp_path: Path) -> None:
    gguf_file = tmp_path / "m.gguf"
    write_gguf(gguf_file, TinyGGUF(n_layer=1, tied=True, add_bos=True))
    convert_gguf(gguf_file, tmp_path / "out")
    from gguf import GGUFReader

    template = GGUFReader(gguf_file).fields["tokenizer.chat_template"].contents()
    config = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert config["chat_template"] == template
    assert (config["bos_token"], config["eos_token"], config["pad_token"], config["add_bos_token"]) == (
        SPECIALS[1], SPECIALS[2], SPECIALS[2], True)  # fmt: skip
    assert json.loads((tmp_path / "out" / "generation_config.json").read_text())["eos_token_id"] == 2
    tokenizer = load_tokenizer(tmp_path / "out")
    assert tokenizer.encode("hello").tolist()[0] == 1  # add_bos_token: litgpt prepends BOS
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert hf("hello").input_ids == tokenizer.encode("hello").tolist()


# -- bad files ---------------------------------------------------------------------------------------


def _bad(tmp_path: Path, spec: TinyGGUF) -> Path:
    path = tmp_path / "bad.gguf"
    write_gguf(path, spec)
    return path


def _truncate(path: Path, keep: float) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    return path


def _wrong_magic(tmp_path: Path) -> Path:
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGML" + bytes(100))
    return path


BAD_FILES = {
    "wrong magic": (_wrong_magic, "magic"),
    "truncated in the weights": (lambda p: _truncate(_bad(p, TinyGGUF(n_layer=1)), 0.9), "truncated"),
    "truncated in the metadata": (lambda p: _truncate(_bad(p, TinyGGUF(n_layer=1)), 0.01), "truncated"),
    "unsupported architecture": (lambda p: _bad(p, TinyGGUF(n_layer=1, arch_name="gptneox")), "architecture"),
    "unsupported tensor type": (lambda p: _bad(p, TinyGGUF(n_layer=1, qtypes=("F32", "F64"))), "unsupported type"),
    "unexpected tensor": (
        lambda p: _bad(p, TinyGGUF(n_layer=1, extra_tensors={"blk.0.x.weight": np.ones(4)})),
        "unexpected",
    ),
    "shape mismatch": (lambda p: _bad(p, TinyGGUF(n_layer=1, kv_heads_in_metadata=1)), "shape"),
    "missing tokenizer data": (lambda p: _bad(p, TinyGGUF(n_layer=1, tokenizer=False)), "tokenizer"),
    "unsupported pre-tokenizer": (lambda p: _bad(p, TinyGGUF(n_layer=1, pre="bogus")), "tokenizer.ggml.pre 'bogus'"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_file_one_line_error_and_no_output(tmp_path: Path, case: str, capsys: pytest.CaptureFixture) -> None:
    make, word = BAD_FILES[case]
    path = make(tmp_path)
    out = tmp_path / "out"
    with pytest.raises(ValueError) as info:
        convert_gguf(path, out)
    message = str(info.value)
    assert "\n" not in message and str(path) in message and word in message.lower(), message
    assert not out.exists() and not temp_files(tmp_path)
    with pytest.raises(SystemExit) as code:  # the command line says the same in one line
        main(["convert", str(path), str(out)])
    assert code.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and word in err[-1].lower() and not out.exists()


def test_existing_output_directory_is_not_replaced(tmp_path: Path) -> None:
    gguf_file = _bad(tmp_path, TinyGGUF(n_layer=1))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep")
    with pytest.raises(ValueError, match="not empty"):
        convert_gguf(gguf_file, tmp_path / "out")
    assert (tmp_path / "out" / "mine.txt").read_text() == "keep"


def test_convert_command_dispatches_on_gguf(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    gguf_file = _bad(tmp_path, TinyGGUF(n_layer=1, tied=True))
    main(["convert", str(gguf_file), str(tmp_path / "out"), "--dtype", "float16"])
    assert "model.safetensors" in capsys.readouterr().out
    assert load_model(tmp_path / "out").lm_head.weight.dtype == torch.float16
