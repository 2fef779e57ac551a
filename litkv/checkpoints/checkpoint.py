"""Safe loading and saving of checkpoint directories (LitGPT layout).

A checkpoint directory holds `model_config.yaml` (a `litgpt.Config`), the weights as
`model.safetensors` (preferred) or `lit_model.pth`, and the tokenizer files (`tokenizer.json` or
`tokenizer.model`, optionally `tokenizer_config.json`). Weights are read with safetensors or with
`torch.load(weights_only=True)` only: a `.pth` file that pickles anything but tensors (and plain
containers of them) is refused. YAML is read with `yaml.safe_load` only.

Every file that cannot be used (truncated, corrupt, wrong type, wrong dtype, NaN/inf weights, an
inconsistent config) raises a ValueError that names the file and what is wrong.

Writes go through `litkv.core.atomic` (`write_atomic`, `save_dir_atomic`; `remove_stale_temp_files`,
`is_temp_name` and `TMP_PREFIX` are re-exported here): a file or a whole directory is written under
a temporary name in the target's directory and renamed into place when complete, so a process killed
mid-write leaves only temporary names behind, never taken for a checkpoint.
"""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from litkv.checkpoints.bounds import check_ceilings, check_layer_count
from litkv.checkpoints.config_fields import LITGPT_FIELDS, check_fields
from litkv.checkpoints.known import model_dir, unknown_checkpoint_message
from litkv.checkpoints.quant_store import attach_quantized, stored_quant
from litkv.core.atomic import TMP_PREFIX, is_temp_name, remove_stale_temp_files, write_atomic
from litkv.gates.gate import GATES_FILE, EvictionGates
from litkv.modeling.config import Config, config_from_dict
from litkv.modeling.fingerprint import model_fingerprint
from litkv.modeling.model import GPT

__all__ = [
    "CONFIG_FILE",
    "SAFETENSORS_FILE",
    "PTH_FILE",
    "TOKENIZER_FILES",
    "TMP_PREFIX",
    "MLP_CLASSES",
    "NORM_CLASSES",
    "default_checkpoint_dir",
    "check_checkpoint_dir",
    "check_state_dict",
    "check_finite",
    "find_weights_file",
    "is_temp_name",
    "load_config",
    "load_state_dict",
    "load_model",
    "load_tokenizer",
    "remove_stale_temp_files",
    "safe_torch_load",
    "save_gates",
    "save_state_dict_atomic",
]

CONFIG_FILE = "model_config.yaml"
SAFETENSORS_FILE = "model.safetensors"
PTH_FILE = "lit_model.pth"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
#: `mlp_class_name` and `norm_class_name` values a checkpoint config may use.
MLP_CLASSES = ("GptNeoxMLP", "LLaMAMLP", "GemmaMLP", "LLaMAMoE")
NORM_CLASSES = ("LayerNorm", "RMSNorm")
#: Integer config fields that must be >= 1 (None allowed for those in `_OPTIONAL_INTS`).
_POSITIVE_INTS = ("block_size", "vocab_size", "padded_vocab_size", "padding_multiple", "n_layer", "n_head", "n_embd",
                  "n_query_groups", "head_size", "intermediate_size")  # fmt: skip
_OPTIONAL_INTS = ("padded_vocab_size", "n_query_groups", "head_size", "intermediate_size")


def default_checkpoint_dir() -> Path:
    """The small model shipped with the package: `litkv/assets/default`."""
    return Path(__file__).resolve().parents[1] / "assets" / "default"


def check_checkpoint_dir(checkpoint_dir: str | Path, weights: bool = True, tokenizer: bool = True) -> Path:
    """Check that `checkpoint_dir` holds a config, weights and a tokenizer; return it as a `Path`.

    Raises:
        FileNotFoundError: naming the directory and the first missing file.
        ValueError: if the directory is the temporary name of an interrupted write.
    """
    path = Path(checkpoint_dir)
    if not path.is_dir():
        raise FileNotFoundError(unknown_checkpoint_message(checkpoint_dir))
    if is_temp_name(path.name):
        raise ValueError(
            f"{str(path)!r} is an incomplete checkpoint directory (the temporary name of an interrupted write)"
        )
    if not (path / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"checkpoint directory {str(path)!r} has no {CONFIG_FILE}")
    if weights:
        find_weights_file(path)
    if tokenizer and not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"checkpoint directory {str(path)!r} has no tokenizer: expected {' or '.join(TOKENIZER_FILES)}"
        )
    return path


