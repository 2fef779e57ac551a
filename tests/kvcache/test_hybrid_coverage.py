"""On a hybrid model a cache policy covers the attention layers only, and says so: `KVCaches.coverage` names
them (and the recurrent layers' constant-size state); a per-layer config list that sets a policy for a
recurrent layer is refused in one line."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from bamba_helpers import VOCAB, bamba_config, tiny_bamba_config
from helpers import tiny_gpt

from litkv import GPT, KVCacheConfig, generate
from litkv.kvcache import SlotMachine
from litkv.kvcache.caches import KVCaches
from litkv.kvcache.recurrent import RecurrentCache

H2O = KVCacheConfig("h2o", cache_length=16)
DENSE = KVCacheConfig("dense", cache_length=16)  # one chunking for both: per-layer lists must agree


@pytest.fixture(scope="module")
def hf_and_model() -> tuple[object, GPT]:
    """transformers' config (the reference of which layers attend) and a random model of it."""
    hf_config = tiny_bamba_config(attn_layers=(1, 3), n_layer=4)
    return hf_config, tiny_gpt(5, torch.float64, config=bamba_config(attn_layers=(1, 3), n_layer=4))


def test_coverage_names_the_attention_layers_of_the_hf_config(hf_and_model: tuple[object, GPT]) -> None:
    hf_config, model = hf_and_model
    attention = list(hf_config.attn_layer_indices)
    recurrent = [i for i in range(hf_config.num_hidden_layers) if i not in attention]
    caches = KVCaches(model.build_kv_caches(H2O, batch_size=1))
    assert caches.attention_layers == attention
    assert caches.recurrent_layers == recurrent
    assert [isinstance(caches[i], RecurrentCache) for i in recurrent] == [True] * len(recurrent)
    assert caches.coverage() == (
        f"policy h2o on attention layers {attention} of 4; "
        f"recurrent layers {recurrent} hold a constant-size state (no policy)"
    )


def test_coverage_of_an_attention_only_model(tiny_model: Callable[..., GPT]) -> None:
    plain = tiny_model(seed=0)
    caches = KVCaches(plain.build_kv_caches(H2O, batch_size=1))
    assert caches.recurrent_layers == []
    assert caches.coverage() == f"policy h2o on all {plain.config.n_layer} layers"


def test_per_layer_list_setting_a_recurrent_layer_is_one_line(hf_and_model: tuple[object, GPT]) -> None:
    _, model = hf_and_model
    configs = [DENSE, DENSE, H2O, DENSE]  # layer 2 is Mamba-2: h2o there would silently do nothing
    with pytest.raises(
        ValueError, match=r"kv_cache\[2\] sets policy 'h2o' for layer 2.*attention layers \[1, 3\]"
    ) as err:
        model.build_kv_caches(configs, batch_size=1)
    assert "\n" not in str(err.value)
    prompt = [torch.randint(0, VOCAB, (9,))]
    with pytest.raises(ValueError, match=r"layer 2, a recurrent"):
        generate(model, prompt, max_new_tokens=2, kv_cache=configs)


def test_per_layer_list_with_placeholders_at_recurrent_layers(hf_and_model: tuple[object, GPT]) -> None:
    _, model = hf_and_model
    configs = [H2O, H2O, DENSE, DENSE]  # recurrent entries repeat attention layers' configs: placeholders
    caches = KVCaches(model.build_kv_caches(configs, batch_size=1))
    assert [type(c).__name__ for c in caches] == [
        "RecurrentCache",
        type(caches[1]).__name__,
        "RecurrentCache",
        type(caches[3]).__name__,
    ]
    assert isinstance(caches[1], SlotMachine) and caches[1].config == H2O
    assert isinstance(caches[3], SlotMachine) and caches[3].config == DENSE
    assert caches.coverage().startswith("policy dense, h2o on attention layers [1, 3] of 4;")
