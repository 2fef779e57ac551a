"""Hugging Face hybrid checkpoints (`BambaForCausalLM`, and `GraniteMoeHybridForCausalLM` in its dense-MLP
form, as Granite-4.0-H-Micro) -> litkv's `HybridConfig` and state dict.

Attention layers map to LitGPT's key names (`attn.qkv` is `q_proj`, `k_proj`, `v_proj` stacked), Mamba-2
layers keep Bamba's mixer names under `attn.` (`litkv.modeling.mamba2.Mamba2Mixer`). What litkv does not implement
(a Mamba-1 model, mixture-of-experts MLPs) is refused in one line naming it, before any weight is read.
Granite's four multipliers are folded into the weights (`_fold_granite`): the embedding and the logit
divisor into `wte` / `lm_head` (untied), the residual multiplier into every sublayer's output projection,
the attention multiplier (Granite's softmax scale) into the query rows of `attn.qkv`; Granite's
`position_embedding_type` other than `rope` is no RoPE (`rotary_percentage=0`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from litkv.modeling.config import ATTENTION, MAMBA2, HybridConfig

__all__ = ["HYBRID_MODEL_TYPES", "UNSUPPORTED_RECURRENT", "hybrid_config_from_hf", "hybrid_state_dict"]

HYBRID_MODEL_TYPES = ("bamba", "granitemoehybrid")
# model types with layers litkv does not implement, and what they are
UNSUPPORTED_RECURRENT = {
    "mamba": "Mamba-1 layers",
    "falcon_mamba": "Mamba-1 layers",
    "jamba": "Mamba-1 layers and mixture-of-experts MLPs",
    "nemotron_h": "Nemotron-H's MLP-only layers",
    "falcon_h1": "Falcon-H1's parallel attention and SSM",
    "mamba2": "a Mamba-2 model without attention (use a hybrid one)",
}


def _rope_base(hf: Mapping[str, Any]) -> float:
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise ValueError(f"RoPE scaling of type {kind!r} is not supported for hybrid models; expected 'default'")
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def _number(value: object, name: str) -> float:
    """A float from `config.json` (transformers writes infinity as `{"__float__": "Infinity"}`)."""
    if isinstance(value, dict) and set(value) == {"__float__"}:
        value = value["__float__"]
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r:.80}") from None


def _check_supported(hf: Mapping[str, Any]) -> None:
    model_type = hf.get("model_type")
    if model_type in UNSUPPORTED_RECURRENT:
        raise ValueError(
            f"model_type {model_type!r} has {UNSUPPORTED_RECURRENT[model_type]}, which litkv does not implement"
        )
    if model_type not in HYBRID_MODEL_TYPES:
        raise ValueError(
            f"not a hybrid model litkv converts: model_type {model_type!r}, expected one of {HYBRID_MODEL_TYPES}"
        )
    if int(hf.get("num_local_experts", 0) or 0) > 0:
        raise ValueError(
            f"mixture-of-experts MLPs (num_local_experts={hf['num_local_experts']}) are not implemented for "
            "hybrid models; expected the dense-MLP form (num_local_experts=0)"
        )
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ValueError("attention or MLP biases are not implemented for hybrid models; expected none")
    if int(hf.get("num_experts", 1) or 1) > 1:
        raise ValueError(
            f"mixture-of-experts MLPs (num_experts={hf['num_experts']}) are not implemented for hybrid models"
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act must be 'silu' for a hybrid model, got {hf['hidden_act']!r}")
    if (
        hf.get("mamba_d_head", "auto") != "auto"
        and hf["mamba_d_head"] * hf["mamba_n_heads"] != hf["mamba_expand"] * hf["hidden_size"]
    ):
        raise ValueError("mamba_d_head * mamba_n_heads must equal mamba_expand * hidden_size")


def hybrid_config_from_hf(hf: Mapping[str, Any], name: str) -> HybridConfig:
    """A `HybridConfig` from a Bamba `config.json` mapping. ValueError (one line) for what litkv lacks."""
    _check_supported(hf)
    n_layer, n_head, n_embd = hf["num_hidden_layers"], hf["num_attention_heads"], hf["hidden_size"]
    attn = _attention_layers(hf)
    heads = hf["mamba_n_heads"]
    head_dim = hf.get("mamba_d_head", "auto")
    head_dim = hf["mamba_expand"] * n_embd // heads if head_dim == "auto" else head_dim
    limit = hf.get("time_step_limit") or (0.0, math.inf)
    return HybridConfig(
        name=name,
        block_size=hf.get("max_position_embeddings", 4096),
        vocab_size=hf["vocab_size"],
        padded_vocab_size=hf["vocab_size"],
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_query_groups=hf.get("num_key_value_heads") or n_head,
        head_size=hf.get("head_dim") or n_embd // n_head,
        intermediate_size=hf["shared_intermediate_size"] if _granite(hf) else hf["intermediate_size"],
        # transformers' Bamba rotates the whole head (its partial_rotary_factor is unused); Granite: "nope" or "rope"
        rotary_percentage=0.0 if _granite(hf) and hf.get("position_embedding_type") != "rope" else 1.0,
        rope_base=_rope_base(hf),
        parallel_residual=False,
        bias=False,
        norm_class_name="RMSNorm",
        norm_eps=hf.get("rms_norm_eps", 1e-5),
        mlp_class_name="LLaMAMLP",
        layer_kinds=tuple(ATTENTION if i in attn else MAMBA2 for i in range(n_layer)),
        mamba_n_heads=heads,
        mamba_head_dim=head_dim,
        mamba_n_groups=hf.get("mamba_n_groups", 1),
        mamba_d_state=hf["mamba_d_state"],
        mamba_d_conv=hf.get("mamba_d_conv", 4),
        mamba_chunk_size=hf.get("mamba_chunk_size", 256),
        mamba_conv_bias=bool(hf.get("mamba_conv_bias", True)),
        mamba_proj_bias=bool(hf.get("mamba_proj_bias", False)),
        mamba_dt_min=_number(limit[0], "time_step_limit[0]"),
        mamba_dt_max=_number(limit[1], "time_step_limit[1]"),
    )


def _granite(hf: Mapping[str, Any]) -> bool:
    return hf.get("model_type") == "granitemoehybrid"


def _attention_layers(hf: Mapping[str, Any]) -> set[int]:
    """Indices of the attention layers: Bamba's `attn_layer_indices`, Granite's `layer_types` ("attention")."""
    if not _granite(hf):
        return set(hf.get("attn_layer_indices") or [])
    kinds = list(hf.get("layer_types") or hf.get("layers_block_type") or [])
    if len(kinds) != hf["num_hidden_layers"] or not set(kinds) <= {"mamba", "attention"}:
        raise ValueError(
            f"layer_types must name 'mamba' or 'attention' for each of the {hf['num_hidden_layers']} layers, "
            f"got {kinds!r:.120}"
        )
    return {i for i, kind in enumerate(kinds) if kind == "attention"}


_MIXER = (
    "in_proj.weight",
    "in_proj.bias",
    "conv1d.weight",
    "conv1d.bias",
    "dt_bias",
    "A_log",
    "D",
    "norm.weight",
    "out_proj.weight",
    "out_proj.bias",
)
_LAYER = {
    "input_layernorm.weight": "norm_1.weight",
    "pre_ff_layernorm.weight": "norm_2.weight",
    "feed_forward.gate_proj.weight": "mlp.fc_1.weight",
    "feed_forward.up_proj.weight": "mlp.fc_2.weight",
    "feed_forward.down_proj.weight": "mlp.proj.weight",
    "self_attn.o_proj.weight": "attn.proj.weight",
    "post_attention_layernorm.weight": "norm_2.weight",  # Granite's names
    "shared_mlp.output_linear.weight": "mlp.proj.weight",
}


def hybrid_state_dict(
    hf_weights: Mapping[str, torch.Tensor],
    config: HybridConfig,
    dtype: torch.dtype | None = None,
    hf: Mapping[str, Any] | None = None,
) -> dict[str, torch.Tensor]:
    """Bamba's or Granite's weights (all files together) under litkv's names. ValueError naming an unknown key.

    `hf` (the `config.json` mapping) is needed for Granite: its multipliers are folded in (`_fold_granite`).
    """
    out: dict[str, torch.Tensor] = {}
    qkv: dict[int, dict[str, torch.Tensor]] = {}
    for key, tensor in hf_weights.items():
        t = tensor if dtype is None else tensor.to(dtype)
        if key == "model.embed_tokens.weight":
            out["transformer.wte.weight"] = t
        elif key in ("model.final_layernorm.weight", "model.norm.weight"):
            out["transformer.ln_f.weight"] = t
        elif key == "lm_head.weight":
            out["lm_head.weight"] = t
        elif key.startswith("model.layers."):
            index, rest = key[len("model.layers.") :].split(".", 1)
            i = int(index)
            if rest in _LAYER:
                out[f"transformer.h.{i}.{_LAYER[rest]}"] = t
            elif rest == "shared_mlp.input_linear.weight":  # Granite: [gate; up] stacked
                out[f"transformer.h.{i}.mlp.fc_1.weight"], out[f"transformer.h.{i}.mlp.fc_2.weight"] = t.chunk(2)
            elif rest.startswith("mamba.") and rest[len("mamba.") :] in _MIXER:
                out[f"transformer.h.{i}.attn.{rest[len('mamba.') :]}"] = t
            elif rest in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"):
                qkv.setdefault(i, {})[rest.split(".")[1][0]] = t
            else:
                raise ValueError(f"unexpected weight {key!r} in a Bamba checkpoint (litkv does not implement it)")
        else:
            raise ValueError(f"unexpected weight {key!r} in a Bamba checkpoint (litkv does not implement it)")
    for i, parts in qkv.items():
        if set(parts) != {"q", "k", "v"}:
            raise ValueError(f"layer {i} has attention weights {sorted(parts)}, expected q, k and v")
        out[f"transformer.h.{i}.attn.qkv.weight"] = torch.cat((parts["q"], parts["k"], parts["v"]), dim=0)
    if "lm_head.weight" not in out and "transformer.wte.weight" in out:
        out["lm_head.weight"] = out["transformer.wte.weight"].clone()  # tied embeddings
    if hf is not None and _granite(hf):
        _fold_granite(out, config, hf)
    return out


def _fold_granite(out: dict[str, torch.Tensor], config: HybridConfig, hf: Mapping[str, Any]) -> None:
    """Fold Granite's multipliers into the weights `out` (litkv names, in place), computed in float64.

    `embedding_multiplier` scales `wte`; `logits_scaling` divides `lm_head`; `residual_multiplier` scales each
    sublayer's output projection (`attn.proj`, the mixer's `out_proj` and its bias, `mlp.proj`);
    `attention_multiplier` replaces the softmax scale `1 / sqrt(head_size)`, so the query rows of `attn.qkv`
    are scaled by `attention_multiplier * sqrt(head_size)` (RoPE is linear: the same after rotation).
    """
    names = ("embedding_multiplier", "logits_scaling", "residual_multiplier", "attention_multiplier")
    embed, logits, residual, attention = (_number(hf.get(n, 1.0), n) for n in names)
    if logits == 0:
        raise ValueError("logits_scaling must be non-zero, got 0")

    def scale(key: str, factor: float) -> None:
        if key in out:
            out[key] = (out[key].double() * factor).to(out[key].dtype)

    scale("transformer.wte.weight", embed)
    scale("lm_head.weight", 1.0 / logits)
    q_rows = config.n_head * config.head_size
    for i in range(config.n_layer):
        for key in ("attn.proj.weight", "attn.out_proj.weight", "attn.out_proj.bias", "mlp.proj.weight"):
            scale(f"transformer.h.{i}.{key}", residual)
        qkv = out.get(f"transformer.h.{i}.attn.qkv.weight")
        if qkv is not None:
            q = (qkv[:q_rows].double() * (attention * math.sqrt(config.head_size))).to(qkv.dtype)
            out[f"transformer.h.{i}.attn.qkv.weight"] = torch.cat((q, qkv[q_rows:]))