def find_weights_file(checkpoint_dir: str | Path) -> Path:
    """`model.safetensors` if present, else `lit_model.pth`; FileNotFoundError naming both otherwise."""
    path = Path(checkpoint_dir)
    for name in (SAFETENSORS_FILE, PTH_FILE):
        if (path / name).is_file():
            return path / name
    raise FileNotFoundError(
        f"checkpoint directory {str(path)!r} has no weights: expected {SAFETENSORS_FILE} or {PTH_FILE}"
    )


# -- config ----------------------------------------------------------------------------------------


def _one_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return " ".join(lines) if lines else type(err).__name__


def _yaml_reason(err: Exception) -> str:
    """`"<problem> at line L, column C"` of a YAML error."""
    problem, mark = getattr(err, "problem", None), getattr(err, "problem_mark", None)
    if problem is None:
        return _one_line(err)
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else str(problem)


def _read_yaml_mapping(path: Path) -> dict[str, Any]:
    """The top-level mapping of a YAML file, read with `yaml.safe_load` (no Python tags constructed)."""
    import yaml

    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not a UTF-8 text file: {err}") from err
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ValueError(f"{path} is not valid YAML (or uses tags that are not allowed): {_yaml_reason(err)}") from err
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a mapping of config fields, got {type(data).__name__} {data!r:.80}")
    return data


def _check_config_fields(raw: Mapping[str, Any], source: Path) -> None:
    """ValueError/TypeError for field values that would crash or mislead model construction, or whose size
    is beyond any model (`litkv.checkpoints.bounds.CEILINGS`)."""
    kinds = raw.get("layer_kinds")
    if kinds is not None and not isinstance(kinds, list | tuple):
        raise TypeError(f"{source}: layer_kinds must be a list with one kind per layer, got {kinds!r:.80}")
    for name in _POSITIVE_INTS:
        if name not in raw or (raw[name] is None and name in _OPTIONAL_INTS):
            continue
        value = raw[name]
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{source}: {name} must be an int, got {type(value).__name__} {value!r:.80}")
        if value < 1:
            raise ValueError(f"{source}: {name} must be >= 1, got {value}")
    n_head, groups = raw.get("n_head"), raw.get("n_query_groups")
    if isinstance(n_head, int) and isinstance(groups, int) and n_head % groups:
        raise ValueError(f"{source}: n_query_groups ({groups}) must divide n_head ({n_head})")
    n_embd = raw.get("n_embd")
    if raw.get("head_size") is None and isinstance(n_embd, int) and isinstance(n_head, int) and n_embd % n_head:
        raise ValueError(f"{source}: n_embd ({n_embd}) must be a multiple of n_head ({n_head}) when head_size is unset")
    check_ceilings(raw, str(source))
    check_fields(raw, LITGPT_FIELDS, str(source))  # floats finite and in range, hybrid counts, flags
    for name, known in (("mlp_class_name", MLP_CLASSES), ("norm_class_name", NORM_CLASSES)):
        if name in raw and raw[name] not in known:
            raise ValueError(f"{source}: unknown {name} {raw[name]!r}; expected one of {list(known)}")


def load_config(checkpoint_dir: str | Path) -> Config:
    """The model `Config` from `checkpoint_dir/model_config.yaml`, validated.

    Raises:
        FileNotFoundError: no config file.
        ValueError: the file is not YAML, not a mapping, or holds an invalid config (named field).
        TypeError: a field has the wrong type.
    """
    path = Path(checkpoint_dir) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint directory {str(checkpoint_dir)!r} has no {CONFIG_FILE}")
    raw = _read_yaml_mapping(path)
    _check_config_fields(raw, path)
    try:
        return config_from_dict(raw)
    except (TypeError, AssertionError, AttributeError, KeyError, ValueError) as err:
        raise ValueError(f"{path} is not a valid litgpt model config: {_one_line(err)}") from err


# -- weights ---------------------------------------------------------------------------------------


