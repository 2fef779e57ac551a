#!/usr/bin/env python
"""Train the small default model shipped with litkv in ``litkv/assets/default/``.

The model is a LLaMA-style `litgpt.model.GPT` (RoPE, grouped-query attention, RMSNorm, LLaMAMLP, no
bias) trained on the CPU on the King James Bible (Debian's ``bible-kjv-text``) mixed with synthetic
pass-key recall sequences, so that it is both a language model and able to retrieve a fact from
anywhere in its 1024-token context. The latter makes it useful for judging KV-cache eviction policies.

Usage::

    python scripts/train_default_model.py --out_dir litkv/assets/default --minutes 90

Written to ``out_dir``: ``model.safetensors``, ``model_config.yaml``, ``tokenizer.json``,
``tokenizer_config.json``, ``recall_format.json``, ``heldout.txt`` and ``README.md``.
Intermediate checkpoints go to ``--ckpt_dir`` (``--resume`` continues from the last one).

The pass-key task is defined by `RECALL_FORMAT` (also written to ``recall_format.json``) and built by
`litkv.eval.recall.RecallTask`, the same code that ``litkv evaluate`` rebuilds it with from the JSON file.
Every file is written through `litkv.core.atomic` (a crash never leaves a half-written checkpoint or model).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
import yaml
from litgpt import Config
from litgpt.model import GPT
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm

from litkv.core.atomic import write_atomic, write_text_atomic
from litkv.eval.recall import RECALL_FILE, RecallFormat, RecallTask

EOS_TOKEN = "<|endoftext|>"
KJV_DATA = Path("/usr/lib/bible.data")
KJV_RANGE = "gen1:1-rev22:21"

#: The pass-key recall task. ``{key}`` is a string of ``num_digits`` distinct digits, the first one
#: non-zero. An example of ``length`` tokens is ``filler[:cut] + needle + filler[cut:] + question +
#: answer`` where every part is tokenized on its own (without special tokens) and the token lists are
#: concatenated; ``filler`` is a window of natural text with as many tokens as needed to reach
#: ``length`` and ``cut = round(depth * len(filler))``. The model is scored on greedily decoding the
#: answer tokens.
RECALL_FORMAT: dict[str, Any] = {
    "name": "passkey",
    "version": 1,
    "needle": "\nThe pass key is {key}. Remember it. {key} is the pass key.\n",
    "question": "\nWhat is the pass key? The pass key is",
    "answer": " {key}",
    "num_digits": 5,
    "digits": "0123456789",
    "first_digit_nonzero": True,
    "distinct_digits": True,
    "assembly": "tokens(filler[:cut]) + tokens(needle) + tokens(filler[cut:]) + tokens(question) + tokens(answer)",
    "cut": "round(depth * number_of_filler_tokens), depth in [0, 1]",
    "tokenization": "each part encoded on its own, no BOS/EOS; filler cut at token level",
    "scoring": "correct iff greedy decoding after the question reproduces all answer tokens (space + digits)",
    "filler_file": "heldout.txt",
    "context_length": 1024,
}


@dataclass(frozen=True)
class Stage:
    """One curriculum stage: train on ``seq_len``-token sequences until ``until`` (progress in [0, 1])."""

    until: float
    seq_len: int


CURRICULUM = (Stage(0.3, 128), Stage(0.5, 256), Stage(0.75, 512), Stage(1.0, 1024))


def parse_curriculum(text: str) -> tuple[Stage, ...]:
    """Parse ``"0.12:256,0.3:512,1:1024"`` (progress bound: sequence length, ...) into stages."""
    stages = tuple(Stage(float(a), int(b)) for a, b in (item.split(":") for item in text.split(",")))
    bounds = [s.until for s in stages]
    if not stages or bounds != sorted(bounds) or bounds[-1] != 1.0:
        raise ValueError(f"curriculum bounds must increase to 1.0, got {text!r}")
    return stages


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out_dir", type=Path, default=Path("litkv/assets/default"))
    p.add_argument("--ckpt_dir", type=Path, default=Path(tempfile.gettempdir()) / "litkv_default_ckpt")
    p.add_argument("--minutes", type=float, default=90.0, help="wall-clock budget of the training loop")
    p.add_argument("--steps", type=int, default=None, help="fixed number of steps instead of --minutes")
    p.add_argument("--n_layer", type=int, default=4)
    p.add_argument("--n_embd", type=int, default=128)
    p.add_argument("--n_head", type=int, default=4)
    p.add_argument("--n_query_groups", type=int, default=2)
    p.add_argument("--intermediate_size", type=int, default=384)
    p.add_argument("--block_size", type=int, default=1024)
    p.add_argument("--vocab_size", type=int, default=4096)
    p.add_argument("--curriculum", type=parse_curriculum, default=CURRICULUM, help="e.g. 0.12:256,0.3:512,1:1024")
    p.add_argument("--tokens_per_step", type=int, default=2048)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min_lr", type=float, default=1e-4)
    p.add_argument("--warmup_steps", type=int, default=100)
    p.add_argument("--weight_decay", type=float, default=0.1)
    p.add_argument("--recall_share", type=float, default=0.5, help="share of sequences with a pass key")
    p.add_argument("--copy_share", type=float, default=0.25, help="share of sequences with a copied digit string")
    p.add_argument("--recall_weight", type=float, default=2.0, help="extra loss weight of the answer")
    p.add_argument("--heldout_every", type=int, default=60, help="every n-th chapter is held out")
    p.add_argument("--eval_cases", type=int, default=100)
    p.add_argument("--ckpt_minutes", type=float, default=5.0)
    p.add_argument("--log_every", type=int, default=25)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--resume", action="store_true", help="continue from --ckpt_dir/last.pt")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------- corpus
def kjv_lines() -> list[str]:
    """Return the KJV as ``"<ref> <text>"`` lines, installing Debian's ``bible-kjv`` if needed."""
    if shutil.which("bible") is None or not KJV_DATA.is_file():
        tqdm.write("installing bible-kjv with apt-get ...")
        subprocess.run(["apt-get", "update", "-qq"], check=True)
        subprocess.run(["apt-get", "install", "-y", "-qq", "bible-kjv", "bible-kjv-text"], check=True)
    out = subprocess.run(["bible", "-f", KJV_RANGE], check=True, capture_output=True, text=True).stdout
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    if len(lines) != 31102:
        raise RuntimeError(f"expected 31102 KJV verses, got {len(lines)}")
    return lines


