"""Documents as KV blocks in the conversation engine: `litkv chat` (`ChatSession`, `/attach`,
`--block_file`) and `litkv serve` (`Engine`, a request's `documents`).

References: `generate(model, [prompt_segments(...)], ...)`, which is what `litkv generate --block_file` runs
(tests/cli/test_cli_blocks.py ties the command to it): the same layout gives bitwise the same tokens;
the same conversation with the documents fed as ordinary text (recompute = 100% must equal it bitwise);
a normal prefill of the text before the documents (a system prompt stays exact).
"""

from __future__ import annotations

import dataclasses
import io
import sys
from pathlib import Path

import pytest
import torch

from litkv.__main__ import main
from litkv.checkpoints.checkpoint import load_model, load_tokenizer
from litkv.core.tokens import encode_plain
from litkv.inference.blocks import prefill_segments, prompt_segments
from litkv.inference.chat_session import ChatSession
from litkv.inference.chat_template import ChatTemplate, Format, RawFormat, TemplateFormat, TurnSegment
from litkv.inference.generate import generate
from litkv.inference.sampling import Sampling
from litkv.kvcache.config import ChunkPlan, KVCacheConfig
from litkv.modeling.model import GPT
from litkv.modeling.runner import run_chunks
from litkv.serve import ConversationStore, Engine, TurnRequest, TurnResult
from litkv.serve.engine import RequestError
from litkv.states.block_store import BlockStore

