"""Weight-only quantised linear layers (int8 per output channel, int4 group-wise), swapped into a model.

The decode step of a small model on a CPU is bound by the bytes of weights it reads; storing them as
int8 or int4 codes cuts those bytes by 4x or ~6x. The products use PyTorch's own packed CPU kernels:

- int8: `torch._weight_int8pack_mm(x, codes, scales)`: symmetric codes `(N, K)` int8, one scale per
  output channel `(N,)` (the kernel takes no groups), `w[n, k] = scales[n] * codes[n, k]`.
- int4: `torch._weight_int4pack_mm_for_cpu(x, packed, group_size, scale_zeros)`: asymmetric codes
  `c` in `[0, 15]` per group of `group_size` input columns (32, 64, 128 or 256: what the kernel
  takes), `w[n, k] = (c[n, k] - 8) * scale[g, n] + zero[g, n]` with `g = k // group_size`; the codes
  packed by `torch._convert_weight_to_int4pack_for_cpu` (`(N, K / 2)` uint8), `scale_zeros`
  `(K / group_size, N, 2)`. The kernel needs `N` a multiple of 16 and `K` a multiple of the group size.

Both kernels are fast on CPU only with bfloat16 activations (in float32 they fall back to a scalar
loop, slower than a float32 matmul; docs/results/cpu_speed.md), so the layers take bfloat16 scales and compute
`x.to(bfloat16) @ w` then cast back to the input's dtype: the activations are rounded to bfloat16
(8 significant bits) on the way in, the outputs on the way out. Where PyTorch runs on one thread, calls of
up to `KERNEL_ROWS` float32 rows take C products over the same codes instead, in float32 (`litkv.modeling.quant_rows`:
the int4 codes in the packed layout where litkv reads it, `unpackable`). Calls with more than `KERNEL_ROWS`
rows (prefill chunks) dequantise the weight to the input's dtype `_PACK_ROWS` output rows at a time
and multiply in that dtype, which is faster there (`dense_product`: no temporary of a whole layer's
weight). A call that needs a gradient (LoRA on a quantised base, `litkv finetune --quantize`) always
takes that path; the weights stay frozen and the backward dequantises them again block by block, so
no float copy of a weight is kept for it (`_FrozenWeightProduct`).

Under `int4` the LM head is stored as int8 (`layer_quant`): on SmolLM2-135M the int4 LM head alone
made KL(float || int4) 0.064 nats/token, against 0.0016 with an int8 head (docs/cpu_speed.md).

The packed layout differs between CPU builds (AVX512, AVX2, ...): the layer unpacks the codes itself only
where `_layout_known` measures that it reads this CPU's layout, and elsewhere reads them back through the
kernel (`_kernel_codes`); either way the dequantised weight is the codes times the scales plus the zeros.

The stored format (`litkv.checkpoints.quant_store`) keeps the codes in a layout of its own (`int4_nibbles`), not the
kernel's: `Int4Linear.from_codes` packs them at load, a block of rows at a time.

torchao is not used: it is not installed, and for weight-only int8/int4 on CPU it calls these same
kernels. Only the CPU is supported (the packed layouts of the CUDA kernels differ): another device is
refused with one line.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from litkv.modeling import quant_rows

__all__ = [
    "INT4_GROUP_SIZES",
    "QuantLinear",
    "dense_product",
    "input_grad",
    "KERNEL_ROWS",
    "check_int4_shape",
    "check_layer_shape",
    "LM_HEAD",
    "QUANTIZE_MODES",
    "Int4Linear",
    "Int8Linear",
    "WeightQuant",
    "int4_codes",
    "int4_from_nibbles",
    "int4_nibbles",
    "int8_codes",
    "layer_quant",
    "model_quant",
    "parse_quantize",
    "quantize_model",
    "stored_weight_bytes",
]

#: `--quantize` values: `none`, `int8`, `int4` (group 32) and `int4-gN` (group N).
QUANTIZE_MODES = ("none", "int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128, 256)
DEFAULT_INT4_GROUP = 32
#: Calls with more rows than this dequantise the weight a block at a time (faster for prefill chunks).
KERNEL_ROWS = 8
_INT4_N_MULTIPLE = 16
_INT8_K_MULTIPLE = 16
_KERNEL_DTYPE = torch.bfloat16
#: Rows packed per call of `torch._convert_weight_to_int4pack_for_cpu` (a multiple of its 64-row blocks),
#: so that the int32 codes it takes are never a whole layer's.
_PACK_ROWS = 1024
#: The linear layer that `int4` stores as int8 (`layer_quant`).
LM_HEAD = "lm_head"


@dataclass(frozen=True)
class WeightQuant:
    """How a model's linear weights are stored: `mode` `"none"`, `"int8"` or `"int4"`; `group_size`
    (int4 only): input columns sharing a scale and zero."""

    mode: str
    group_size: int = DEFAULT_INT4_GROUP

    def __post_init__(self) -> None:
        if self.mode not in QUANTIZE_MODES:
            raise ValueError(f"quantize mode must be one of {list(QUANTIZE_MODES)}, got {self.mode!r}")
        if self.mode == "int4" and self.group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"int4 group size must be one of {list(INT4_GROUP_SIZES)}, got {self.group_size!r}")

    @property
    def name(self) -> str:
        """The `--quantize` string of this setting."""
        if self.mode == "int4" and self.group_size != DEFAULT_INT4_GROUP:
            return f"int4-g{self.group_size}"
        return self.mode


def layer_quant(name: str, quant: WeightQuant) -> WeightQuant:
    """The scheme of the linear layer `name` under `quant`: `quant` itself, except that the int4 modes
    keep the LM head at int8 (its int4 codes were most of int4's KL on SmolLM2-135M: docs/cpu_speed.md)."""
    if quant.mode == "int4" and name == LM_HEAD:
        return WeightQuant("int8")
    return quant


def parse_quantize(text: str) -> WeightQuant:
    """`"none"`, `"int8"`, `"int4"` or `"int4-gN"` (N in `INT4_GROUP_SIZES`) -> `WeightQuant`."""
    if not isinstance(text, str):
        raise TypeError(f"quantize must be a string, got {type(text).__name__}")
    if text.startswith("int4-g"):
        digits = text[len("int4-g") :]
        if not digits.isdigit():
            raise ValueError(f"quantize must be 'none', 'int8', 'int4' or 'int4-gN' (N a number), got {text!r}")
        return WeightQuant("int4", int(digits))
    return WeightQuant(text)


class Int8Linear(nn.Module):
    """`y = x @ w.T + bias` with `w` stored as int8 codes and one bfloat16 scale per output channel.

    Attributes:
        codes: `(out_features, in_features)` int8; scales: `(out_features,)` bfloat16.
        bias: `(out_features,)` in the model dtype, or `None`.
    """

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.codes = nn.Parameter(codes, requires_grad=False)
        self.scales = nn.Parameter(scales, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.register_buffer("weight", torch.empty(0, dtype=_dtype_of(bias)), persistent=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        """Symmetric per-channel int8 codes of `linear`'s weight (`int8_codes`); ValueError for shapes the kernel
        cannot take."""
        check_layer_shape(linear.out_features, linear.in_features, WeightQuant("int8"))
        module = cls(*int8_codes(linear.weight), _bias(linear))
        module.weight = torch.empty(0, dtype=linear.weight.dtype, device=linear.weight.device)
        return module

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight the layer multiplies by, `(out_features, in_features)` in `dtype`."""
        return self.dequantized_rows(0, self.out_features, dtype)

    def dequantized_rows(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows `start:stop` of the weight, `(stop - start, in_features)` in `dtype`."""
        return (self.codes[start:stop].to(dtype) * self.scales[start:stop].to(dtype)[:, None]).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x` `(..., in_features)` -> `(..., out_features)` in `x`'s dtype (`_product`)."""
        return _product(self, x)

    def kernel(self, flat: torch.Tensor) -> torch.Tensor:
        """`flat` `(rows, in_features)` -> `(rows, out_features)` in `flat`'s dtype: the C product in float32
        (`quant_rows.int8_rows`) where it applies, else the packed kernel in bfloat16."""
        if quant_rows.int8_applies(flat, self.codes):
            op = quant_rows.int8_rows_op if torch.compiler.is_compiling() else quant_rows.int8_rows
            return op(flat, self.codes, self.scales)
        return quant_rows.int8_packed(flat, self.codes, self.scales)


class Int4Linear(nn.Module):
    """`y = x @ w.T + bias` with `w` stored as group-wise int4 codes in the CPU kernel's packed layout.

    Attributes:
        packed: `(out_features, in_features / 2)` uint8 (`torch._convert_weight_to_int4pack_for_cpu`).
        scale_zeros: `(in_features / group_size, out_features, 2)` bfloat16: scale, then zero.
        bias: `(out_features,)` in the model dtype, or `None`.
    """

    def __init__(
        self, packed: torch.Tensor, scale_zeros: torch.Tensor, group_size: int, bias: torch.Tensor | None
    ) -> None:
        super().__init__()
        self.out_features = packed.shape[0]
        self.in_features = scale_zeros.shape[0] * group_size
        self.group_size = group_size
        self.packed = nn.Parameter(packed, requires_grad=False)
        self.scale_zeros = nn.Parameter(scale_zeros, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.register_buffer("weight", torch.empty(0, dtype=_dtype_of(bias)), persistent=False)
        self.unpackable = _layout_known(packed)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int) -> Int4Linear:
        """Asymmetric int4 codes of `linear`'s weight per group of `group_size` input columns
        (`int4_codes`); ValueError for shapes the kernel cannot take."""
        check_int4_shape(linear.out_features, linear.in_features, group_size)
        codes, scale_zeros = int4_codes(linear.weight, group_size)
        module = cls.from_codes(codes, scale_zeros, group_size, _bias(linear))
        module.weight = torch.empty(0, dtype=linear.weight.dtype, device=linear.weight.device)
        return module

    @classmethod
    def from_codes(
        cls,
        codes: torch.Tensor,
        scale_zeros: torch.Tensor,
        group_size: int,
        bias: torch.Tensor | None,
        nibbles: bool = False,
    ) -> Int4Linear:
        """The layer of `codes` `(out_features, in_features)` uint8 in `[0, 15]` (or, `nibbles=True`, their
        `int4_nibbles` `(out_features, in_features / 2)`) and `scale_zeros` `(in_features / group_size,
        out_features, 2)` bfloat16, packed `_PACK_ROWS` rows at a time (no temporary is a whole layer's,
        and each block of `packed` is a packing of its own, which `codes_rows` reads on any layout)."""
        n = codes.shape[0]
        parts = []
        for start in range(0, n, _PACK_ROWS):
            block = codes[start : start + _PACK_ROWS]
            block = int4_from_nibbles(block) if nibbles else block
            parts.append(torch._convert_weight_to_int4pack_for_cpu(block.to(torch.int32), 1))
        return cls(torch.cat(parts) if len(parts) > 1 else parts[0], scale_zeros, group_size, bias)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight the layer multiplies by, `(out_features, in_features)` in `dtype`."""
        return self.dequantized_rows(0, self.out_features, dtype)

    def dequantized_rows(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows `start:stop` of the weight, `(stop - start, in_features)` in `dtype`: the codes (`codes_rows`)
        times the scales plus the zeros, computed in at least float32 (no bfloat16 rounding of the weight)."""
        n, k = stop - start, self.in_features
        compute = torch.promote_types(dtype, torch.float32)
        groups = self.codes_rows(start, stop).to(compute).view(n, k // self.group_size, self.group_size)
        parts = self.scale_zeros[:, start:stop].unbind(-1)
        scale, zero = (part.T.to(compute)[..., None] for part in parts)  # (rows, n_groups, 1)
        return groups.sub_(8).mul_(scale).add_(zero).view(n, k).to(dtype)

    def codes_rows(self, start: int, stop: int) -> torch.Tensor:
        """The codes of rows `start:stop`, `(stop - start, in_features)` uint8 in `[0, 15]`: unpacked when the
        packed layout is the known one (`unpackable`), else read back through the kernel itself (`_kernel_codes`)
        one packed block of `_PACK_ROWS` rows at a time, whatever this CPU's layout."""
        if self.unpackable and start % 64 == 0 and (stop % 64 == 0 or stop == self.out_features):
            return _unpack(self.packed[start:stop])
        first = start - start % _PACK_ROWS
        blocks = [
            _kernel_codes(self.packed[b : b + _PACK_ROWS], self.in_features, self.group_size)
            for b in range(first, stop, _PACK_ROWS)
        ]
        return torch.cat(blocks)[start - first : stop - first]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x` `(..., in_features)` -> `(..., out_features)` in `x`'s dtype (`_product`)."""
        return _product(self, x)

    def kernel(self, flat: torch.Tensor) -> torch.Tensor:
        """`flat` `(rows, in_features)` -> `(rows, out_features)` in `flat`'s dtype: the C product in float32
        (`quant_rows.int4_rows`, on the packed layout where litkv reads it) where it applies, else the packed
        kernel in bfloat16."""
        if quant_rows.int4_applies(flat, self.packed, self.group_size, self.unpackable):
            op = quant_rows.int4_rows_op if torch.compiler.is_compiling() else quant_rows.int4_rows
            return op(flat, self.packed, self.scale_zeros, self.group_size)
        return quant_rows.int4_packed(flat, self.packed, self.scale_zeros, self.group_size)


def int8_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-channel int8 codes of `weight` `(N, K)`: `scale = max|w| / 127` rounded to bfloat16,
    codes `round(w / scale)`; returns codes `(N, K)` int8 and scales `(N,)` bfloat16."""
    w = weight.detach().float().contiguous()  # codes row-major, as the kernel takes them, from any layout
    scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12).to(_KERNEL_DTYPE)
    return (w / scales.float()[:, None]).round_().clamp_(-127, 127).to(torch.int8), scales


def int4_codes(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric int4 codes of `weight` `(N, K)` per group of `group_size` input columns: `scale = (max -
    min) / 15` rounded to bfloat16, codes `round((w - min) / scale)` in `[0, 15]`, and the kernel's zero
    `min + 8 * scale` (it computes `(c - 8) * scale + zero`); returns codes `(N, K)` uint8 and
    `scale_zeros` `(K / group_size, N, 2)` bfloat16."""
    n, k = weight.shape
    groups = weight.detach().float().reshape(n, k // group_size, group_size)
    low, high = torch.aminmax(groups, dim=-1)
    scale = ((high - low) / 15).clamp(min=1e-12).to(_KERNEL_DTYPE).float()
    codes = ((groups - low[..., None]) / scale[..., None]).round_().clamp_(0, 15).to(torch.uint8)
    zero = low + 8 * scale
    scale_zeros = torch.stack((scale.T, zero.T), dim=-1).to(_KERNEL_DTYPE).contiguous()
    return codes.reshape(n, k), scale_zeros


def int4_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Codes `(N, K)` uint8 in `[0, 15]` -> `(N, K / 2)` uint8: column `2j` in the low nibble of byte `j`,
    column `2j + 1` in its high nibble (the stored format's layout, independent of the kernel's)."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def int4_from_nibbles(nibbles: torch.Tensor) -> torch.Tensor:
    """Inverse of `int4_nibbles`: `(N, K / 2)` uint8 -> codes `(N, K)` uint8."""
    return torch.stack((nibbles & 0x0F, nibbles >> 4), dim=-1).reshape(nibbles.shape[0], -1)


QuantLinear = Int8Linear | Int4Linear


def _product(layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """`x @ w.T + bias` for a quantised layer, `x` `(..., in_features)` -> `(..., out_features)` in `x`'s
    dtype: up to `KERNEL_ROWS` rows by the layer's `kernel` (in C in float32, or the packed kernel in bfloat16),
    more rows (prefill chunks) and every call that needs a gradient by `dense_product` in `x`'s dtype. The
    gradient flows to `x` only (the weights are frozen) and keeps no float copy of the weight
    (`_FrozenWeightProduct`)."""
    flat = x.reshape(-1, layer.in_features)
    if torch.is_grad_enabled() and flat.requires_grad:
        y = _FrozenWeightProduct.apply(flat, layer)
    elif flat.shape[0] > KERNEL_ROWS:
        y = dense_product(layer, flat)
    else:
        y = layer.kernel(flat)
    return _finish(y, layer.bias, x.shape)


def dense_product(layer: QuantLinear, flat: torch.Tensor) -> torch.Tensor:
    """`flat @ w.T`, `(rows, in_features)` -> `(rows, out_features)` in `flat`'s dtype, with the weight
    dequantised `_PACK_ROWS` output rows at a time (no temporary of the whole weight)."""
    n = layer.out_features
    if n <= _PACK_ROWS:
        return flat @ layer.dequantized(flat.dtype).T
    y = flat.new_empty(flat.shape[0], n)
    for start in range(0, n, _PACK_ROWS):
        stop = min(start + _PACK_ROWS, n)
        y[:, start:stop] = flat @ layer.dequantized_rows(start, stop, flat.dtype).T
    return y


def input_grad(layer: QuantLinear, grad: torch.Tensor) -> torch.Tensor:
    """`grad @ w`, `(rows, out_features)` -> `(rows, in_features)`: the gradient of `dense_product` with
    respect to its input, the weight dequantised `_PACK_ROWS` rows at a time."""
    n = layer.out_features
    out = grad.new_zeros(grad.shape[0], layer.in_features)
    for start in range(0, n, _PACK_ROWS):
        stop = min(start + _PACK_ROWS, n)
        out.addmm_(grad[:, start:stop], layer.dequantized_rows(start, stop, grad.dtype))
    return out


class _FrozenWeightProduct(torch.autograd.Function):
    """`dense_product(layer, flat)` with a gradient for `flat` only: nothing of the weight is saved for
    the backward, which dequantises it again a block of rows at a time (`input_grad`)."""

    @staticmethod
    def forward(flat: torch.Tensor, layer: QuantLinear) -> torch.Tensor:  # type: ignore[override]
        return dense_product(layer, flat)

    @staticmethod
    def setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: torch.Tensor) -> None:
        ctx.layer = inputs[1]

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return input_grad(ctx.layer, grad.contiguous()), None


def check_layer_shape(out_features: int, in_features: int, quant: WeightQuant) -> None:
    """ValueError (one line) when a `(out_features, in_features)` weight cannot be stored as `quant` says: int4
    (`check_int4_shape`), or int8 with `in_features` not a multiple of 16 (PyTorch's int8 CPU kernel crashes on
    those)."""
    if quant.mode == "int4":
        check_int4_shape(out_features, in_features, quant.group_size)
    elif quant.mode == "int8" and in_features % _INT8_K_MULTIPLE != 0:
        raise ValueError(f"int8 weights need in_features a multiple of {_INT8_K_MULTIPLE}, got {in_features}")


def check_int4_shape(out_features: int, in_features: int, group_size: int) -> None:
    """ValueError (one line) when the int4 CPU kernel cannot take a `(out_features, in_features)` weight."""
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {list(INT4_GROUP_SIZES)}, got {group_size}")
    if in_features % group_size != 0:
        raise ValueError(
            f"int4 weights need in_features a multiple of the group size {group_size}, got {in_features}"
            " (choose another group size with --quantize int4-gN)"
        )
    if out_features % _INT4_N_MULTIPLE != 0:
        raise ValueError(f"int4 weights need out_features a multiple of {_INT4_N_MULTIPLE}, got {out_features}")


def stored_weight_bytes(out_features: int, in_features: int, quant: WeightQuant) -> int:
    """Bytes of one `(out_features, in_features)` linear weight stored as `quant` says (bias excluded):
    int8 codes plus bfloat16 scales per output channel; int4 packed codes plus a bfloat16 scale and zero
    per group and output channel. `"none"`: 0 (the float weight is counted where it lies)."""
    n, k = out_features, in_features
    if quant.mode == "int8":
        return n * k + 2 * n
    if quant.mode == "int4":
        return n * k // 2 + 4 * n * (k // quant.group_size)
    return 0


def model_quant(model: nn.Module) -> WeightQuant | None:
    """The scheme `model`'s linear layers are stored in (`int4-gN` when any layer is int4, else `int8`
    when any is int8), or `None` for a model without quantised layers."""
    int4 = [m.group_size for m in model.modules() if isinstance(m, Int4Linear)]
    if int4:
        return WeightQuant("int4", int4[0])
    return WeightQuant("int8") if any(isinstance(m, Int8Linear) for m in model.modules()) else None


def quantize_model(model: nn.Module, quant: WeightQuant) -> nn.Module:
    """Replace every `nn.Linear` of `model` (in place) by its `quant` counterpart (`layer_quant`: the int4
    modes keep the LM head at int8); returns `model`.

    Every layer's shape is checked before any is replaced, so a refused model is left as it was.
    Embeddings and norms stay as they are (a decode step reads one embedding row). A model loaded from a
    stored quantised checkpoint is returned as it is for `none` or its own scheme, and refused for another.
    Raises ValueError for a model not on the CPU, a layer shape the kernel cannot take (naming the
    layer), or a model stored in another scheme (naming both).
    """
    stored = model_quant(model)
    if stored is not None and quant.mode != "none" and quant != stored:
        raise ValueError(
            f"the checkpoint's weights are stored quantised as {stored.name}, --quantize {quant.name} asks for "
            f"another scheme (use --quantize {stored.name} or none, or quantise the float checkpoint)"
        )
    if quant.mode == "none" or stored is not None:
        return model
    linears = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    for name, linear in linears:
        if linear.weight.device.type != "cpu":
            raise ValueError(f"--quantize {quant.name} runs on the CPU only, got a model on {linear.weight.device}")
        try:
            check_layer_shape(linear.out_features, linear.in_features, layer_quant(name, quant))
        except ValueError as err:
            raise ValueError(f"{name}: {err}") from None
    for name, linear in linears:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if layer_quant(name, quant).mode == "int8":
            new: nn.Module = Int8Linear.from_linear(linear)
        else:
            new = Int4Linear.from_linear(linear, quant.group_size)
        setattr(parent, attr, new)
    return model


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    """The CPU kernel's packed int4 weight `(N, K / 2)` uint8 -> codes `(N, K)` uint8, for `N` a multiple
    of 64: blocks of 64 output rows, per input column 32 bytes, row `j` in the low nibble of byte `j`
    and row `j + 32` in its high nibble (found by experiment; `_layout_known` re-checks it)."""
    n, half = packed.shape
    blocks = packed.view(n // 64, 2 * half, 32)  # (row block, k, byte)
    both = torch.cat((blocks & 0x0F, blocks >> 4), dim=-1)  # (row block, k, 64 rows)
    return both.transpose(1, 2).reshape(n, 2 * half)


def _kernel_codes(packed: torch.Tensor, in_features: int, group_size: int) -> torch.Tensor:
    """The codes `(N, K)` uint8 of one block packed by `torch._convert_weight_to_int4pack_for_cpu`
    (`packed` `(N, K / 2)`), in any packed layout: the kernel on a `(K, K)` identity with scale 1 and
    zero 8 returns `(c - 8) * 1 + 8 = c`, small integers that bfloat16 holds exactly."""
    n = packed.shape[0]
    unit = torch.tensor([1.0, 8.0], dtype=_KERNEL_DTYPE, device=packed.device)
    unit = unit.expand(in_features // group_size, n, 2).contiguous()
    eye = torch.eye(in_features, dtype=_KERNEL_DTYPE, device=packed.device)
    out = torch._weight_int4pack_mm_for_cpu(eye, packed.contiguous(), group_size, unit)
    return out.T.round().clamp(0, 15).to(torch.uint8)


def _layout_known(packed: torch.Tensor) -> bool:
    """Whether `_unpack` reads `packed` right: packing its result again gives `packed` back."""
    if packed.dim() != 2 or packed.dtype != torch.uint8 or packed.shape[0] % 64 != 0:
        return False
    codes = _unpack(packed).to(torch.int32)
    return torch.equal(torch._convert_weight_to_int4pack_for_cpu(codes, 1), packed)


def _bias(linear: nn.Linear) -> torch.Tensor | None:
    return None if linear.bias is None else linear.bias.detach().clone()


def _dtype_of(bias: torch.Tensor | None) -> torch.dtype:
    return torch.float32 if bias is None else bias.dtype


def _finish(y: torch.Tensor, bias: torch.Tensor | None, shape: torch.Size) -> torch.Tensor:
    """`y` `(rows, N)` plus the bias, reshaped to `(*shape[:-1], N)`."""
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.view(*shape[:-1], y.shape[-1])
