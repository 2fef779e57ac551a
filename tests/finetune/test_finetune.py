"""`litkv finetune`: CLI parsing (flags and YAML configs), data, exactness of a training step against
plain autograd + AdamW, checkpoint directories, resume, and errors.

Everything runs on a tiny random LLaMA-style model saved in `tmp_path` with a BPE tokenizer trained
in the test.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import jsonargparse
import pytest
import torch
import torch.nn.functional as F
import yaml
from litgpt.utils import save_config
from safetensors.torch import load_file
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

import litkv
from litkv.checkpoints.checkpoint import load_model, load_tokenizer, save_state_dict_atomic
from litkv.cli.finetune_cmd import finetune
from litkv.finetune.data import IGNORE_INDEX, DataArgs, DataOrder, collate, load_examples, split_examples
from litkv.finetune.loop import TrainArgs, lr_at
from litkv.kvcache.config import KVCacheConfig

WORDS = ["the", "a", "cache", "key", "value", "token", "slot", "policy", "keeps", "drops", "attention", "head",
         "layer", "model", "long", "short", "context"]  # fmt: skip
PROMPT_TEXT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request. ### Instruction: ### Input: ### Response:"
)
SEQ = 16
CACHE = ["--kv_cache.policy", "h2o", "--kv_cache.cache_length", "8", "--kv_cache.chunk_size", "4"]


def make_checkpoint(path: Path, seed: int = 0) -> Path:
    """A tiny LLaMA-style checkpoint dir: model.safetensors, model_config.yaml, tokenizer files."""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=100, special_tokens=["[UNK]", "<|endoftext|>"], show_progress=False)
    tokenizer.train_from_iterator([" ".join(WORDS)] * 8 + [PROMPT_TEXT] * 4, trainer)
    tokenizer.save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "add_bos_token": False,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    config = litkv.Config(
        name="tiny-llama",
        n_layer=2,
        n_head=4,
        n_query_groups=2,
        n_embd=32,
        intermediate_size=64,
        block_size=256,
        vocab_size=128,
        padded_vocab_size=128,
        rotary_percentage=1.0,
        bias=False,
        parallel_residual=False,
        norm_class_name="RMSNorm",
        mlp_class_name="LLaMAMLP",
    )
    save_config(config, path)
    torch.manual_seed(seed)
    model = litkv.GPT(config)
    with torch.no_grad():  # peaked attention, so that evictions matter
        for block in model.transformer.h:
            block.attn.qkv.weight.mul_(4.0)
    save_state_dict_atomic(path / "model.safetensors", model.state_dict())
    return path


def write_text(path: Path, n_words: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    path.write_text(" ".join(rng.choice(WORDS) for _ in range(n_words)) + "\n")
    return path


def write_instructions(path: Path, n: int = 6) -> Path:
    rng = random.Random(1)
    records = [
        {
            "instruction": " ".join(rng.choice(WORDS) for _ in range(4)),
            "input": " ".join(rng.choice(WORDS) for _ in range(3)) if i % 2 else "",
            "output": " ".join(rng.choice(WORDS) for _ in range(5)),
        }
        for i in range(n)
    ]
    path.write_text(json.dumps(records))
    return path


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: one intra-op thread is several times faster than two on a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("base"))


def cli(checkpoint_dir: Path, *args: str | Path) -> None:
    jsonargparse.CLI(finetune, args=["--checkpoint_dir", str(checkpoint_dir), *(str(a) for a in args)])


def windows(checkpoint_dir: Path, text_file: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The text cut into `SEQ`-token inputs and next-token targets, computed here independently."""
    tokens = torch.tensor(Tokenizer.from_file(str(checkpoint_dir / "tokenizer.json")).encode(text_file.read_text()).ids)
    n = (len(tokens) - 1) // SEQ
    rows = torch.stack([tokens[i * SEQ : i * SEQ + SEQ + 1] for i in range(n)])
    return rows[:, :-1], rows[:, 1:]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-12))


