"""`chunked_loss_backward` against plain autograd through `forward_chunked` and the full-sequence loss."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

import litkv
from litkv.gradient import chunked_loss_backward
from litkv.kvcache.config import KVCacheConfig

B, T, VOCAB = 2, 40, 64
TOLERANCE = 1e-4

_POLICY_MODULES = {"h2o": "litkv.kvcache.h2o", "qh2o": "litkv.kvcache.qh2o"}


def _require(policy: str, storage: str) -> None:
    module = _POLICY_MODULES.get(policy)
    if module is not None and importlib.util.find_spec(module) is None:
        pytest.skip(f"policy {policy!r}: {module} does not exist yet")
    if storage != "float" and importlib.util.find_spec("litkv.kvcache.quantized") is None:
        pytest.skip(f"storage {storage!r}: litkv.kvcache.quantized does not exist yet")


def _model(seed: int = 0) -> litkv.GPT:
    torch.manual_seed(seed)
    config = litkv.Config(
        n_layer=2,
        n_head=4,
        n_query_groups=2,
        n_embd=32,
        block_size=256,
        vocab_size=VOCAB,
        padded_vocab_size=VOCAB,
        rotary_percentage=1.0,
    )
    model = litkv.GPT(config)
    # Larger weights than the default init make attention peaked, so evictions change the result.
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.qkv.weight.mul_(4.0)
    return model


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models: one intra-op thread is faster than two on a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model() -> litkv.GPT:
    return _model()


@pytest.fixture(scope="module")
def batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, VOCAB, (B, T), generator=gen)
    targets = torch.randint(0, VOCAB, (B, T), generator=gen)
    targets[0, :6] = -100
    targets[1, 25:31] = -100
    targets[1, -1] = -100
    return idx, targets


def _grads(model: litkv.GPT) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _reference(model: litkv.GPT, idx: torch.Tensor, targets: torch.Tensor, kv_cache) -> tuple[float, dict]:
    """Plain autograd through `forward_chunked` (or the full-sequence forward when `kv_cache` is None)."""
    model.zero_grad(set_to_none=True)
    logits = model(idx) if kv_cache is None else litkv.forward_chunked(model, idx, kv_cache)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    loss.backward()
    return loss.item(), _grads(model)


def _engine(model: litkv.GPT, idx: torch.Tensor, targets: torch.Tensor, kv_cache) -> tuple[float, dict]:
    model.zero_grad(set_to_none=True)
    loss = chunked_loss_backward(model, idx, targets, kv_cache)
    return loss, _grads(model)


def _max_rel_error(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    assert actual.keys() == expected.keys()
    errors = []
    for name, ref in expected.items():
        scale = ref.abs().max().clamp(min=1e-12)
        errors.append(float((actual[name] - ref).abs().max() / scale))
    return max(errors)


# Config options, and whether tokens get evicted (or stored lossily) for T = 40.
CASES = [
    pytest.param(
        dict(policy="dense", cache_length=48, chunk_size=8, prefill_length=12), False, id="dense-prefill12-chunk8"
    ),
    pytest.param(dict(policy="dense", cache_length=40, chunk_size=5), False, id="dense-chunk5"),
    pytest.param(
        dict(policy="last-recent", cache_length=16, chunk_size=5, prefill_length=7, options=dict(sinks=2)),
        True,
        id="last-recent-sinks-p7-c5",
    ),
    pytest.param(
        dict(policy="last-recent", cache_length=16, chunk_size=16, options=dict(sinks=3)),
        True,
        id="last-recent-sinks-c16",
    ),
    pytest.param(dict(policy="last-recent", cache_length=12, chunk_size=3), True, id="last-recent-c3"),
    pytest.param(
        dict(policy="last-recent", cache_length=16, chunk_size=4, storage="int4", quant_group_size=4),
        True,
        id="last-recent-int4",
    ),
    pytest.param(dict(policy="h2o", cache_length=16, chunk_size=4), True, id="h2o-c4"),
    pytest.param(dict(policy="h2o", cache_length=16, chunk_size=7, prefill_length=10), True, id="h2o-p10-c7"),
    pytest.param(
        dict(policy="h2o", cache_length=16, chunk_size=4, options=dict(recent=4, normalize_scores=True)),
        True,
        id="h2o-recent4-norm",
    ),
    pytest.param(
        dict(policy="h2o", cache_length=16, chunk_size=5, storage="int8", quant_group_size=4), True, id="h2o-int8"
    ),
    pytest.param(
        dict(policy="qh2o", cache_length=16, chunk_size=4, storage="int8", quant_group_size=4), True, id="qh2o-int8-c4"
    ),
    pytest.param(
        dict(policy="qh2o", cache_length=16, chunk_size=6, prefill_length=9, storage="int4", quant_group_size=4),
        True,
        id="qh2o-int4-p9-c6",
    ),
    pytest.param(  # qh2o switches float storage to int4 itself: the engine must follow the cache
        dict(policy="qh2o", cache_length=16, chunk_size=5),
        True,
        id="qh2o-default-storage",
        marks=pytest.mark.filterwarnings("ignore:policy 'qh2o' needs quantised storage"),
    ),
]


@pytest.mark.parametrize(("options", "evicts"), CASES)
def test_matches_autograd_through_forward_chunked(model, batch, options, evicts):
    _require(options["policy"], options.get("storage", "float"))
    kv_cache = KVCacheConfig(**options)
    idx, targets = batch
    ref_loss, ref_grads = _reference(model, idx, targets, kv_cache)
    loss, grads = _engine(model, idx, targets, kv_cache)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert len(grads) == len(list(model.parameters()))
    assert _max_rel_error(grads, ref_grads) <= TOLERANCE
    # The case must exercise what it claims: with evictions (or lossy storage) the chunked gradient is
    # not the full-sequence one; without, it is (checked in the next test).
    if evicts:
        _, full_grads = _reference(model, idx, targets, None)
        assert _max_rel_error(grads, full_grads) > 1e-3


FULL_CASES = [
    dict(policy="dense", cache_length=40, chunk_size=6, prefill_length=10),
    dict(policy="last-recent", cache_length=64, chunk_size=16, options=dict(sinks=2)),
    dict(policy="h2o", cache_length=40, chunk_size=8),
]


@pytest.mark.parametrize("options", FULL_CASES, ids=[c["policy"] for c in FULL_CASES])
def test_cache_as_long_as_sequence_matches_full_model(model, batch, options):
    _require(options["policy"], "float")
    idx, targets = batch
    ref_loss, ref_grads = _reference(model, idx, targets, None)
    loss, grads = _engine(model, idx, targets, KVCacheConfig(**options))
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert _max_rel_error(grads, ref_grads) <= TOLERANCE


def test_gemma_style_model(batch):
    """Sliding-window layer, attention and final logit soft-capping, RMSNorm, post norms, one KV group."""
    _require("h2o", "float")
    torch.manual_seed(6)
    config = litkv.Config(
        n_layer=2,
        n_head=4,
        n_query_groups=1,
        n_embd=32,
        block_size=256,
        vocab_size=VOCAB,
        padded_vocab_size=VOCAB,
        rotary_percentage=1.0,
        bias=False,
        norm_class_name="RMSNorm",
        mlp_class_name="LLaMAMLP",
        intermediate_size=64,
        parallel_residual=False,
        post_attention_norm=True,
        post_mlp_norm=True,
        sliding_window_size=6,
        sliding_window_indices=[1, 0],
        attention_logit_softcapping=20.0,
        final_logit_softcapping=15.0,
    )
    model = litkv.GPT(config)
    idx, targets = batch
    for kv_cache in (
        KVCacheConfig(policy="h2o", cache_length=16, chunk_size=5),
        KVCacheConfig(policy="last-recent", cache_length=12, chunk_size=4, options=dict(sinks=2)),
    ):
        ref_loss, ref_grads = _reference(model, idx, targets, kv_cache)
        loss, grads = _engine(model, idx, targets, kv_cache)
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        assert _max_rel_error(grads, ref_grads) <= TOLERANCE


def test_per_layer_configs(model, batch):
    _require("h2o", "float")
    configs = [
        KVCacheConfig(policy="h2o", cache_length=16, chunk_size=4),
        KVCacheConfig(policy="last-recent", cache_length=12, chunk_size=4, options=dict(sinks=1)),
    ]
    idx, targets = batch
    ref_loss, ref_grads = _reference(model, idx, targets, configs)
    loss, grads = _engine(model, idx, targets, configs)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert _max_rel_error(grads, ref_grads) <= TOLERANCE


def test_only_trainable_parameters_receive_gradients(batch):
    model = _model(seed=3)
    trainable = {"transformer.h.0.attn.qkv.weight", "transformer.h.1.mlp.fc.bias", "lm_head.weight"}
    for name, p in model.named_parameters():
        p.requires_grad_(name in trainable)
    kv_cache = KVCacheConfig(policy="last-recent", cache_length=16, chunk_size=5, options=dict(sinks=2))
    idx, targets = batch
    _, ref_grads = _reference(model, idx, targets, kv_cache)
    _, grads = _engine(model, idx, targets, kv_cache)
    assert set(grads) == trainable
    assert _max_rel_error(grads, ref_grads) <= TOLERANCE


def test_lora_adapters_only(batch):
    if importlib.util.find_spec("litkv.finetune.lora") is None:
        pytest.skip("litkv.finetune.lora does not exist yet")
    from litkv.finetune.lora import LoRAArgs, apply_lora, mark_only_lora_as_trainable

    model = _model(seed=5)
    apply_lora(model, LoRAArgs(r=2, alpha=4.0, targets=["attn.qkv", "attn.proj", "mlp", "lm_head"]))
    mark_only_lora_as_trainable(model)
    with torch.no_grad():  # lora_B starts at zero, which would make every lora_A gradient zero
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(std=0.5)
    adapters = {n for n, _ in model.named_parameters() if n.endswith(("lora_A", "lora_B"))}
    assert len(adapters) == 2 * 2 * 4 + 2
    kv_cache = KVCacheConfig(policy="last-recent", cache_length=16, chunk_size=5, options=dict(sinks=1))
    idx, targets = batch
    ref_loss, ref_grads = _reference(model, idx, targets, kv_cache)
    loss, grads = _engine(model, idx, targets, kv_cache)
    assert set(grads) == adapters
    assert all(bool(g.abs().max() > 0) for g in grads.values())
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert _max_rel_error(grads, ref_grads) <= TOLERANCE


def test_accumulates_and_scales(model, batch):
    kv_cache = KVCacheConfig(policy="last-recent", cache_length=16, chunk_size=8)
    idx, targets = batch
    _, once = _engine(model, idx, targets, kv_cache)
    model.zero_grad(set_to_none=True)
    first = chunked_loss_backward(model, idx, targets, kv_cache, loss_scale=0.25)
    second = chunked_loss_backward(model, idx, targets, kv_cache, loss_scale=0.75)
    assert first == second
    assert _max_rel_error(_grads(model), once) <= TOLERANCE
    assert all(cache is None for cache in model.kv_caches)


def test_bad_inputs(model, batch):
    idx, targets = batch
    kv_cache = KVCacheConfig(policy="last-recent", cache_length=16, chunk_size=8)
    with pytest.raises(ValueError, match="shape of input_ids"):
        chunked_loss_backward(model, idx, targets[:, :-1], kv_cache)
    with pytest.raises(ValueError, match=r"target id 64 is outside the vocabulary"):
        chunked_loss_backward(model, idx, torch.full_like(targets, VOCAB), kv_cache)
    with pytest.raises(ValueError, match="every target is -100"):
        chunked_loss_backward(model, idx, torch.full_like(targets, -100), kv_cache)
    with pytest.raises(TypeError, match="int64 tensor"):
        chunked_loss_backward(model, idx.float(), targets, kv_cache)
    with pytest.raises(ValueError, match=r"one KVCacheConfig per layer \(2\), got 1"):
        chunked_loss_backward(model, idx, targets, [kv_cache])
    with pytest.raises(TypeError, match="litkv GPT"):
        chunked_loss_backward(torch.nn.Linear(2, 2), idx, targets, kv_cache)  # type: ignore[arg-type]


def test_no_trainable_parameter(batch):
    model = _model(seed=4).requires_grad_(False)
    idx, targets = batch
    with pytest.raises(ValueError, match="no parameter of the model requires grad"):
        chunked_loss_backward(model, idx, targets, KVCacheConfig(policy="dense", cache_length=40, chunk_size=8))