def safe_torch_load(path: str | Path, map_location: torch.device | str = "cpu") -> Any:
    """`torch.load(path, weights_only=True)`, with a one-line ValueError naming the file on any failure.

    A file that pickles objects other than tensors and plain containers is refused (never executed).
    """
    path = Path(path)
    try:
        with warnings.catch_warnings():  # a raw pickle of another protocol: refused below, no warning needed
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        reason = _unpickling_reason(err)
        if "GLOBAL" in reason or "global" in reason:
            raise ValueError(
                f"refusing to load {str(path)!r}: it contains pickled objects other than tensors "
                f"(only torch.load(weights_only=True) is allowed; {reason})"
            ) from err
        raise ValueError(f"{str(path)!r} is not a valid PyTorch file (corrupt or not a tensor file): {reason}") from err
    except (EOFError, RuntimeError, OSError, ValueError, IndexError, KeyError, AttributeError, TypeError) as err:
        kind = "empty" if path.stat().st_size == 0 else "truncated or corrupt"
        raise ValueError(f"{str(path)!r} is not a valid PyTorch file ({kind}): {_one_line(err)[:200]}") from err


def _unpickling_reason(err: BaseException) -> str:
    """The informative part of torch's weights_only error, without its advice on how to unpickle anyway."""
    text = str(err)
    marker = "WeightsUnpickler error:"
    if marker in text:
        text = text.split(marker, 1)[1]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    boilerplate = ("Weights only load failed", "Please file an issue", "Check the documentation", "(1)", "(2)")
    useful = [line for line in lines if not line.startswith(boilerplate)]
    reason = useful[0] if useful else type(err).__name__
    return reason.split(" Please use", 1)[0][:300]


def _load_safetensors(path: Path, device: torch.device) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path), device=str(device))
    except (SafetensorError, OSError, RuntimeError, ValueError, TypeError) as err:
        kind = "empty" if path.stat().st_size == 0 else "truncated or corrupt"
        raise ValueError(f"{str(path)!r} is not a valid safetensors file ({kind}): {_one_line(err)}") from err