TEMPLATE = (  # SmolLM2-135M-Instruct's chat template (a default system prompt)
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
KV = KVCacheConfig(policy="dense", cache_length=400, chunk_size=8, prefill_length=16)
DOCS = (
    "The secret word is apple, said the quick brown fox to the lazy dog. ",
    "Nothing to see here: only sand, sea and the word of the beginning. ",
)
QUESTION = "What is the secret word?"


@pytest.fixture(scope="module")
def parts(ckpt: Path) -> tuple[GPT, object, Format]:
    tok = load_tokenizer(ckpt)
    return load_model(ckpt), tok, TemplateFormat(ChatTemplate(TEMPLATE, ckpt / "tokenizer_config.json"), tok)


greedy = Sampling()


def doc_files(tmp_path: Path, docs: tuple[str, ...] = DOCS) -> list[Path]:
    files = [tmp_path / f"doc{i}.txt" for i in range(len(docs))]
    for f, text in zip(files, docs, strict=True):
        f.write_text(text, encoding="utf-8")
    return files


def chat_turn(session: ChatSession, files: list[Path], text: str = QUESTION, n: int = 10) -> list[int]:
    for f in files:
        session.attach(f)
    return session.turn(text, n, greedy, io.StringIO(), stop_at_newline=False)


def serve_turn(engine: Engine, docs: tuple[str, ...], text: str = QUESTION, n: int = 10) -> TurnResult:
    result = TurnResult()
    "".join(engine.run(TurnRequest([("user", text)], n, temperature=0.0, documents=list(docs)), result))
    return result


def prompt_hidden(owner: object, name: str) -> list[torch.Tensor]:
    """Record what `owner.name` (a feeding method) returns: the prompt's last hidden states (the tiny random
    model's greedy tokens hardly depend on the prompt, so the tests compare these too)."""
    seen: list[torch.Tensor] = []
    method = getattr(owner, name)

    def record(*args: object) -> torch.Tensor:
        out = method(*args)
        seen.append(out.reshape(1, -1).clone())
        return out

    setattr(owner, name, record)
    return seen


def sampled_hidden(eng: Engine) -> list[torch.Tensor]:
    """Record the hidden state each turn's first token is sampled from (`RowBatch.logits`'s input, a copy)."""
    seen: list[torch.Tensor] = []
    logits = eng.batch.logits

    def record(hidden: torch.Tensor) -> torch.Tensor:
        seen.append(hidden.reshape(1, -1).clone())
        return logits(hidden)

    eng.batch.logits = record  # type: ignore[method-assign]
    return seen


def engine(model: GPT, tok: object, fmt: Format, **kw: object) -> Engine:
    store = ConversationStore(1 << 30, model=model, kv_cache=KV)
    return Engine(model, tok, KV, store, fmt=fmt, stop_at_newline=False, **kw)  # type: ignore[arg-type]


class AsText:
    """A format whose documents are ordinary prompt text: each run of documents and the text after it one
    text segment (the same ids, none spliced; what a normal prefill of the message feeds)."""

    def __init__(self, fmt: Format) -> None:
        self.fmt, self.name, self.stop_ids = fmt, fmt.name, fmt.stop_ids

    def segments(self, *args: object) -> list[TurnSegment]:
        out: list[TurnSegment] = []
        for seg in self.fmt.segments(*args):  # type: ignore[arg-type]
            if out and out[-1].block and not seg.reply:
                out[-1] = TurnSegment(out[-1].ids + seg.ids, False, block=seg.block)
            else:
                out.append(seg)
        return [dataclasses.replace(s, block=False) for s in out]


@pytest.mark.parametrize("recompute", [0.0, 0.3])
def test_chat_and_serve_with_documents_equal_generate_block_file(
    parts: tuple, tmp_path: Path, recompute: float
) -> None:
    model, tok, fmt = parts
    layout = prompt_segments(fmt, tok, list(DOCS), QUESTION)  # `litkv generate --block_file` with a template
    stops = tuple(sorted(fmt.stop_ids))
    with torch.inference_mode():
        ref = generate(model, [layout], 10, KV, Sampling(stop_tokens=stops), recompute=recompute)[0].tolist()
        with model.kv_caches_attached(KV, 1):
            hidden = prefill_segments(model, layout, KV, BlockStore(0), recompute)[0]
    session = ChatSession(model, tok, KV, fmt=fmt, recompute=recompute)
    docs = {0: [encode_plain(tok, d) for d in DOCS]}
    planned = session.conversation.plan([("user", QUESTION)], [None], documents=docs)
    assert [(list(s.ids), s.block) for s in planned] == [(s.ids.tolist(), s.block) for s in layout]
    chat_hidden = prompt_hidden(session.conversation, "feed")
    assert chat_turn(session, doc_files(tmp_path)) == ref
    assert torch.equal(chat_hidden[0], hidden)  # bitwise
    eng = engine(model, tok, fmt, blocks=BlockStore(1 << 30), recompute=recompute)
    serve_hidden = prompt_hidden(eng, "feed_prompt")
    served = serve_turn(eng, DOCS)
    assert served.reply_ids == [t for t in ref if t not in fmt.stop_ids]
    assert served.prompt_tokens == sum(s.ids.numel() for s in layout)
    # the server's caches attend every slot (static shapes): its float sums round otherwise, by ~1e-7 here;
    # the documents in another order move this hidden state by ~3e-3
    assert (serve_hidden[-1] - hidden).abs().max() < 1e-5


def test_raw_format_documents_after_bos_as_generate_lays_them_out(parts: tuple, tmp_path: Path) -> None:
    model, tok, _ = parts
    fmt = RawFormat(tok)  # raw text: BOS, the documents, then the message's text and its newline
    layout = prompt_segments(fmt, tok, list(DOCS), QUESTION + "\n")
    with torch.inference_mode():
        ref = generate(model, [layout], 8, KV, Sampling(stop_tokens=tuple(fmt.stop_ids)))[0].tolist()
    assert chat_turn(ChatSession(model, tok, KV, fmt=fmt), doc_files(tmp_path), n=8) == ref


def test_a_reused_document_hits_the_store_and_gives_the_same_tokens(parts: tuple) -> None:
    model, tok, fmt = parts
    blocks = BlockStore(1 << 30)
    eng = engine(model, tok, fmt, blocks=blocks, recompute=0.15)
    hidden = prompt_hidden(eng, "feed_prompt")
    first = serve_turn(eng, DOCS)
    first_hidden = hidden[-1]
    pieces = blocks.misses
    assert blocks.hits == 0 and pieces > 0 and first.block_tokens == 0
    again = serve_turn(eng, DOCS)
    assert blocks.hits == pieces and blocks.misses == pieces  # every piece restored, none computed
    assert again.block_tokens == sum(len(encode_plain(tok, d)) for d in DOCS)
    assert again.reply_ids == first.reply_ids and torch.equal(hidden[-1], first_hidden)
    # in the other order (other offsets): restored, and what a store that computes them gives
    swapped = serve_turn(eng, DOCS[::-1], "Which word?")
    assert blocks.misses == pieces
    fresh = engine(model, tok, fmt, recompute=0.15)
    fresh_hidden = prompt_hidden(fresh, "feed_prompt")
    assert swapped.reply_ids == serve_turn(fresh, DOCS[::-1], "Which word?").reply_ids
    assert torch.equal(hidden[-1], fresh_hidden[-1]) and not torch.equal(hidden[-1], first_hidden)
    # a state is restored only for the same documents: a follow-up that does not send them again is
    # recomputed from the messages' text (the documents are in the key of the message they belong to)
    follow = [("user", QUESTION), ("assistant", first.content), ("user", "Sure?")]
    result = TurnResult()
    "".join(eng.run(TurnRequest(follow, 4, temperature=0.0), result))
    assert result.reused_tokens == 0 and result.block_tokens == 0
    # chat shares a store the same way
    session = ChatSession(model, tok, KV, fmt=fmt, blocks=blocks)
    for text in DOCS:
        session.attached.append(tuple(encode_plain(tok, text)))
    session.turn(QUESTION, 4, greedy, io.StringIO(), stop_at_newline=False)
    assert blocks.misses == pieces and f"{blocks.hits} pieces restored, {pieces} computed" in session.stats()


def _layer_keys(model: GPT) -> list[torch.Tensor]:
    return [c.storage.read_prefix(c.num_filled)[0].clone() for c in model.kv_caches]


def test_full_recomputation_is_the_prefill_of_the_documents_as_text(parts: tuple, tmp_path: Path) -> None:
    model, tok, fmt = parts
    files = doc_files(tmp_path)
    replies = [chat_turn(ChatSession(model, tok, KV, fmt=fmt, recompute=1.0), files, n=6)]  # sessions share the model
    keys = _layer_keys(model)
    replies.append(chat_turn(ChatSession(model, tok, KV, fmt=AsText(fmt)), files, n=6))  # type: ignore[arg-type]
    assert replies[0] == replies[1]
    assert all(torch.equal(a, b) for a, b in zip(keys, _layer_keys(model), strict=True))
    chat_turn(ChatSession(model, tok, KV, fmt=fmt, recompute=0.0), files, n=6)
    assert not all(torch.equal(a, b) for a, b in zip(keys, _layer_keys(model), strict=True))  # r=0 differs
    full, text = engine(model, tok, fmt, recompute=1.0), engine(model, tok, AsText(fmt))  # type: ignore[arg-type]
    seen = [sampled_hidden(full), sampled_hidden(text)]  # text runs are fed chunk by chunk, not by feed_prompt
    assert serve_turn(full, DOCS, n=6).reply_ids == serve_turn(text, DOCS, n=6).reply_ids
    assert torch.equal(seen[0][-1], seen[1][-1])


@torch.inference_mode()
def test_system_prompt_before_the_documents_is_an_exact_prefix(parts: tuple) -> None:
    model, tok, fmt = parts
    messages = [("system", "You answer with one word."), ("user", QUESTION)]
    docs = {1: [encode_plain(tok, d) for d in DOCS]}
    with_docs = fmt.segments(messages, [None, None], True, True, docs)
    head = list(with_docs[0].ids)
    without = [t for s in fmt.segments(messages, [None, None], True, True) for t in s.ids]
    assert not with_docs[0].block and with_docs[1].block and without[: len(head)] == head
    assert "You answer with one word." in tok.decode(torch.tensor(head))
    session = ChatSession(model, tok, KV, fmt=fmt)
    conv = session.conversation
    pending = conv.prepare(messages, [None, None], docs)
    conv.feed(pending, messages, [None, None], docs)
    spliced = [k[:, :, : len(head)] for k in _layer_keys(model)]
    model.set_kv_caches(model.build_kv_caches(KV, 1))  # the head alone, as a normal prefill from 0 that
    system = len(fmt.segments(messages[:1], [None], True, False)[0].ids)  # ends a feed after the system prompt
    assert 0 < system < len(head) and conv.fed[0].ids == tuple(head[:system])
    for start, end, plan in (
        (0, system, ChunkPlan.of(KV)),
        (system, len(head), ChunkPlan(KV.chunk_length, KV.chunk_length)),
    ):
        idx, pos = torch.tensor([head[start:end]]), torch.arange(start, end)[None]
        run_chunks(model, idx, pos, plan, lm_head=False, last_only=True)
    assert all(torch.equal(a, b[:, :, : len(head)]) for a, b in zip(spliced, _layer_keys(model), strict=True))


@pytest.mark.parametrize("raw", [True, False])  # raw: the turn starts with its documents
def test_undo_save_and_load_of_a_turn_with_documents(parts: tuple, tmp_path: Path, raw: bool) -> None:
    model, tok, fmt = parts
    fmt = RawFormat(tok) if raw else fmt
    kv = KVCacheConfig(policy="h2o", cache_length=96, chunk_size=8, prefill_length=16)  # evicts
    files = doc_files(tmp_path)
    whole = ChatSession(model, tok, kv, fmt=fmt, recompute=0.2)
    first = whole.turn("Hello there.", 6, greedy, io.StringIO(), stop_at_newline=False)
    before = [t.clone() for c in model.kv_caches for t in c.state_tensors().values()]
    second = chat_turn(whole, files, n=6)
    assert whole.next_pos > kv.cache_length
    whole.undo()  # the splice's calls are in the undo log: back to the state after the first turn, bitwise
    after = [t for c in model.kv_caches for t in c.state_tensors().values()]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert chat_turn(whole, files, n=6) == second
    third = whole.turn("And then?", 6, greedy, io.StringIO(), stop_at_newline=False)
    documents = whole.conversation.documents
    resumed = ChatSession(model, tok, kv, fmt=fmt, recompute=0.2)
    assert resumed.turn("Hello there.", 6, greedy, io.StringIO(), stop_at_newline=False) == first
    chat_turn(resumed, files, n=6)
    resumed.save(tmp_path / "s.safetensors")
    loaded = ChatSession(model, tok, kv, fmt=fmt, recompute=0.2)
    loaded.load(tmp_path / "s.safetensors")
    assert loaded.conversation.documents == documents and len(documents[2]) == 2
    assert loaded.turn("And then?", 6, greedy, io.StringIO(), stop_at_newline=False) == third


def test_bad_documents_are_one_clear_line(parts: tuple, tmp_path: Path) -> None:
    model, tok, fmt = parts
    session = ChatSession(model, tok, KV, fmt=fmt)
    (tmp_path / "empty.txt").write_text("", encoding="utf-8")
    with pytest.raises(ValueError, match="encodes to no tokens"):
        session.attach(tmp_path / "empty.txt")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        session.attach(tmp_path / "missing.txt")
    long_doc = " ".join(["the quick brown fox"] * 200)  # longer than the lossless cache
    session.attached.append(tuple(encode_plain(tok, long_doc)))
    with pytest.raises(ValueError, match="cache is full"):
        session.turn(QUESTION, 4, greedy, io.StringIO())
    assert session.next_pos == 0
    eng = engine(model, tok, fmt, max_documents=2, max_document_tokens=40)
    for docs, expected in [
        (("a", "b", "c"), "at most 2 per request, got 3"),
        (("",), r"documents\[0\] must be a non-empty string"),
        ((DOCS[0] * 3,), "at most 40 tokens in all per request"),
    ]:
        with pytest.raises(RequestError, match=expected) as err:
            serve_turn(eng, docs)
        assert err.value.status == 400 and err.value.param == "documents"
    eng = engine(model, tok, fmt, max_document_tokens=10_000)
    with pytest.raises(RequestError, match="cache's 400 slots") as err:
        serve_turn(eng, (long_doc,))
    assert err.value.code == "context_length_exceeded"


def test_chat_command_block_file_and_attach(ckpt: Path, parts: tuple, tmp_path: Path, monkeypatch, capsys) -> None:  # noqa: ANN001
    model, tok, _ = parts
    files = doc_files(tmp_path)
    fmt = RawFormat(tok)
    expected = io.StringIO()
    session = ChatSession(model, tok, KVCacheConfig(), fmt=fmt, recompute=0.1)
    for f in files:
        session.attach(f)
    session.turn(QUESTION, 6, greedy, expected, stop_at_newline=False)
    args = ["chat", str(ckpt), "--temperature", "0", "--max_new_tokens", "6", "--recompute", "0.1"]
    args += ["--stop_at_newline", "false"]
    outs = []
    for extra, lines in [
        ([a for f in files for a in ("--block_file", str(f))], [QUESTION]),
        ([], [*(f"/attach {f}" for f in files), QUESTION, "/stats"]),
    ]:
        monkeypatch.setattr(sys, "stdin", io.StringIO("".join(line + "\n" for line in lines)))
        main(args + extra)
        outs.append(capsys.readouterr().out)
    assert outs[0].startswith(expected.getvalue()) and expected.getvalue().strip()
    assert outs[1].split("\n", 2)[2].startswith(expected.getvalue())  # after the two "attached" lines
    assert "documents: 0 pieces restored" in outs[1]


def test_chat_command_bad_documents_one_line(ckpt: Path, tmp_path: Path, monkeypatch, capsys) -> None:  # noqa: ANN001
    (tmp_path / "empty.txt").write_text("", encoding="utf-8")
    for args in (["--block_file", str(tmp_path / "missing.txt")], ["--recompute", "2"]):
        monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n"))
        with pytest.raises(SystemExit):
            main(["chat", str(ckpt), *args])
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and ("does not exist" in err[0] or "--recompute must be" in err[0]), err
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"/attach {tmp_path / 'empty.txt'}\n/attach\n"))
    main(["chat", str(ckpt)])
    err = capsys.readouterr().err
    assert "error: document" in err and "encodes to no tokens" in err and "/attach needs a file name" in err