# -- data ------------------------------------------------------------------------------------------


def test_text_examples_are_shifted_windows(ckpt, tmp_path):
    text = write_text(tmp_path / "t.txt", 100)
    examples = load_examples(DataArgs(path=text, seq_length=SEQ), load_tokenizer(ckpt))
    inputs, targets = windows(ckpt, text)
    assert len(examples) == inputs.shape[0] >= 4
    for (x, y), ref_x, ref_y in zip(examples, inputs, targets, strict=True):
        assert torch.equal(x, ref_x) and torch.equal(y, ref_y)


def test_instruction_examples_mask_the_prompt(ckpt, tmp_path):
    path = write_instructions(tmp_path / "d.json", n=2)
    record = json.loads(path.read_text())[1]
    examples = load_examples(DataArgs(path=path, seq_length=200), load_tokenizer(ckpt))
    hf = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    prompt = hf.encode(
        "Below is an instruction that describes a task, paired with an input that provides further context. "
        f"Write a response that appropriately completes the request.\n\n### Instruction:\n{record['instruction']}"
        f"\n\n### Input:\n{record['input']}\n\n### Response:\n"
    ).ids
    response = hf.encode(record["output"]).ids + [hf.token_to_id("<|endoftext|>")]
    x, y = examples[1]
    assert x.tolist() == (prompt + response)[:-1]
    assert y.tolist() == [IGNORE_INDEX] * (len(prompt) - 1) + response


def test_split_collate_and_order():
    examples = [(torch.arange(n), torch.arange(n) + 1) for n in (3, 5, 4, 2, 6)]
    train, val = split_examples(examples, 0.2, seed=0)
    assert len(train) == 4 and len(val) == 1
    assert sorted(x.numel() for x, _ in train + val) == [2, 3, 4, 5, 6]
    ids, tgt = collate(examples[:2])
    assert ids.tolist() == [[0, 1, 2, 0, 0], [0, 1, 2, 3, 4]]
    assert tgt.tolist() == [[1, 2, 3, -100, -100], [1, 2, 3, 4, 5]]
    order = DataOrder(5, 2, seed=3)
    seen = [i for step in range(5) for i in order.step_indices(step)]
    assert sorted(seen[:5]) == sorted(seen[5:]) == list(range(5))  # each epoch is a permutation
    assert seen[:5] != seen[5:]  # reshuffled per epoch
    assert order.rank_micro_batches(1, rank=1, world_size=2, micro_batch_size=1) == [[order.step_indices(1)[1]]]


def test_lr_schedule():
    train = TrainArgs(max_steps=10, lr=1.0, min_lr=0.1, warmup_steps=2)
    assert [lr_at(s, train) for s in (0, 1)] == [0.5, 1.0]
    assert lr_at(2, train) == pytest.approx(1.0)
    assert lr_at(6, train) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(10, train) == pytest.approx(0.1)


# -- training ------------------------------------------------------------------------------------


def test_full_steps_equal_plain_autograd_and_adamw(ckpt, tmp_path):
    """Two steps with gradient accumulation equal autograd through `forward_chunked` + AdamW."""
    text = write_text(tmp_path / "t.txt", 70)
    inputs, targets = windows(ckpt, text)
    n = inputs.shape[0]
    out = tmp_path / "out"
    train = ["--train.max_steps", "2", "--train.micro_batch_size", "1", "--train.global_batch_size", str(n)]
    train += ["--train.lr", "0.01", "--train.warmup_steps", "0", "--train.weight_decay", "0.1"]
    train += ["--train.max_norm", "null"]
    cli(ckpt, "--mode", "full", "--data.path", text, "--data.seq_length", SEQ, "--data.val_fraction", "0", *CACHE,
        *train, "--out_dir", out)  # fmt: skip

    model = load_model(ckpt)
    model.train()
    kv = KVCacheConfig(policy="h2o", cache_length=8, chunk_size=4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.9, 0.95), weight_decay=0.1)
    for lr in (0.01, 0.5 * 0.01):  # cosine over 2 steps: full, then half
        logits = litkv.forward_chunked(model, inputs, kv)
        F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        optimizer.zero_grad()
    trained = load_file(str(out / "final" / "model.safetensors"))
    assert set(trained) == set(model.state_dict())
    base = load_file(str(ckpt / "model.safetensors"))
    for key, ref in model.state_dict().items():
        assert not torch.equal(base[key], trained[key]) or torch.equal(base[key], ref), key
        assert (trained[key] - ref).abs().max() <= 1e-5 + 1e-4 * ref.abs().max(), key