def load_state_dict(path: str | Path, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """Read a state dict from a `.safetensors` file or a tensors-only `.pth` file.

    A `.pth` file whose top level is `{"model": state_dict}` (LitGPT/Fabric training checkpoints) is
    unwrapped. A corrupt file, or anything that is not a mapping of names to tensors, is refused with a
    ValueError naming the file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"weights file {str(path)!r} does not exist")
    map_location = torch.device("cpu") if device is None else torch.device(device)
    if path.suffix == ".safetensors":
        return _load_safetensors(path, map_location)
    obj = safe_torch_load(path, map_location)
    if isinstance(obj, Mapping) and set(obj) == {"model"} and isinstance(obj["model"], Mapping):
        obj = obj["model"]
    if not isinstance(obj, Mapping):
        raise ValueError(f"refusing to load {str(path)!r}: expected a dict of tensors, got {type(obj).__name__}")
    for key, value in obj.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise ValueError(
                f"refusing to load {str(path)!r}: expected a dict of tensors, but entry {key!r} is a "
                f"{type(value).__name__}"
            )
    return dict(obj)


def check_state_dict(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor], source: str) -> None:
    """Raise ValueError unless `state_dict` has exactly the keys, shapes and kind of dtype of `model`'s."""
    expected = model.state_dict()
    if set(expected) != set(state_dict):
        missing, unexpected = sorted(set(expected) - set(state_dict)), sorted(set(state_dict) - set(expected))
        raise ValueError(
            f"{source} do not match {CONFIG_FILE}: missing {len(missing)} keys {missing[:3]}, "
            f"unexpected {len(unexpected)} keys {unexpected[:3]}"
        )
    for key, tensor in expected.items():
        if tuple(state_dict[key].shape) != tuple(tensor.shape):
            raise ValueError(
                f"{source} do not match {CONFIG_FILE}: {key} has shape {tuple(state_dict[key].shape)}, "
                f"expected {tuple(tensor.shape)}"
            )
        if tensor.is_floating_point() and not state_dict[key].is_floating_point():
            raise ValueError(
                f"{source}: {key} has dtype {state_dict[key].dtype}, expected a floating dtype (like {tensor.dtype})"
            )


def check_finite(state_dict: Mapping[str, torch.Tensor], source: str, block: int = 1 << 24) -> None:
    """Raise ValueError naming the first floating tensor of `state_dict` that holds NaN or inf.

    Checked in blocks of `block` elements, so the temporary mask stays small for large tensors.
    """
    for key, tensor in state_dict.items():
        if not tensor.is_floating_point() or tensor.numel() == 0:
            continue
        flat = tensor.detach().reshape(-1)
        for start in range(0, flat.numel(), block):
            part = flat[start : start + block]
            if not bool(torch.isfinite(part).all()):
                bad = "NaN" if bool(torch.isnan(part).any()) else "inf"
                raise ValueError(f"{source}: {key} contains {bad} values (the checkpoint is corrupt or diverged)")


def load_model(
    checkpoint_dir: str | Path, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> GPT:
    """Build the `GPT` of `checkpoint_dir` and load its weights (in eval mode), and its eviction gates
    (`model.eviction_gates`, for the `learned` policy) when the directory has `eviction_gates.safetensors`.

    Args:
        checkpoint_dir: directory with `model_config.yaml` and `model.safetensors` or `lit_model.pth`, or
            the name of a downloaded known model (`smollm2-135m-instruct`; `litkv.load` downloads it too).
        device: where to put the model (default: CPU).
        dtype: floating dtype of the parameters (default: the dtype stored in the file; gates stay float32;
            the scales of quantised weights stay bfloat16).

    A file written with `litkv convert ... --quantize` (`litkv.checkpoints.quant_store`) loads into quantised linear
    layers directly (CPU only).

    Raises:
        ValueError: a corrupt file, an invalid config, weights that do not match it, NaN/inf weights,
            a gates file that is not one or does not fit the model.
    """
    path = check_checkpoint_dir(model_dir(checkpoint_dir), tokenizer=False)
    config = load_config(path)
    weights_file = find_weights_file(path)
    state_dict = load_state_dict(weights_file)
    check_layer_count(config.n_layer, state_dict, str(path / CONFIG_FILE), "n_layer", repr(str(weights_file)))
    try:
        with torch.device("meta"):
            model = GPT(config)
    except (TypeError, ValueError, RuntimeError, AttributeError, AssertionError) as err:
        raise ValueError(f"{path / CONFIG_FILE}: cannot build the model from this config: {_one_line(err)}") from err
    stored = stored_quant(weights_file, list(state_dict)) if weights_file.suffix == ".safetensors" else None
    if stored is not None:  # quantised layers built from their codes: no float copy of their weights
        if device is not None and torch.device(device).type != "cpu":
            where = f"{str(weights_file)!r} holds {stored.name} weights"
            raise ValueError(f"{where}, which run on the CPU only, got {device}")
        state_dict = attach_quantized(model, state_dict, stored, dtype, f"weights in {str(weights_file)!r}")
        dtype = None  # applied to the float tensors above; the scales stay bfloat16
    check_state_dict(model, state_dict, f"weights in {str(weights_file)!r}")
    check_finite(state_dict, f"weights in {str(weights_file)!r}")
    model.load_state_dict(state_dict, strict=True, assign=True)
    # the gates are checked against the weights as stored (before any move or cast)
    weights_id = model_fingerprint(model)["weights"] if (path / GATES_FILE).exists() else None
    model = model.to(device=torch.device("cpu") if device is None else torch.device(device))
    if dtype is not None:
        model = model.to(dtype=dtype)
    model.eviction_gates = _load_gates(path, config, model.lm_head.weight.device, weights_id)
    return model.eval()


def save_gates(gates: EvictionGates, path: str | Path) -> Path:
    """Write eviction gates atomically to a safetensors file (`GATES_FILE` in a checkpoint directory)."""
    from safetensors.torch import save_file

    tensors, metadata = gates.file_contents()
    return write_atomic(Path(path), lambda tmp: save_file(tensors, str(tmp), metadata=metadata))


def _load_gates(path: Path, config: Config, device: torch.device, weights_id: str | None) -> EvictionGates | None:
    """The eviction gates in `path / GATES_FILE` on `device`, checked against `config` and the weights'
    fingerprint `weights_id` (gates that record none are refused); `None` without the file."""
    gates_file = path / GATES_FILE
    if not gates_file.exists():
        return None
    if not gates_file.is_file():
        raise ValueError(f"{str(gates_file)!r} must be an eviction-gates safetensors file, got a directory or device")
    gates = EvictionGates.load(gates_file)
    gates.check_model(config.n_layer, config.n_query_groups, config.head_size, config.n_embd, str(gates_file))
    if gates.weights is None:  # gates that cannot prove their weights are never run
        raise ValueError(
            f"{str(gates_file)!r}: these eviction gates record no fingerprint of the weights they were trained "
            "for (metadata key 'weights'), so they cannot be matched to this checkpoint; train gates for it with "
            "`litkv finetune --learn_eviction true` or remove the file"
        )
    if gates.weights != weights_id:
        raise ValueError(
            f"{str(gates_file)!r}: these eviction gates were trained for other weights (fingerprint "
            f"{gates.weights[:16]}, the checkpoint's weights are {str(weights_id)[:16]}); train gates for "
            "them with `litkv finetune --learn_eviction true` or remove the file"
        )
    return gates.to(device)


# -- tokenizer -------------------------------------------------------------------------------------


def read_json_object(path: Path) -> dict:
    """The JSON object in `path`; ValueError naming the file if it is not valid JSON or not an object."""
    import json

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from err
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _check_tokenizer_config(path: Path) -> None:
    """ValueError/TypeError unless `tokenizer_config.json` is a JSON object with usable special tokens."""
    config = read_json_object(path)
    for key in ("bos_token", "eos_token"):
        token = config.get(key)
        if isinstance(token, dict):
            token = token.get("content")
        if token is not None and not isinstance(token, str):
            raise TypeError(f"{path}: {key} must be a string, got {type(token).__name__} {token!r:.80}")
    if "add_bos_token" in config and not isinstance(config["add_bos_token"], bool):
        raise TypeError(f"{path}: add_bos_token must be true or false, got {config['add_bos_token']!r:.80}")
    if "tokenizer_class" in config and not isinstance(config["tokenizer_class"], str):
        raise TypeError(f"{path}: tokenizer_class must be a string, got {config['tokenizer_class']!r:.80}")


def _check_tokenizer_json(path: Path) -> None:
    import json

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        kind = "empty" if path.stat().st_size == 0 else "not valid JSON"
        raise ValueError(f"{path} is {kind}: {err}") from err
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        raise ValueError(f"{path} is not a Hugging Face tokenizer file: expected a JSON object with a 'model'")


def load_tokenizer(checkpoint_dir: str | Path):  # -> litgpt.tokenizer.Tokenizer
    """LitGPT's `Tokenizer` for `checkpoint_dir` (`tokenizer.json` or `tokenizer.model`; or the name of a
    downloaded known model, as `load_model` takes), with `checkpoint_dir` set to the directory it was read
    from (`litkv.chat_prompt` finds the chat template there).

    Raises:
        FileNotFoundError: no tokenizer file.
        ValueError/TypeError: a tokenizer file that cannot be read (named).
    """
    from litgpt.tokenizer import Tokenizer

    path = model_dir(checkpoint_dir)
    if not path.is_dir():
        raise FileNotFoundError(unknown_checkpoint_message(checkpoint_dir))
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"checkpoint directory {str(path)!r} has no tokenizer: expected {' or '.join(TOKENIZER_FILES)}"
        )
    if (path / "tokenizer.json").is_file():
        _check_tokenizer_json(path / "tokenizer.json")
    if (path / "tokenizer_config.json").is_file():
        _check_tokenizer_config(path / "tokenizer_config.json")
    try:
        tokenizer = Tokenizer(path)
    except KeyError as err:
        raise ValueError(f"tokenizer files in {str(path)!r} are incomplete: missing key {err}") from err
    except (ValueError, TypeError) as err:
        raise ValueError(f"tokenizer files in {str(path)!r} are invalid: {_one_line(err)}") from err
    except Exception as err:  # tokenizers and sentencepiece raise plain Exception/RuntimeError on bad files
        raise ValueError(f"cannot read the tokenizer in {str(path)!r}: {_one_line(err)}") from err
    tokenizer.checkpoint_dir = path  # where its chat template is (`litkv.inference.chat_prompt`)
    return tokenizer


# -- atomic writes (litkv.core.atomic) -------------------------------------------------------------------


def save_state_dict_atomic(path: str | Path, state_dict: Mapping[str, torch.Tensor]) -> Path:
    """Save tensors atomically: safetensors for a `.safetensors` path, `torch.save` otherwise.

    Tensors that share memory (tied weights) are cloned so that safetensors accepts them.
    """
    path = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int]] = set()
    for key, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"state_dict[{key!r}] must be a tensor, got {type(value).__name__}")
        tensor = value.detach()
        ident = (tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes())
        if ident in seen or not tensor.is_contiguous():
            tensor = tensor.clone(memory_format=torch.contiguous_format)
        seen.add(ident)
        tensors[key] = tensor.cpu()
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file

        return write_atomic(path, lambda tmp: save_file(tensors, str(tmp)))
    return write_atomic(path, lambda tmp: torch.save(tensors, tmp))
