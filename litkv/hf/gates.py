"""The `learned` policy's eviction gates for a transformers model: read from the litkv checkpoint directory they
were fitted in, and run only where the model's weights are the ones they were fitted for.

A gates file records the fingerprint of the litkv weights it was fitted for (`EvictionGates.weights`:
`model_fingerprint(model)["weights"]` as the checkpoint stores them; `load_model` refuses gates for other
weights). `hf_gates` computes the same fingerprint of the transformers model's weights as litkv's GPT of that
checkpoint would hold them: each weight renamed (and q/k/v fused) by litkv's converter
(`litkv.checkpoints.convert.weight_copier`, as `litkv convert` does), cast to the dtype the checkpoint stores,
taken in the order of the GPT's `named_parameters()` and digested by `weights_fingerprint`. Gates whose
fingerprint differs are refused in one line naming both digests.
"""

from __future__ import annotations

from pathlib import Path

import torch

from litkv.checkpoints.checkpoint import check_checkpoint_dir, check_state_dict, find_weights_file, load_config
from litkv.checkpoints.convert import weight_copier
from litkv.checkpoints.known import model_dir
from litkv.gates.gate import GATES_FILE, EvictionGates
from litkv.modeling.config import Config
from litkv.modeling.fingerprint import weights_fingerprint
from litkv.modeling.model import GPT

__all__ = ["hf_gates", "litkv_weights_fingerprint"]

_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def hf_gates(model: torch.nn.Module, checkpoint: str | Path) -> EvictionGates:
    """The eviction gates of the litkv checkpoint directory `checkpoint` (a path, or a known model's name as
    `litkv download` keeps it), checked against `model`'s weights, on the device of its parameters.

    Raises:
        FileNotFoundError: no such checkpoint, or no `eviction_gates.safetensors` in it.
        ValueError: gates that do not prove their tensors, that record no weights' fingerprint, do not fit the
            checkpoint's shape, or were fitted for other weights than `model`'s (both digests named).
    """
    path = check_checkpoint_dir(model_dir(checkpoint), tokenizer=False)
    gates_file = path / GATES_FILE
    if not gates_file.is_file():
        raise FileNotFoundError(
            f"{str(path)!r} has no {GATES_FILE}: give litkv.hf.Cache(gates=...) the litkv checkpoint directory the "
            "gates were fitted in (`litkv finetune --learn_eviction true` writes them there)"
        )
    config = load_config(path)
    gates = EvictionGates.load(gates_file)
    gates.check_model(config.n_layer, config.n_query_groups, config.head_size, config.n_embd, str(gates_file))
    if gates.weights is None:
        raise ValueError(
            f"{str(gates_file)!r}: these eviction gates record no fingerprint of the weights they were fitted for "
            "(metadata key 'weights'), so they cannot be matched to the transformers model's weights"
        )
    found = litkv_weights_fingerprint(model, config, _stored_dtype(find_weights_file(path)))
    if found != gates.weights:
        raise ValueError(
            f"{str(gates_file)!r}: these eviction gates were fitted for other weights (fingerprint {gates.weights}, "
            f"the transformers model's weights as litkv holds them are {found}); fit gates for this model"
        )
    return gates.to(next(model.parameters()).device)


def litkv_weights_fingerprint(model: torch.nn.Module, config: Config, dtype: torch.dtype | None = None) -> str:
    """`model_fingerprint(gpt)["weights"]` of the litkv `GPT(config)` holding the transformers `model`'s weights
    (converted as `litkv convert` converts them, cast to `dtype`; `None`: as they are), without building it: the
    extra memory is the fused q/k/v weights and one cast weight at a time.

    Raises:
        ValueError: the converted weights are not those of `GPT(config)` (names or shapes, one line).
    """
    model_type = getattr(model.config, "model_type", None)
    copy = weight_copier(config, str(model_type))
    state_dict: dict[str, torch.Tensor] = {}
    hf_weights = {name: t.detach() for name, t in model.state_dict().items()}
    try:  # renamed and fused, not cast: each weight is cast alone while it is digested
        copy(state_dict, hf_weights, saver=None, dtype=None)
    except (KeyError, NotImplementedError) as err:
        raise ValueError(f"the transformers {model_type} model's weights do not convert to litkv's: {err!r}") from None
    with torch.device("meta"):
        reference = GPT(config)
    check_state_dict(reference, state_dict, f"the transformers {model_type} model's weights")
    return weights_fingerprint([(name, state_dict[name]) for name, _ in reference.named_parameters()], dtype)


def _stored_dtype(weights_file: Path) -> torch.dtype | None:
    """The one floating dtype `weights_file` (safetensors) stores its weights in; `None` for another file or
    several dtypes (the weights are then compared as the transformers model holds them)."""
    if weights_file.suffix != ".safetensors":
        return None
    from safetensors import safe_open

    with safe_open(str(weights_file), framework="pt") as f:
        kinds = {f.get_slice(name).get_dtype() for name in f.keys()}  # noqa: SIM118 (safe_open is no dict)
    floating = {_SAFETENSORS_DTYPES[k] for k in kinds if k in _SAFETENSORS_DTYPES}
    return floating.pop() if len(floating) == 1 else None
