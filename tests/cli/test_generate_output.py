"""`litkv generate`'s stdout and Python's input for the same text.

- One input for one text: `litkv.chat_prompt(tokenizer, text)` gives the ids the command feeds (its chat
  template rendered as the command renders it; the raw text where the checkpoint has none) and
  `litkv.chat_stop_tokens` its stop tokens, so `litkv.generate` answers with the command's tokens: on the
  small shipped model (no template), on a tiny model with SmolLM2's template (ids checked against
  transformers' `apply_chat_template`) and on SmolLM2-135M-Instruct (skipped when it is not downloaded).
- A batch's stdout splits back into its answers: `--output jsonl` (one object per prompt) and the text
  format (one escaped line per prompt) give the texts `litkv.generate`'s tokens decode to.
- A long prompt's echo on stderr is shortened (first and last lines, the token count).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_chat_template import hf_ids
from tiny_checkpoint import write_chatml_tokenizer

import litkv
import litkv.cli.generate_cmd as generate_cmd
from litkv.__main__ import main
from litkv.checkpoints.checkpoint import default_checkpoint_dir, load_model, load_tokenizer
from litkv.cli.answers import escape_line, shorten_echo, unescape_line
from litkv.inference.sampling import Sampling
from litkv.modeling.config import KVCacheConfig

PROMPTS = ["And it came to pass, when", "In the beginning God created", "And he said"]


def run_cli(args: list[str], capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> tuple:
    """`litkv generate ARGS` in-process, greedy: (stdout, stderr, the prompts it fed, the tokens it got)."""
    seen: dict[str, list] = {}
    run = generate_cmd.generate_tokens

    def spy(model, prompts, *rest, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        seen["prompts"] = [p.tolist() for p in prompts]
        seen["outputs"] = run(model, prompts, *rest, **kwargs)
        return seen["outputs"]

    monkeypatch.setattr(generate_cmd, "generate_tokens", spy)
    main(["generate", *args, "--temperature", "0", "--num_threads", "1"])
    captured = capsys.readouterr()
    return captured.out, captured.err, seen["prompts"], [o.tolist() for o in seen["outputs"]]


def python_answers(ckpt: Path | None, texts: list[str], max_new_tokens: int, policy: str = "dense") -> tuple:
    """What Python does for `texts`: (ids fed, tokens) with `litkv.chat_prompt` and `litkv.chat_stop_tokens`."""
    path = ckpt if ckpt is not None else default_checkpoint_dir()
    model, tokenizer = load_model(path), load_tokenizer(path)
    ids = [litkv.chat_prompt(tokenizer, text) for text in texts]
    stop = litkv.chat_stop_tokens(tokenizer)
    kv = KVCacheConfig(policy=policy, cache_length=max(len(i) for i in ids) + max_new_tokens)
    out = litkv.generate(model, ids, max_new_tokens, kv, Sampling(stop_tokens=stop))
    return [i.tolist() for i in ids], [o.tolist() for o in out], tokenizer, stop


def test_shipped_model_cli_and_python_feed_the_same_ids_and_get_the_same_tokens(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    out, _, fed, got = run_cli(["--prompt", PROMPTS[0], "--max_new_tokens", "12"], capsys, monkeypatch)
    ids, tokens, tokenizer, _ = python_answers(None, PROMPTS[:1], 12)
    assert fed == ids and ids[0] == tokenizer.encode(PROMPTS[0]).tolist()  # no template: the raw text
    assert got == tokens and out == tokenizer.decode(torch.tensor(tokens[0])) + "\n"


def test_templated_model_cli_and_python_feed_the_same_ids(
    tiny_ckpt: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoTokenizer

    write_chatml_tokenizer(tiny_ckpt)
    _, _, fed, got = run_cli(
        [str(tiny_ckpt), "--prompt", "What is the passkey?", "--max_new_tokens", "6"], capsys, monkeypatch
    )
    ids, tokens, tokenizer, stop = python_answers(tiny_ckpt, ["What is the passkey?"], 6)
    hf = AutoTokenizer.from_pretrained(str(tiny_ckpt))
    assert fed == ids == [hf_ids(hf, [("user", "What is the passkey?")], True)] and got == tokens
    assert stop == [0, 2]  # generation_config's EOS and the template's <|im_end|>
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}, ("user", "Bye")]
    expected = hf_ids(hf, [("user", "Hi"), ("assistant", "Hello"), ("user", "Bye")], True)
    assert litkv.chat_prompt(tokenizer, messages).tolist() == expected
    with pytest.raises(ValueError, match="message 0 must be"):
        litkv.chat_prompt(tokenizer, [("user",)])


@pytest.mark.slow
def test_real_model_cli_and_python_feed_the_same_ids_and_get_the_same_tokens(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from litkv.checkpoints.download import cache_dir

    real = cache_dir("smollm2-135m-instruct")
    if not (real / "model.safetensors").is_file():
        pytest.skip("SmolLM2-135M-Instruct is not downloaded (`litkv download smollm2-135m-instruct`)")
    question = "What is the capital of France?"
    out, _, fed, got = run_cli([str(real), "--prompt", question, "--max_new_tokens", "24"], capsys, monkeypatch)
    ids, tokens, tokenizer, stop = python_answers(real, [question], 24)
    assert "<|im_start|>assistant" in tokenizer.processor.decode(ids[0], skip_special_tokens=False)
    assert fed == ids and got == tokens and "Paris" in out
    assert tokens[0][-1] in stop  # the answer ended at the end of turn, as the command's did


def test_jsonl_and_text_outputs_split_into_the_batch_answers(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = [arg for text in PROMPTS for arg in ("--prompt", text)] + ["--max_new_tokens", "40"]
    jsonl, _, _, got = run_cli([*args, "--output", "jsonl"], capsys, monkeypatch)
    text, err, _, got_text = run_cli(args, capsys, monkeypatch)
    ids, tokens, tokenizer, stop = python_answers(None, PROMPTS, 40)
    assert got == got_text == tokens
    records = [json.loads(line) for line in jsonl.splitlines()]
    lines = text.split("\n")
    assert lines[-1] == "" and len(lines) == len(PROMPTS) + 1  # one line per answer, each ending its line
    assert any("\n" in r["text"] for r in records)  # answers with newlines, written on one line each
    for i, (record, line) in enumerate(zip(records, lines, strict=False)):
        ended = tokens[i][-1] in stop
        expected = tokenizer.decode(torch.tensor(tokens[i][:-1] if ended else tokens[i]))
        assert record == {
            "index": i,
            "text": expected,
            "prompt_tokens": len(ids[i]),
            "new_tokens": len(tokens[i]),
            "finish_reason": "stop" if ended else "length",
        }
        assert unescape_line(line) == expected and f"--- prompt {i} ---\n{PROMPTS[i]}\n" in err


def test_escaped_lines_round_trip() -> None:
    for text in ["a\nb", "back\\slash\\n not a newline", "\r\n\n", "", "tab\tand unicode \u00e9 \U0001f600"]:
        line = escape_line(text)
        assert "\n" not in line and "\r" not in line and unescape_line(line) == text


def test_a_long_prompt_echo_is_shortened_with_its_token_count(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    lines = [f"line {i}: And it came to pass" for i in range(60)]
    prompt = tmp_path / "long.txt"
    prompt.write_text("\n".join(lines), encoding="utf-8")
    _, err, fed, _ = run_cli(["--prompt_file", str(prompt), "--max_new_tokens", "2"], capsys, monkeypatch)
    echo = err.split("prompt tokens:")[0]
    assert lines[0] in echo and lines[2] in echo and lines[-1] in echo and lines[30] not in echo
    assert f"the prompt, {len(fed[0])} tokens in 60 lines, is shortened here" in echo
    one_line = "word " * 1000
    short = shorten_echo(one_line, 1000)
    assert short.startswith(one_line[:300]) and short.endswith(one_line[-300:]) and len(short) < 800
    assert shorten_echo("short\nprompt", 3) == "short\nprompt"
