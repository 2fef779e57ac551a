"""Safe loading and saving of checkpoint directories (LitGPT layout).

A checkpoint directory holds `model_config.yaml` (a `litgpt.Config`), the weights as
`model.safetensors` (preferred) or `lit_model.pth`, and the tokenizer files (`tokenizer.json` or
`tokenizer.model`, optionally `tokenizer_config.json`). Weights are read with safetensors or with
`torch.load(weights_only=True)` only: a `.pth` file that pickles anything but tensors (and plain
containers of them) is refused.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from litkv.config import Config
from litkv.model import GPT

__all__ = [
    "CONFIG_FILE",
    "SAFETENSORS_FILE",
    "PTH_FILE",
    "TOKENIZER_FILES",
    "default_checkpoint_dir",
    "check_checkpoint_dir",
    "check_state_dict",
    "find_weights_file",
    "load_config",
    "load_state_dict",
    "load_model",
    "load_tokenizer",
    "save_file_atomic",
    "save_state_dict_atomic",
]

CONFIG_FILE = "model_config.yaml"
SAFETENSORS_FILE = "model.safetensors"
PTH_FILE = "lit_model.pth"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


def default_checkpoint_dir() -> Path:
    """The small model shipped with the package: `litkv/assets/default`."""
    import litkv

    return Path(litkv.__file__).parent / "assets" / "default"


def check_checkpoint_dir(checkpoint_dir: str | Path, weights: bool = True, tokenizer: bool = True) -> Path:
    """Check that `checkpoint_dir` holds a config, weights and a tokenizer; return it as a `Path`.

    Raises:
        FileNotFoundError: naming the directory and the first missing file.
    """
    path = Path(checkpoint_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {str(path)!r} does not exist")
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


def load_config(checkpoint_dir: str | Path) -> Config:
    """The model `Config` from `checkpoint_dir/model_config.yaml`."""
    path = Path(checkpoint_dir) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint directory {str(checkpoint_dir)!r} has no {CONFIG_FILE}")
    try:
        return Config.from_file(path)
    except TypeError as err:
        raise ValueError(f"{path} is not a valid litgpt model config: {err}") from err


def load_state_dict(path: str | Path, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """Read a state dict from a `.safetensors` file or a tensors-only `.pth` file.

    A `.pth` file whose top level is `{"model": state_dict}` (LitGPT/Fabric training checkpoints) is
    unwrapped. Anything that is not a mapping of names to tensors is refused with a ValueError.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"weights file {str(path)!r} does not exist")
    map_location = torch.device("cpu") if device is None else torch.device(device)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path), device=str(map_location))
    try:
        obj = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(
            f"refusing to load {str(path)!r}: it contains pickled objects other than tensors "
            f"(only torch.load(weights_only=True) is allowed; {first})"
        ) from err
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
    """Raise ValueError unless `state_dict` has exactly the keys and shapes of `model`'s."""
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


def load_model(
    checkpoint_dir: str | Path, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> GPT:
    """Build the `GPT` of `checkpoint_dir` and load its weights (in eval mode).

    Args:
        checkpoint_dir: directory with `model_config.yaml` and `model.safetensors` or `lit_model.pth`.
        device: where to put the model (default: CPU).
        dtype: floating dtype of the parameters (default: the dtype stored in the file).
    """
    path = check_checkpoint_dir(checkpoint_dir, tokenizer=False)
    config = load_config(path)
    state_dict = load_state_dict(find_weights_file(path))
    with torch.device("meta"):
        model = GPT(config)
    check_state_dict(model, state_dict, f"weights in {str(path)!r}")
    model.load_state_dict(state_dict, strict=True, assign=True)
    model = model.to(device=torch.device("cpu") if device is None else torch.device(device))
    if dtype is not None:
        model = model.to(dtype=dtype)
    return model.eval()


def load_tokenizer(checkpoint_dir: str | Path):  # -> litgpt.tokenizer.Tokenizer
    """LitGPT's `Tokenizer` for `checkpoint_dir` (`tokenizer.json` or `tokenizer.model`)."""
    from litgpt.tokenizer import Tokenizer

    path = Path(checkpoint_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {str(path)!r} does not exist")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"checkpoint directory {str(path)!r} has no tokenizer: expected {' or '.join(TOKENIZER_FILES)}"
        )
    try:
        return Tokenizer(path)
    except KeyError as err:
        raise ValueError(f"tokenizer files in {str(path)!r} are incomplete: missing key {err}") from err


def save_file_atomic(path: str | Path, write_fn: Callable[[Path], None]) -> Path:
    """Write `path` atomically: `write_fn(tmp_path)` writes a temporary file in the same directory,
    which then replaces `path` (`os.replace`). On error the temporary file is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write_fn(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


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

        return save_file_atomic(path, lambda tmp: save_file(tensors, str(tmp)))
    return save_file_atomic(path, lambda tmp: torch.save(tensors, tmp))
