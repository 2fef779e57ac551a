"""Hugging Face Gated DeltaNet hybrids (Qwen3.5 `qwen3_5` / `qwen3_5_text`, dense Qwen3-Next `qwen3_next`) ->
litkv's `HybridConfig` and state dict.

Layers named `linear_attention` become Gated DeltaNet mixers (`litkv.modeling.gated_deltanet`, Qwen3.5's
parameter names under `attn.`); `full_attention` layers become LitGPT attention with q/k norms, partial RoPE
and the output gate (`attn.gate`: the gate rows of Qwen3.5's `q_proj`, which interleaves per head the query
and the gate rows). Every RMSNorm scales by `1 + weight` (`norm_unit_offset`). Qwen3-Next's grouped
projections (`in_proj_qkvz`, `in_proj_ba`: per key head its query, key, values and gates) are reordered into
Qwen3.5's (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`). A multimodal Qwen3.5 checkpoint's language
model is taken (`model.language_model.`); its vision tower and multi-token-prediction weights are left out.
What litkv does not implement (mixture-of-experts MLPs, other layer kinds, attention biases, RoPE scaling)
is refused in one line, before any weight is read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from litkv.modeling.config import ATTENTION, GATED_DELTANET, HybridConfig

__all__ = ["QWEN35_MODEL_TYPES", "QWEN35_MOE_TYPES", "qwen35_config_from_hf", "qwen35_state_dict"]

QWEN35_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_next")
QWEN35_MOE_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
_KINDS = {"linear_attention": GATED_DELTANET, "full_attention": ATTENTION}


def _text_config(hf: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's config: Qwen3.5's `text_config` when nested, else `hf` itself."""
    model_type = hf.get("model_type")
    if model_type in QWEN35_MOE_TYPES:
        raise ValueError(f"model_type {model_type!r} has mixture-of-experts MLPs, which litkv does not implement")
    if model_type not in QWEN35_MODEL_TYPES:
        raise ValueError(f"not a Gated DeltaNet model: model_type {model_type!r}, expected one of {QWEN35_MODEL_TYPES}")
    text = hf.get("text_config") if model_type == "qwen3_5" else None
    return dict(text) if isinstance(text, Mapping) else hf


def _check_dense(text: Mapping[str, Any], n_layer: int) -> None:
    """Qwen3-Next is dense only where no layer gets experts (`num_experts == 0`, or all in `mlp_only_layers`)."""
    experts = int(text.get("num_experts", 0) or 0)
    only = set(text.get("mlp_only_layers") or [])
    step = int(text.get("decoder_sparse_step", 1) or 1)
    sparse = [i for i in range(n_layer) if experts > 0 and i not in only and (i + 1) % step == 0]
    if sparse:
        raise ValueError(
            f"mixture-of-experts MLPs (num_experts={experts}, at layers {sparse[:8]}) are not implemented; "
            "litkv converts the dense form (num_experts=0 or every layer in mlp_only_layers)"
        )


def _rope(text: Mapping[str, Any]) -> tuple[float, float]:
    """RoPE base and the rotated fraction of each head (`partial_rotary_factor`, Qwen3.5's default 0.25)."""
    params = text.get("rope_parameters") or text.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise ValueError(f"RoPE scaling of type {kind!r} is not supported for Qwen3.5 models; expected 'default'")
    base = float(params.get("rope_theta", text.get("rope_theta", 10000.0)))
    return base, float(params.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))


def _layer_kinds(text: Mapping[str, Any], n_layer: int) -> tuple[str, ...]:
    kinds = text.get("layer_types")
    if kinds is None:  # transformers' default: every `full_attention_interval`-th layer is attention
        interval = int(text.get("full_attention_interval", 4))
        kinds = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layer)]
    kinds = list(kinds)
    unknown = sorted({k for k in kinds if k not in _KINDS}, key=str)
    if unknown or len(kinds) != n_layer:
        what = f"layer kinds {unknown!r:.80}" if unknown else f"{len(kinds)} layer kinds for {n_layer} layers"
        raise ValueError(f"{what}: litkv implements {sorted(_KINDS)} for Qwen3.5 / Qwen3-Next")
    return tuple(_KINDS[k] for k in kinds)


def qwen35_config_from_hf(hf: Mapping[str, Any], name: str) -> HybridConfig:
    """A `HybridConfig` from a Qwen3.5 / Qwen3-Next `config.json` mapping. ValueError (one line) for what litkv
    lacks (MoE, unknown layer kinds, biases, RoPE scaling, another activation)."""
    text = _text_config(hf)
    n_layer, n_head, n_embd = text["num_hidden_layers"], text["num_attention_heads"], text["hidden_size"]
    _check_dense(text, n_layer)
    kinds = _layer_kinds(text, n_layer)
    if text.get("attention_bias"):
        raise ValueError("attention biases are not implemented for Qwen3.5 / Qwen3-Next models; expected none")
    if text.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act must be 'silu' for a Qwen3.5 model, got {text['hidden_act']!r}")
    base, rotary = _rope(text)
    return HybridConfig(
        name=name,
        block_size=text.get("max_position_embeddings", 32768),
        vocab_size=text["vocab_size"],
        padded_vocab_size=text["vocab_size"],
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_query_groups=text.get("num_key_value_heads") or n_head,
        head_size=text.get("head_dim") or n_embd // n_head,
        intermediate_size=text["intermediate_size"],
        rotary_percentage=rotary,
        rope_base=base,
        parallel_residual=False,
        bias=False,
        norm_class_name="RMSNorm",
        norm_eps=text.get("rms_norm_eps", 1e-6),
        norm_qk=True,
        mlp_class_name="LLaMAMLP",
        layer_kinds=kinds,
        gdn_n_k_heads=text["linear_num_key_heads"],
        gdn_n_v_heads=text["linear_num_value_heads"],
        gdn_k_head_dim=text["linear_key_head_dim"],
        gdn_v_head_dim=text["linear_value_head_dim"],
        gdn_d_conv=text.get("linear_conv_kernel_dim", 4),
        attn_output_gate=True,
        norm_unit_offset=True,
    )


