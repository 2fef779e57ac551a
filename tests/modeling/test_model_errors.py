"""Bad input: a ValueError/TypeError whose message names the expected and the actual values."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
import torch

from litkv import GPT, KVCacheConfig, forward_chunked, generate
from litkv.kvcache import get_kv_cache_class, known_policies

B = 2


@pytest.fixture
def cached(model: GPT) -> Iterator[GPT]:
    """The model with fresh dense caches of 8 slots for batch size 2 (detached afterwards)."""
    model.set_kv_caches(model.build_kv_caches(_dense(8), B))
    yield model
    model.set_kv_caches(None)


def _dense(cache_length: int, chunk: int = 4) -> KVCacheConfig:
    return KVCacheConfig(policy="dense", cache_length=cache_length, chunk_size=chunk, prefill_length=chunk)


def _tokens(batch: int, length: int) -> torch.Tensor:
    return torch.randint(0, 128, (batch, length))


def _pos(start: int, end: int, batch: int = B) -> torch.Tensor:
    return torch.arange(start, end).expand(batch, -1)


# -- dense cache overflow ----------------------------------------------------------------------


@torch.inference_mode()
def test_dense_overflow(cached: GPT) -> None:
    cached(_tokens(B, 8), _pos(0, 8))
    with pytest.raises(ValueError, match=r"cache_length=8, row 0 holds 8 tokens.*need 9"):
        cached(_tokens(B, 1), _pos(8, 9))


@torch.inference_mode()
def test_dense_overflow_in_forward_chunked(model: GPT) -> None:
    with pytest.raises(ValueError, match=r"cache_length=8.*need 12"):
        forward_chunked(model, _tokens(B, 12), _dense(8))


def test_dense_overflow_in_generate(model: GPT) -> None:
    with pytest.raises(ValueError, match=r"cache_length=8.*\(6 \+ 4\)"):
        generate(model, [torch.arange(6)], max_new_tokens=4, kv_cache=_dense(8))


# -- chunk longer than allowed -----------------------------------------------------------------


@pytest.mark.parametrize("policy", ["dense", "last-recent"])
@torch.inference_mode()
def test_chunk_longer_than_cache(model: GPT, policy: str) -> None:
    kv_cache = KVCacheConfig(policy=policy, cache_length=8, chunk_size=4)
    model.set_kv_caches(model.build_kv_caches(kv_cache, B))
    try:
        with pytest.raises(ValueError, match=r"chunk of 9 tokens.*cache_length=8"):
            model(_tokens(B, 9), _pos(0, 9))
    finally:
        model.set_kv_caches(None)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(chunk_size=9), r"chunk_size=9 and cache_length=8"),
        (dict(chunk_size=4, prefill_length=9), r"prefill_length=9 and cache_length=8"),
        (dict(chunk_size=0), r"chunk_size must be >= 1, got 0"),
    ],
)
def test_chunk_config_longer_than_cache(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KVCacheConfig(policy="dense", cache_length=8, **kwargs)


@pytest.mark.parametrize("cache_length,expected", [(8, 8), (256, 256), (1000, 256)])
def test_default_chunk_size_fits_the_cache(cache_length: int, expected: int) -> None:
    config = KVCacheConfig(policy="h2o", cache_length=cache_length)
    assert config.chunk_size is None and config.chunk_length == expected
    assert config.chunk_bounds(2 * cache_length)[0] == (0, expected)


# -- batch size --------------------------------------------------------------------------------


@torch.inference_mode()
def test_batch_size_differs_from_cache(cached: GPT) -> None:
    with pytest.raises(ValueError, match=r"batch size 2.*batch size 1"):
        cached(_tokens(1, 4), _pos(0, 4, batch=1))


@torch.inference_mode()
def test_batch_size_changes_mid_sequence(cached: GPT) -> None:
    cached(_tokens(B, 4), _pos(0, 4))
    with pytest.raises(ValueError, match=r"batch size.*2.*1"):
        cached(_tokens(1, 1), _pos(4, 5, batch=1))


# -- dtype -------------------------------------------------------------------------------------


@torch.inference_mode()
def test_cache_dtype_differs_from_model(model: GPT) -> None:
    model.set_kv_caches(model.build_kv_caches(_dense(8), B, dtype=torch.bfloat16))
    try:
        with pytest.raises(ValueError, match=r"(?=.*torch\.float32)(?=.*torch\.bfloat16)"):
            model(_tokens(B, 4), _pos(0, 4))
    finally:
        model.set_kv_caches(None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
def test_token_ids_must_be_integers(model: GPT, dtype: torch.dtype) -> None:
    with pytest.raises(TypeError, match=rf"int64.*{re.escape(str(dtype))}"):
        model(torch.zeros(1, 4, dtype=dtype))


# -- token ids ---------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [128, 1000, -1])
@torch.inference_mode()
def test_token_id_outside_vocabulary(model: GPT, bad: int) -> None:
    idx = _tokens(B, 4)
    idx[1, 2] = bad
    with pytest.raises(ValueError, match=rf"token id {bad} .*\[0, 128\)"):
        model(idx)


def test_token_id_outside_vocabulary_in_generate(model: GPT) -> None:
    with pytest.raises(ValueError, match=r"token id 128 .*\[0, 128\)"):
        generate(model, [torch.tensor([1, 2, 128])], max_new_tokens=2, kv_cache=_dense(8))


# -- positions ---------------------------------------------------------------------------------


@torch.inference_mode()
def test_positions_decrease_within_a_call(cached: GPT) -> None:
    pos = torch.tensor([[0, 1, 2], [0, 2, 1]])
    with pytest.raises(ValueError, match=r"row 1 has position 1 at index 2 after position 2"):
        cached(_tokens(B, 3), pos)


@pytest.mark.parametrize("next_pos", [3, 1])
@torch.inference_mode()
def test_positions_do_not_increase_across_calls(cached: GPT, next_pos: int) -> None:
    cached(_tokens(B, 4), _pos(0, 4))
    with pytest.raises(ValueError, match=rf"position {next_pos} at index 0 after position 3"):
        cached(_tokens(B, 1), _pos(next_pos, next_pos + 1))


@torch.inference_mode()
def test_positions_shape_differs_from_idx(cached: GPT) -> None:
    with pytest.raises(ValueError, match=r"\(2, 4\).*\(2, 3\)"):
        cached(_tokens(B, 4), _pos(0, 3))


# -- cache configuration -----------------------------------------------------------------------


@pytest.mark.parametrize("cache_length", [0, -5])
def test_cache_length_not_positive(cache_length: int) -> None:
    with pytest.raises(ValueError, match=rf"cache_length must be >= 1, got {cache_length}"):
        KVCacheConfig(policy="dense", cache_length=cache_length, chunk_size=1)


def test_cache_length_not_an_int() -> None:
    with pytest.raises(TypeError, match=r"cache_length must be an int, got str '8'"):
        KVCacheConfig(policy="dense", cache_length="8")  # type: ignore[arg-type]


def test_unknown_policy_lists_known_ones() -> None:
    known = known_policies()
    assert {"dense", "last-recent"} <= set(known)
    for raises in (lambda: KVCacheConfig(policy="nope"), lambda: get_kv_cache_class("nope")):
        with pytest.raises(ValueError, match=r"'nope'") as info:
            raises()
        assert all(name in str(info.value) for name in known)


@pytest.mark.parametrize(
    "path,message",
    [
        ("no_such_module_xyz:Cache", r"cannot import module 'no_such_module_xyz'"),
        ("litkv.kvcache.dense:Missing", r"'Missing' in 'litkv.kvcache.dense' is not a KVCache subclass"),
        (
            "litkv.modeling.config:KVCacheConfig",
            r"'KVCacheConfig' in 'litkv.modeling.config' is not a KVCache subclass",
        ),
    ],
)
def test_bad_policy_path(model: GPT, path: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        model.build_kv_caches(KVCacheConfig(policy=path, cache_length=8, chunk_size=4), B)


def test_wrong_number_of_layer_configs(model: GPT) -> None:
    with pytest.raises(ValueError, match=r"one KVCacheConfig per layer \(2\), got 3"):
        model.build_kv_caches([_dense(8)] * 3, B)