def test_lora_run_writes_loadable_checkpoints(ckpt, tmp_path):
    text = write_text(tmp_path / "t.txt", 120)
    out = tmp_path / "out"
    cli(ckpt, "--data.path", text, "--data.seq_length", SEQ, "--data.val_fraction", "0.2", *CACHE,
        "--train.max_steps", "2", "--train.global_batch_size", "2", "--train.save_interval", "1",
        "--eval.interval", "1", "--eval.max_iters", "1", "--lora.targets", "[attn.qkv, mlp]",
        "--out_dir", out)  # fmt: skip
    for name in ("step-000001", "step-000002", "final"):
        d = out / name
        assert sorted(p.name for p in d.iterdir()) == sorted(
            [
                "model.safetensors",
                "model_config.yaml",
                "tokenizer.json",
                "tokenizer_config.json",
                "hyperparameters.yaml",
                "lora.safetensors",
                "training_state.pt",
            ]
        ), name  # fmt: skip  (and no temporary files left behind)
        torch.load(d / "training_state.pt", weights_only=True)
    final = out / "final"
    base, merged = load_file(str(ckpt / "model.safetensors")), load_file(str(final / "model.safetensors"))
    assert set(base) == set(merged)
    changed = {k for k in base if not torch.equal(base[k], merged[k])}
    assert changed == {
        k for k in base if k.endswith(("attn.qkv.weight", ".fc_1.weight", ".fc_2.weight", "mlp.proj.weight"))
    }
    adapters = load_file(str(final / "lora.safetensors"))
    assert len(adapters) == 2 * 4 * 2  # (A, B) x (qkv, fc_1, fc_2, proj) x 2 layers
    # `litkv generate` can load and run the final checkpoint.
    model = load_model(final)
    tokens = litkv.generate(
        model, [torch.tensor([3, 4, 5])], 4, KVCacheConfig(policy="h2o", cache_length=8, chunk_size=4)
    )
    assert tokens[0].numel() == 4
    assert (out / "logs").is_dir()


def test_resume_equals_uninterrupted_run(ckpt, tmp_path):
    text = write_text(tmp_path / "t.txt", 150)
    common = [ckpt, "--data.path", text, "--data.seq_length", SEQ, "--data.val_fraction", "0", *CACHE,
              "--train.max_steps", "4", "--train.global_batch_size", "2", "--train.warmup_steps", "1",
              "--eval.interval", "100"]  # fmt: skip
    cli(*common, "--train.save_interval", "1", "--out_dir", tmp_path / "a")
    cli(*common, "--resume", tmp_path / "a" / "step-000002", "--out_dir", tmp_path / "b")
    for name in ("model.safetensors", "lora.safetensors"):
        a, b = load_file(str(tmp_path / "a" / "final" / name)), load_file(str(tmp_path / "b" / "final" / name))
        assert set(a) == set(b)
        for key in a:
            assert torch.equal(a[key], b[key]), (name, key)
    # the resumed run did not start over: step 2's adapters differ from the final ones
    mid = load_file(str(tmp_path / "a" / "step-000002" / "lora.safetensors"))
    assert any(not torch.equal(mid[k], a[k]) for k in mid)
    state = torch.load(tmp_path / "b" / "final" / "training_state.pt", weights_only=True)
    assert state["step"] == 4