_LAYER = {
    "input_layernorm.weight": "norm_1.weight",
    "post_attention_layernorm.weight": "norm_2.weight",
    "mlp.gate_proj.weight": "mlp.fc_1.weight",
    "mlp.up_proj.weight": "mlp.fc_2.weight",
    "mlp.down_proj.weight": "mlp.proj.weight",
    "self_attn.o_proj.weight": "attn.proj.weight",
    "self_attn.q_norm.weight": "attn.norm_q.weight",
    "self_attn.k_norm.weight": "attn.norm_k.weight",
}
_MIXER = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "dt_bias", "A_log", "norm", "out_proj")
_SKIPPED = ("model.visual.", "mtp.", "model.mtp.")  # the vision tower, multi-token prediction: not the text model


def _split_qkvz(qkvz: torch.Tensor, ba: torch.Tensor, c: HybridConfig) -> dict[str, torch.Tensor]:
    """Qwen3-Next's grouped `in_proj_qkvz` / `in_proj_ba` rows as Qwen3.5's four projections."""
    groups, dk, r = c.gdn_n_k_heads, c.gdn_k_head_dim, c.gdn_n_v_heads // c.gdn_n_k_heads
    rv = r * c.gdn_v_head_dim
    per = qkvz.reshape(groups, 2 * dk + 2 * rv, -1)
    q, k, v, z = per.split((dk, dk, rv, rv), dim=1)
    b, a = ba.reshape(groups, 2 * r, -1).split((r, r), dim=1)
    flat = [x.reshape(-1, qkvz.shape[1]) for x in (q, k, v, z, b, a)]
    return {
        "in_proj_qkv.weight": torch.cat(flat[:3]),
        "in_proj_z.weight": flat[3],
        "in_proj_b.weight": flat[4],
        "in_proj_a.weight": flat[5],
    }


def _layer_weight(out: dict, parts: dict, i: int, rest: str, t: torch.Tensor, key: str) -> None:
    """Place one `model.layers.{i}.{rest}` tensor (in place; attention and Qwen3-Next parts kept for later)."""
    if rest in _LAYER:
        out[f"transformer.h.{i}.{_LAYER[rest]}"] = t
    elif rest.startswith("linear_attn.") and rest[len("linear_attn.") :].split(".")[0] in _MIXER:
        out[f"transformer.h.{i}.attn.{rest[len('linear_attn.') :]}"] = t
    elif rest in ("linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight"):
        parts.setdefault(("gdn", i), {})[rest.split(".")[1]] = t
    elif rest in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"):
        parts.setdefault(("attn", i), {})[rest.split(".")[1][0]] = t
    else:
        raise ValueError(f"unexpected weight {key!r} in a Qwen3.5 checkpoint (litkv does not implement it)")


def qwen35_state_dict(
    hf_weights: Mapping[str, torch.Tensor], config: HybridConfig, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Qwen3.5's or Qwen3-Next's weights (all files together) under litkv's names. ValueError naming an
    unexpected key; the vision tower and multi-token-prediction weights are left out."""
    out: dict[str, torch.Tensor] = {}
    parts: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    for key, tensor in hf_weights.items():
        if key.startswith(_SKIPPED):
            continue
        t = tensor if dtype is None else tensor.to(dtype)
        name = key.replace("model.language_model.", "model.", 1)
        if name == "model.embed_tokens.weight":
            out["transformer.wte.weight"] = t
        elif name == "model.norm.weight":
            out["transformer.ln_f.weight"] = t
        elif name == "lm_head.weight":
            out["lm_head.weight"] = t
        elif name.startswith("model.layers."):
            index, rest = name[len("model.layers.") :].split(".", 1)
            _layer_weight(out, parts, int(index), rest, t, key)
        else:
            raise ValueError(f"unexpected weight {key!r} in a Qwen3.5 checkpoint (litkv does not implement it)")
    c, hs = config, config.head_size
    for (what, i), p in parts.items():
        if what == "gdn":
            if set(p) != {"in_proj_qkvz", "in_proj_ba"}:
                raise ValueError(f"layer {i} has Gated DeltaNet projections {sorted(p)}, expected qkvz and ba")
            for name, w in _split_qkvz(p["in_proj_qkvz"], p["in_proj_ba"], c).items():
                out[f"transformer.h.{i}.attn.{name}"] = w
            continue
        if set(p) != {"q", "k", "v"}:
            raise ValueError(f"layer {i} has attention weights {sorted(p)}, expected q, k and v")
        q, gate = p["q"].reshape(c.n_head, 2, hs, -1).unbind(1)  # per head: query rows, then gate rows
        out[f"transformer.h.{i}.attn.qkv.weight"] = torch.cat((q.reshape(c.n_head * hs, -1), p["k"], p["v"]))
        out[f"transformer.h.{i}.attn.gate.weight"] = gate.reshape(c.n_head * hs, -1)
    if "lm_head.weight" not in out and "transformer.wte.weight" in out:
        out["lm_head.weight"] = out["transformer.wte.weight"].clone()  # tied embeddings
    return out