def kjv_chapters(lines: Sequence[str]) -> list[str]:
    """Group verse lines into chapters: one verse per line, references removed."""
    chapters: list[list[str]] = []
    current = None
    for line in lines:
        ref, text = line.split(" ", 1)
        chapter = ref.rsplit(":", 1)[0]
        if chapter != current:
            chapters.append([])
            current = chapter
        chapters[-1].append(text)
    return ["\n".join(verses) + "\n" for verses in chapters]


def split_corpus(chapters: Sequence[str], heldout_every: int) -> tuple[str, str]:
    """Split chapters into (train text, held-out text); every ``heldout_every``-th chapter is held out."""
    train = [c for i, c in enumerate(chapters) if i % heldout_every != heldout_every // 2]
    heldout = [c for i, c in enumerate(chapters) if i % heldout_every == heldout_every // 2]
    return "\n".join(train), "\n".join(heldout)


# -------------------------------------------------------------------------------------------- tokenizer
def train_tokenizer(text: str, vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE tokenizer (digits split one by one) with ``<|endoftext|>``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(text.split("\n\n"), trainer=trainer)
    return tok


def save_tokenizer(tok: Tokenizer, out_dir: Path, block_size: int) -> None:
    """Write ``tokenizer.json`` and a ``tokenizer_config.json`` that `litgpt.tokenizer.Tokenizer` reads."""
    write_atomic(out_dir / "tokenizer.json", lambda tmp: tok.save(str(tmp)))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": block_size,
        "clean_up_tokenization_spaces": False,
    }
    write_text_atomic(out_dir / "tokenizer_config.json", json.dumps(config, indent=2) + "\n")


def encode(tok: Tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens."""
    return tok.encode(text, add_special_tokens=False).ids


# --------------------------------------------------------------------------------------- recall task
def recall_task(tok: Tokenizer) -> RecallTask:
    """`litkv.eval.recall.RecallTask` for `RECALL_FORMAT` on a `tokenizers.Tokenizer` (windows passed per example)."""
    return RecallTask(RecallFormat.from_dict(RECALL_FORMAT), SimpleNamespace(backend="huggingface", processor=tok), [])


def make_copy_example(
    tok: Tokenizer, filler_ids: Sequence[int], length: int, rng: random.Random, max_digits: int = 10
) -> tuple[list[int], list[int]]:
    """Natural text with one string of 5 to ``max_digits`` distinct digits written twice at random places.

    An auxiliary training row (not part of the recall task): the second copy can only be predicted by
    finding the first one by content, which teaches the copying (induction) that pass-key recall needs,
    with more copy targets per row and no fixed distance to shortcut it.

    Returns:
        ``(ids, targets)``: ``length`` token ids and the indices of the predictable copied tokens.
    """
    string = encode(tok, " " + "".join(rng.sample("0123456789", rng.randint(5, max_digits))))
    n_fill = length - 2 * len(string)
    if n_fill < 0 or len(filler_ids) < n_fill:
        raise ValueError(f"cannot build {length} tokens from {len(filler_ids)} filler tokens")
    first, second = sorted(rng.randint(0, n_fill) for _ in range(2))
    filler = list(filler_ids[:n_fill])
    ids = filler[:first] + string + filler[first:second] + string + filler[second:]
    begin = second + len(string)
    return ids, list(range(begin + 1, begin + len(string)))


def sample_row(
    tok: Tokenizer,
    task: RecallTask,
    data: torch.Tensor,
    seq_len: int,
    shares: tuple[float, float],
    rng: random.Random,
) -> tuple[list[int], list[int]]:
    """One training row of ``seq_len + 1`` tokens and the indices of its recall targets.

    ``shares`` are the probabilities of a pass-key row and of a copy row; other rows are plain text.
    """
    start = rng.randrange(len(data) - seq_len - 1)
    ids = data[start : start + seq_len + 1].tolist()
    draw = rng.random()
    if draw < shares[0]:
        example = task.make_example(ids, seq_len + 1, rng.random(), task.random_key(rng))
        return example.ids, list(range(example.answer_start, seq_len + 1))
    if draw < shares[0] + shares[1]:
        return make_copy_example(tok, ids, seq_len + 1, rng)
    return ids, []


def sample_batch(
    tok: Tokenizer,
    task: RecallTask,
    data: torch.Tensor,
    seq_len: int,
    batch_size: int,
    shares: tuple[float, float],
    rng: random.Random,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample ``(inputs, targets, recall_mask)``; ``recall_mask`` marks targets with extra loss."""
    rows, masks = [], []
    for _ in range(batch_size):
        ids, targets = sample_row(tok, task, data, seq_len, shares, rng)
        mask = torch.zeros(seq_len, dtype=torch.bool)
        mask[[t - 1 for t in targets]] = True
        rows.append(ids)
        masks.append(mask)
    batch = torch.tensor(rows, dtype=torch.long)
    return batch[:, :-1], batch[:, 1:], torch.stack(masks)


# ---------------------------------------------------------------------------------------------- model
def make_config(args: argparse.Namespace, vocab_size: int) -> Config:
    """The LLaMA-style model configuration."""
    return Config(
        name="litkv-default",
        block_size=args.block_size,
        vocab_size=vocab_size,
        padding_multiple=64,
        n_layer=args.n_layer,
        n_embd=args.n_embd,
        n_head=args.n_head,
        n_query_groups=args.n_query_groups,
        rotary_percentage=1.0,
        rope_base=10000,
        parallel_residual=False,
        bias=False,
        norm_class_name="RMSNorm",
        norm_eps=1e-5,
        mlp_class_name="LLaMAMLP",
        intermediate_size=args.intermediate_size,
    )


def init_weights(model: GPT, config: Config) -> None:
    """GPT-2 style init: N(0, 0.02), output projections scaled by 1/sqrt(2 * n_layer)."""
    for name, param in model.named_parameters():
        if param.ndim < 2:
            continue
        std = 0.02 / math.sqrt(2 * config.n_layer) if name.endswith("proj.weight") else 0.02
        torch.nn.init.normal_(param, mean=0.0, std=std)


def make_optimizer(model: GPT, args: argparse.Namespace) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)


def learning_rate(step: int, progress: float, args: argparse.Namespace) -> float:
    """Linear warmup over ``warmup_steps``, then cosine decay to ``min_lr`` over the progress."""
    cosine = args.min_lr + 0.5 * (args.lr - args.min_lr) * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return cosine * min(1.0, (step + 1) / args.warmup_steps)


def stage_at(progress: float, curriculum: Sequence[Stage]) -> Stage:
    """The curriculum stage at a given progress."""
    return next((s for s in curriculum if progress < s.until), curriculum[-1])


def loss_fn(
    model: GPT, x: torch.Tensor, y: torch.Tensor, answer_mask: torch.Tensor, recall_weight: float
) -> tuple[torch.Tensor, float, float]:
    """Language-model loss plus ``recall_weight`` times the loss on the answer tokens."""
    logits = model(x)
    nll = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view_as(y)
    lm = nll.mean()
    recall = nll[answer_mask].mean() if answer_mask.any() else torch.zeros(())
    return lm + recall_weight * recall, lm.item(), recall.item()


# ----------------------------------------------------------------------------------------- evaluation
@torch.no_grad()
def perplexity(model: GPT, ids: torch.Tensor, block_size: int) -> float:
    """Perplexity on ``ids`` split into non-overlapping windows of ``block_size`` (+1) tokens."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, block_size):
        window = ids[start : start + block_size + 1].long().unsqueeze(0)
        if window.size(1) < 2:
            break
        logits = model(window[:, :-1])
        nll = F.cross_entropy(logits[0], window[0, 1:], reduction="sum")
        total, count = total + nll.item(), count + window.size(1) - 1
    model.train()
    return math.exp(total / count)


@torch.no_grad()
def recall_accuracy(
    model: GPT, task: RecallTask, filler: torch.Tensor, length: int, cases: int, seed: int
) -> tuple[float, dict[float, float]]:
    """Share of pass keys recalled exactly (greedy) at ``length`` tokens; also per needle depth.

    Greedy decoding reproduces the answer iff the argmax at every answer position (with the answer
    fed in) is the answer token, so one dense forward pass per case decides it exactly.
    """
    model.eval()
    rng = random.Random(seed)
    depths = [i / 9 for i in range(10)]
    hits: dict[float, list[bool]] = {d: [] for d in depths}
    for i in range(cases):
        depth = depths[i % len(depths)]
        start = rng.randrange(len(filler) - length)
        window = filler[start : start + length].tolist()
        example = task.make_example(window, length, depth, task.random_key(rng))
        logits = model(torch.tensor([example.ids[:-1]]))[0]
        predicted = logits[example.answer_start - 1 :].argmax(-1).tolist()
        hits[depth].append(predicted == example.answer)
    model.train()
    per_depth = {d: sum(h) / len(h) for d, h in hits.items() if h}
    return sum(sum(h) for h in hits.values()) / cases, per_depth


@torch.no_grad()
def sample_text(model: GPT, tok: Tokenizer, prompt: str, new_tokens: int, seed: int) -> str:
    """Sample a continuation (temperature 0.8, top-k 40) with plain dense forward passes."""
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    ids = encode(tok, prompt)
    for _ in range(new_tokens):
        logits = model(torch.tensor([ids[-model.config.block_size :]]))[0, -1] / 0.8
        top = torch.topk(logits, 40)
        choice = torch.multinomial(torch.softmax(top.values, -1), 1, generator=gen)
        ids.append(int(top.indices[choice]))
    model.train()
    return tok.decode(ids)


# ------------------------------------------------------------------------------------------- training
@dataclass
class Data:
    """Tokenizer, the pass-key task and token streams."""

    tok: Tokenizer
    task: RecallTask
    train: torch.Tensor
    heldout: torch.Tensor


@dataclass
class TrainState:
    """Progress of the training loop (saved in checkpoints)."""

    step: int = 0
    elapsed: float = 0.0
    tokens: int = 0


def save_checkpoint(path: Path, model: GPT, opt: torch.optim.Optimizer, state: TrainState, rng: random.Random) -> None:
    """Save model, optimizer, progress and RNG state (written atomically: `litkv.core.atomic`)."""
    version, internal, gauss = rng.getstate()
    payload = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "state": asdict(state),
        "rng": {"version": version, "internal": list(internal), "gauss": gauss},
    }
    write_atomic(path, lambda tmp: torch.save(payload, tmp))


def load_checkpoint(path: Path, model: GPT, opt: torch.optim.Optimizer, rng: random.Random) -> TrainState:
    """Restore what `save_checkpoint` saved; return the progress."""
    payload = torch.load(path, weights_only=True)
    model.load_state_dict(payload["model"])
    opt.load_state_dict(payload["optimizer"])
    r = payload["rng"]
    rng.setstate((r["version"], tuple(r["internal"]), r["gauss"]))
    return TrainState(**payload["state"])


def train_step(
    model: GPT,
    opt: torch.optim.Optimizer,
    data: Data,
    args: argparse.Namespace,
    lr: float,
    seq_len: int,
    rng: random.Random,
) -> tuple[float, float]:
    """One optimizer step on a fresh batch; returns (LM loss, answer loss)."""
    for group in opt.param_groups:
        group["lr"] = lr
    batch_size = max(1, args.tokens_per_step // seq_len)
    shares = (args.recall_share, args.copy_share)
    x, y, mask = sample_batch(data.tok, data.task, data.train, seq_len, batch_size, shares, rng)
    loss, lm, recall = loss_fn(model, x, y, mask, args.recall_weight)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return lm, recall


def train(model: GPT, data: Data, args: argparse.Namespace, rng: random.Random) -> TrainState:
    """Train until ``--steps`` steps or ``--minutes`` minutes; checkpoint every ``--ckpt_minutes``."""
    opt = make_optimizer(model, args)
    ckpt = args.ckpt_dir / "last.pt"
    state = load_checkpoint(ckpt, model, opt, rng) if args.resume and ckpt.is_file() else TrainState()
    budget = args.minutes * 60.0
    total = args.steps or int(budget)
    bar = tqdm(
        total=total,
        initial=min(state.step if args.steps else int(state.elapsed), total),
        unit="step" if args.steps else "s",
        mininterval=15.0,
        dynamic_ncols=True,
    )
    t0, last_ckpt, avg = time.monotonic() - state.elapsed, time.monotonic(), [0.0, 0.0]
    while (progress := state.step / args.steps if args.steps else state.elapsed / budget) < 1.0:
        stage, lr = stage_at(progress, args.curriculum), learning_rate(state.step, progress, args)
        lm, recall = train_step(model, opt, data, args, lr, stage.seq_len, rng)
        avg = [0.9 * avg[0] + 0.1 * lm, 0.9 * avg[1] + 0.1 * recall] if state.step else [lm, recall]
        before = state.step if args.steps else int(state.elapsed)
        state.step, state.elapsed = state.step + 1, time.monotonic() - t0
        state.tokens += max(1, args.tokens_per_step // stage.seq_len) * stage.seq_len
        bar.update(min(state.step if args.steps else int(state.elapsed), total) - before)
        bar.set_postfix(step=state.step, seq=stage.seq_len, lm=f"{avg[0]:.3f}", ans=f"{avg[1]:.3f}", refresh=False)
        if state.step % args.log_every == 0:
            tqdm.write(
                f"step {state.step} t={state.elapsed / 60:.1f}min seq={stage.seq_len} lr={lr:.2e} "
                f"lm={avg[0]:.3f} answer={avg[1]:.3f} tokens={state.tokens}"
            )
        if time.monotonic() - last_ckpt > args.ckpt_minutes * 60:
            save_checkpoint(ckpt, model, opt, state, rng)
            acc, _ = recall_accuracy(model, data.task, data.heldout, stage.seq_len, 20, args.seed)
            tqdm.write(f"checkpoint step {state.step}: recall@{stage.seq_len} (20 cases) = {acc:.2f}")
            last_ckpt = time.monotonic()
    bar.close()
    save_checkpoint(ckpt, model, opt, state, rng)
    return state


# --------------------------------------------------------------------------------------------- export
def evaluate(model: GPT, data: Data, args: argparse.Namespace) -> dict[str, Any]:
    """Held-out perplexity, recall accuracy at the full context length, and a text sample."""
    block = model.config.block_size
    ppl = perplexity(model, data.heldout, block)
    acc, per_depth = recall_accuracy(model, data.task, data.heldout, block, args.eval_cases, args.seed + 1)
    sample = sample_text(model, data.tok, "And God said", 80, args.seed)
    return {"val_ppl": ppl, "recall": acc, "recall_per_depth": per_depth, "sample": sample}


def check_litgpt_tokenizer(out_dir: Path, text: str) -> None:
    """Load the saved tokenizer with `litgpt.tokenizer.Tokenizer` and check it round-trips ``text``."""
    from litgpt.tokenizer import Tokenizer as LitTokenizer

    lit = LitTokenizer(out_dir)
    ids = lit.encode(text)
    if lit.decode(ids) != text or lit.eos_id is None or lit.use_bos:
        raise RuntimeError("litgpt.tokenizer.Tokenizer does not round-trip the saved tokenizer")


def save_model(model: GPT, config: Config, out_dir: Path, dtype: str) -> None:
    """Write ``model.safetensors`` and ``model_config.yaml`` (as litgpt's ``save_config`` does)."""
    tensors = {k: v.detach().to(getattr(torch, dtype)).contiguous() for k, v in model.state_dict().items()}
    write_atomic(out_dir / "model.safetensors", lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}))
    write_text_atomic(out_dir / "model_config.yaml", yaml.safe_dump(asdict(config)))


def export(model: GPT, config: Config, data: Data, args: argparse.Namespace, heldout_text: str) -> None:
    """Write every shipped file except the model card."""
    out = args.out_dir
    save_model(model, config, out, args.dtype)
    save_tokenizer(data.tok, out, config.block_size)
    check_litgpt_tokenizer(out, heldout_text[:2000])
    fmt = {**RECALL_FORMAT, "context_length": config.block_size}
    write_text_atomic(out / RECALL_FILE, json.dumps(fmt, indent=2) + "\n")
    write_text_atomic(out / "heldout.txt", heldout_text)


def model_card(config: Config, args: argparse.Namespace, state: TrainState, res: dict[str, Any]) -> str:
    """The README.md of the shipped model."""
    n_params = res["n_params"]
    depths = ", ".join(f"{d:.2f}: {a:.2f}" for d, a in res["recall_per_depth"].items())
    sample = res["sample"].replace("\n", "\n    ")
    return f"""# litkv default model

A small LLaMA-style GPT shipped with litkv so that KV-cache policies can be tried and compared
without downloading anything. Load it like any LitGPT checkpoint directory.

## Architecture

`litgpt.Config` in `model_config.yaml` (`litgpt.model.GPT` state dict in `model.safetensors`,
{args.dtype}): {config.n_layer} layers, n_embd {config.n_embd}, {config.n_head} query heads and
{config.n_query_groups} KV groups (grouped-query attention, head size {config.head_size}), RoPE on the
full head (base {config.rope_base}), RMSNorm, LLaMAMLP (intermediate size {config.intermediate_size}),
no bias, untied embeddings, block size {config.block_size}, vocabulary {config.vocab_size}
(padded {config.padded_vocab_size}). {n_params / 1e6:.2f}M parameters.

Tokenizer: byte-level BPE trained with Hugging Face `tokenizers` on the training text, digits split
into single tokens, `<|endoftext|>` as BOS/EOS, no BOS added (`tokenizer.json`,
`tokenizer_config.json`; loads with `litgpt.tokenizer.Tokenizer`).

## Corpus

- The King James Bible (public domain; Debian package `bible-kjv-text`), one verse per line, verse
  references removed. Every {args.heldout_every}th chapter is held out: `heldout.txt`, never trained on.
- Synthetic pass-key recall sequences ({args.recall_share:.0%} of training sequences): a key of 5 distinct digits in
  the sentence `The pass key is 48213. Remember it. 48213 is the pass key.` at a random depth in
  Bible text, and at the end `What is the pass key? The pass key is` followed by the key. The exact
  format is in `recall_format.json`; `litkv.eval.recall.RecallTask` builds it.
- Auxiliary copy sequences ({args.copy_share:.0%}): Bible text with a string of 5 to 10 distinct digits
  written twice at random places (teaches content-based copying). The rest is plain Bible text.

## Training

CPU only ({args.threads} threads), `scripts/train_default_model.py`, seed {args.seed}: {state.step}
steps, {state.elapsed / 60:.1f} minutes, {state.tokens / 1e6:.1f}M tokens, about {args.tokens_per_step}
tokens per step. Curriculum on sequence length: {", ".join(f"{s.seq_len} until {s.until:.0%}" for s in args.curriculum)}
of the budget. AdamW (betas 0.9/0.95, weight decay {args.weight_decay}), {args.warmup_steps} warmup
steps, cosine from {args.lr} to {args.min_lr}; loss = LM loss + {args.recall_weight} x loss on the answer
and copied digits.

## Scores (dense attention, plain `litgpt.model.GPT` forward)

- Validation perplexity on `heldout.txt` (windows of {config.block_size} tokens): {res["val_ppl"]:.2f}
- Pass-key recall at {config.block_size} tokens, {args.eval_cases} held-out cases, all digits greedy:
  {res["recall"]:.2%} (by needle depth: {depths})

Sample (prompt "And God said", temperature 0.8, top-k 40):

    {sample}

This is a toy model for testing and comparing KV caches, not for any real use.
"""


def prepare_data(args: argparse.Namespace) -> tuple[Data, str]:
    """Build the corpus, train the tokenizer and tokenize; returns the data and the held-out text."""
    train_text, heldout_text = split_corpus(kjv_chapters(kjv_lines()), args.heldout_every)
    tok = train_tokenizer(train_text, args.vocab_size)
    train_ids = torch.tensor(encode(tok, train_text), dtype=torch.int32)
    heldout_ids = torch.tensor(encode(tok, heldout_text), dtype=torch.int32)
    tqdm.write(f"corpus: {len(train_ids)} training tokens, {len(heldout_ids)} held-out tokens")
    return Data(tok, recall_task(tok), train_ids, heldout_ids), heldout_text


def main(argv: Sequence[str] | None = None) -> None:
    """Train, evaluate and export the default model."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    data, heldout_text = prepare_data(args)
    config = make_config(args, data.tok.get_vocab_size())
    model = GPT(config)
    init_weights(model, config)
    n_params = sum(p.numel() for p in model.parameters())
    tqdm.write(f"model: {n_params / 1e6:.2f}M parameters, {config.n_layer} layers, n_embd {config.n_embd}")
    state = train(model, data, args, rng)
    results = {**evaluate(model, data, args), "n_params": n_params}
    export(model, config, data, args, heldout_text)
    write_text_atomic(args.out_dir / "README.md", model_card(config, args, state, results))
    print(f"trained {state.step} steps in {state.elapsed / 60:.1f} min ({state.tokens} tokens)")
    print(f"validation perplexity: {results['val_ppl']:.2f}")
    print(f"recall accuracy @ {config.block_size} tokens: {results['recall']:.2%} ({args.eval_cases} cases)")
    print("recall by depth: " + ", ".join(f"{d:.2f}={a:.2f}" for d, a in results["recall_per_depth"].items()))
    print(f"sample: {results['sample']}")


if __name__ == "__main__":
    main()