def test_instruction_data_and_config_file(ckpt, tmp_path):
    data = write_instructions(tmp_path / "d.json")
    config = {
        "checkpoint_dir": str(ckpt),
        "mode": "lora",
        "data": {"path": str(data), "seq_length": 200, "val_fraction": 0.2, "prompt_style": "alpaca"},
        "kv_cache": {"policy": "last-recent", "cache_length": 16, "chunk_size": 8, "options": {"sinks": 2}},
        "train": {"max_steps": 1, "global_batch_size": 2, "micro_batch_size": 2},
        "lora": {"r": 2, "alpha": 4.0, "targets": ["attn.qkv", "lm_head"]},
        "out_dir": str(tmp_path / "out"),
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    jsonargparse.CLI(finetune, args=["--config", str(tmp_path / "c.yaml")])
    final = tmp_path / "out" / "final"
    assert yaml.safe_load((final / "prompt_style.yaml").read_text())["class_path"] == "litgpt.prompts.Alpaca"
    hparams = yaml.safe_load((final / "hyperparameters.yaml").read_text())
    assert hparams["kv_cache"]["policy"] == "last-recent" and hparams["lora"]["r"] == 2
    # hyperparameters.yaml is itself a valid config, flags after it override it
    parser = jsonargparse.ArgumentParser()
    parser.add_argument("--config", action="config")
    parser.add_function_arguments(finetune)
    cfg = parser.parse_args(["--config", str(final / "hyperparameters.yaml"), "--train.max_steps", "7"])
    assert (
        cfg.train.max_steps == 7
        and cfg.kv_cache.options == {"sinks": 2}
        and cfg.lora.targets == ["attn.qkv", "lm_head"]
    )
    assert Path(cfg.checkpoint_dir) == ckpt and cfg.data.prompt_style == "alpaca"


# -- errors --------------------------------------------------------------------------------------


def test_clear_errors(ckpt, tmp_path):
    text = write_text(tmp_path / "t.txt", 100)
    with pytest.raises(ValueError, match="data.path"):
        finetune(ckpt)
    with pytest.raises(ValueError, match="16-mixed: use bf16-mixed or 16-true"):
        finetune(ckpt, data=DataArgs(path=text, seq_length=SEQ), precision="16-mixed")
    with pytest.raises(ValueError, match="fewer than data.seq_length"):
        load_examples(DataArgs(path=text, seq_length=10_000), load_tokenizer(ckpt))
    with pytest.raises(ValueError, match="multiple of"):
        TrainArgs(micro_batch_size=3, global_batch_size=4)
    with pytest.raises(ValueError, match="prompt_style"):
        DataArgs(prompt_style="nope")
    with pytest.raises(FileNotFoundError, match="training_state.pt"):
        finetune(ckpt, data=DataArgs(path=text, seq_length=SEQ), resume=tmp_path)


@pytest.mark.parametrize("name", ["finetune_lora.yaml", "finetune_full.yaml"])
def test_shipped_configs_parse(name):
    path = Path(__file__).parents[2] / "configs" / name
    parser = jsonargparse.ArgumentParser()
    parser.add_argument("--config", action="config")
    parser.add_function_arguments(finetune)
    cfg = parser.parse_args(["--config", str(path)])
    raw = yaml.safe_load(path.read_text())
    assert cfg.mode == raw["mode"] and cfg.kv_cache.policy == raw["kv_cache"]["policy"] == "h2o"
    assert cfg.train.max_steps == raw["train"]["max_steps"] and cfg.data.seq_length == raw["data"]["seq_length"]
    init = parser.instantiate_classes(cfg)
    assert isinstance(init.kv_cache, KVCacheConfig) and init.kv_cache.cache_length == raw["kv_cache"]["cache_length"]
