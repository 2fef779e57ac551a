"""Where and how a model runs: the device, the parameter dtype (from a Lightning-style precision string),
torch's CPU threads, and `load_for_inference`: a checkpoint's model loaded that way, for the commands and
the server alike; `load`: a model and its tokenizer by name (`litkv.load`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from litkv.checkpoints.checkpoint import check_checkpoint_dir, load_model, load_tokenizer
from litkv.checkpoints.download import MODELS, cache_dir, download_model, model_dir
from litkv.core.validation import require_int
from litkv.modeling.model import GPT
from litkv.modeling.quant_weights import parse_quantize, quantize_model
from litkv.modeling.weight_layout import columns_contiguous

if TYPE_CHECKING:
    from litgpt.tokenizer import Tokenizer

__all__ = [
    "PRECISIONS",
    "RUNNABLE_DEVICES",
    "apply_num_threads",
    "load",
    "load_for_inference",
    "precision_dtype",
    "resolve_device",
    "resolve_dtype",
]

#: Lightning-style precision strings and the parameter dtype each one means (no mixed precision).
PRECISIONS: dict[str, torch.dtype] = {
    "32-true": torch.float32,
    "bf16-true": torch.bfloat16,
    "16-true": torch.float16,
    "64-true": torch.float64,
}

RUNNABLE_DEVICES = ("cpu", "cuda", "mps")


def precision_dtype(precision: str, allowed: tuple[str, ...] = tuple(PRECISIONS), note: str = "") -> torch.dtype:
    """The dtype of `precision`; ValueError naming the `allowed` strings (and `note`) for any other."""
    if precision not in allowed:
        raise ValueError(f"precision must be one of {list(allowed)}, got {precision!r}{note}")
    return PRECISIONS[precision]


def resolve_device(device: str | None) -> torch.device:
    """`device`, or CUDA when available, else CPU. Raises ValueError for an unusable device.

    Only devices that compute are accepted (`cpu`, `cuda`, `cuda:N`, `mps`): `meta` has no data.
    """
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"invalid device {device!r}: expected 'cpu', 'cuda', 'cuda:N' or 'mps' ({err})") from err
    if resolved.type not in RUNNABLE_DEVICES:
        raise ValueError(
            f"device {device!r} cannot run generation or evaluation; expected 'cpu', 'cuda', 'cuda:N' or 'mps'"
        )
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested, but CUDA is not available")
        count = torch.cuda.device_count()
        if resolved.index is not None and resolved.index >= count:
            raise ValueError(f"device {device!r} requested, but only {count} CUDA device(s) are visible")
    if resolved.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {device!r} requested, but MPS is not available")
    return resolved


def resolve_dtype(precision: str | None, device: torch.device) -> torch.dtype:
    """The parameter dtype for a precision string (`"32-true"`, `"bf16-true"`, ...).

    `None`: bf16 on a CUDA device that supports it, float32 otherwise.
    """
    if precision is None:
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    return precision_dtype(precision)


def apply_num_threads(num_threads: int | None) -> None:
    """Set torch's CPU thread count; `None` keeps torch's default. Raises ValueError below 1."""
    if num_threads is None:
        return
    require_int("num_threads", num_threads, 1)
    torch.set_num_threads(num_threads)


def load_for_inference(
    checkpoint_dir: Path,
    precision: str | None,
    device: str | None,
    num_threads: int | None,
    quantize: str = "none",
) -> tuple[GPT, torch.device]:
    """Set the CPU threads, then load `checkpoint_dir`'s model (eval mode, with its eviction gates if any)
    on the resolved device in the resolved dtype, its linear weights quantised as `quantize` says and the
    float ones left column-major on the CPU (`litkv.modeling.weight_layout`); returns the model and that device.

    Args:
        checkpoint_dir: a checked checkpoint directory (`litkv.checkpoints.checkpoint.check_checkpoint_dir`).
        precision: `PRECISIONS` key, or `None` (bf16 on CUDA when supported, else float32).
        device: `"cpu"`, `"cuda"`, `"cuda:N"`, `"mps"`, or `None` (CUDA when available).
        num_threads: torch's CPU threads, or `None` (torch's default).
        quantize: `"none"`, `"int8"`, `"int4"` or `"int4-gN"` (`litkv.modeling.quant_weights`; CPU only).
    """
    quant = parse_quantize(quantize)  # a bad value is refused before the weights are read
    apply_num_threads(num_threads)
    dev = resolve_device(device)
    if quant.mode != "none" and dev.type != "cpu":
        raise ValueError(f"--quantize {quant.name} runs on the CPU only (PyTorch's packed CPU kernels), got {dev}")
    model = load_model(checkpoint_dir, device=dev, dtype=resolve_dtype(precision, dev))
    return columns_contiguous(quantize_model(model, quant)), dev


def load(
    name: str | Path, device: str | None = None, precision: str | None = None, quantize: str = "none"
) -> tuple[GPT, Tokenizer]:
    """The model (eval mode, with its eviction gates if any) and the tokenizer of a known model name
    (`smollm2-135m-instruct`: downloaded and converted once into `~/.cache/litkv`, as `litkv download`
    does) or of a checkpoint directory; what `litkv generate NAME` runs.

    Args:
        name: a name in `litkv.checkpoints.download.MODELS` or a checkpoint directory.
        device: `"cpu"`, `"cuda"`, `"cuda:N"`, or `None` (CUDA when available).
        precision: `"32-true"`, `"bf16-true"`, ... or `None` (bf16 on CUDA when supported, else float32).
        quantize: `"none"`, `"int8"`, `"int4"` or `"int4-gN"` (CPU only).

    Raises:
        DownloadError: a known model that cannot be obtained (no network, no pip).
        FileNotFoundError / ValueError: a directory that is not a (valid) checkpoint.
    """
    if not isinstance(name, (str, Path)):
        raise TypeError(f"litkv.load takes a model name or a checkpoint directory (str or Path), got {name!r:.80}")
    value = str(name)
    if value in MODELS and not Path(value).exists() and not cache_dir(value).is_dir():
        download_model(value)
    path = check_checkpoint_dir(model_dir(name))
    model, _ = load_for_inference(path, precision, device, None, quantize)
    return model, load_tokenizer(path)
