"""A decode step's MLP half in one C call (`litkv.modeling.decode_mlp`) against the block's own modules and a float64
oracle, both ways the library is built (`quant_rows.INT8_ACTIVATIONS`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from litgpt.config import Config
from litgpt.model import GemmaMLP, LLaMAMLP, RMSNorm

from litkv.modeling import decode_mlp, quant_rows
from litkv.modeling.quant_weights import Int4Linear, WeightQuant, quantize_model

EPS = 2.0**-23


def _block(width: int = 128, hidden: int = 320, group: int = 32, mlp: type = LLaMAMLP, seed: int = 0):
    """An RMSNorm and an int4 `mlp` of LitGPT's, weights large enough that silu sees both tails."""
    torch.manual_seed(seed)
    config = Config(n_embd=width, intermediate_size=hidden, bias=False, n_layer=1, n_head=2, padded_vocab_size=64)
    norm, module = RMSNorm(width, eps=1e-5), mlp(config)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(width) + 0.5)
        for layer in (module.fc_1, module.fc_2, module.proj):
            layer.weight.normal_(0, 3 * layer.in_features**-0.5)
    quantize_model(module, WeightQuant("int4", group))
    return norm.eval(), module.eval()


def _modules(norm: RMSNorm, mlp: LLaMAMLP, x: torch.Tensor) -> torch.Tensor:
    return mlp(norm(x)) + x


def _oracle(norm: RMSNorm, mlp: LLaMAMLP, x: torch.Tensor) -> torch.Tensor:
    """In float64 from the dequantised weights (no rounding of the rows)."""
    x = x.double()
    m = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + norm.eps) * norm.weight.double()
    w1, w2, w3 = (layer.dequantized(torch.float64) for layer in (mlp.fc_1, mlp.fc_2, mlp.proj))
    return (F.silu(m @ w1.T) * (m @ w2.T)) @ w3.T + x


@pytest.fixture(params=[True, False], ids=["int8-activations", "float-activations"])
def activations(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    monkeypatch.setattr(quant_rows, "INT8_ACTIVATIONS", request.param)
    if quant_rows.library() is None:
        pytest.skip("no C compiler: the block runs its modules")
    if torch.get_num_threads() != 1:
        pytest.skip("PyTorch runs on more than one thread: the C call is not taken")
    return quant_rows.rows_quantized()


@pytest.mark.parametrize(("width", "hidden", "group"), [(128, 320, 32), (576, 1536, 32), (256, 512, 64)])
@pytest.mark.parametrize("rows", [1, 3])
def test_the_c_call_is_the_blocks_modules(width: int, hidden: int, group: int, rows: int, activations: bool) -> None:
    norm, mlp = _block(width, hidden, group)
    x = torch.randn(rows, 1, width) * 2
    with torch.inference_mode():
        fused = decode_mlp.mlp_step(norm, mlp, x)
        modules = _modules(norm, mlp, x)
    oracle = _oracle(norm, mlp, x)
    assert fused is not None and fused.shape == x.shape and fused.dtype == torch.float32
    scale = oracle.abs().max()
    if activations:  # a row rounded to int8 may round one input the other way after the norm's last bit
        assert (fused - modules).abs().max() <= 2e-3 * scale
        assert (fused.double() - oracle).abs().max() <= 2e-2 * scale
    else:  # the norm's sum and silu's exponential: a few units in the last place
        assert (fused - modules).abs().max() <= 64 * EPS * scale
        assert (fused.double() - oracle).abs().max() <= 256 * EPS * scale


def test_silu_across_its_range_and_the_clamp(activations: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    norm, mlp = _block()
    with torch.no_grad():  # fc_1's outputs from -400 to 400: exp's clamp at both ends
        mlp.fc_1 = Int4Linear.from_linear(_scaled(mlp.fc_1.dequantized(torch.float32), 60.0), 32)
    x = torch.randn(4, 1, 128)
    with torch.inference_mode():
        fused = decode_mlp.mlp_step(norm, mlp, x)
        modules = _modules(norm, mlp, x)
    assert torch.isfinite(fused).all()
    tolerance = 2e-3 if activations else 64 * EPS
    assert (fused - modules).abs().max() <= tolerance * modules.abs().max()


def _scaled(weight: torch.Tensor, factor: float) -> torch.nn.Linear:
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        layer.weight.copy_(weight * factor)
    return layer


def test_a_row_gives_the_same_bits_alone_and_in_a_batch(activations: bool) -> None:
    norm, mlp = _block()
    x = torch.randn(5, 1, 128)
    with torch.inference_mode():
        together = decode_mlp.mlp_step(norm, mlp, x)
        for r in range(5):
            assert torch.equal(decode_mlp.mlp_step(norm, mlp, x[r : r + 1]), together[r : r + 1])


def test_compiled_steps_take_the_same_call_as_an_op(activations: bool) -> None:
    norm, mlp = _block()
    x = torch.randn(2, 1, 128)
    with torch.inference_mode():
        eager = decode_mlp.mlp_step(norm, mlp, x)
        compiled = torch.compile(lambda t: decode_mlp.mlp_step(norm, mlp, t), backend="aot_eager", fullgraph=True)(x)
    assert torch.equal(compiled, eager)


def test_on_more_threads_the_call_gives_the_modules_bits() -> None:
    norm, mlp = _block()
    x = torch.randn(2, 1, 128)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.inference_mode():
            fused = decode_mlp.mlp_step(norm, mlp, x)
            modules = _modules(norm, mlp, x)
    finally:
        torch.set_num_threads(threads)
    assert fused is not None and torch.equal(fused, modules)


def test_blocks_and_calls_it_does_not_fit_run_their_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    norm, mlp = _block()
    x = torch.randn(1, 1, 128)
    gemma_norm, gemma = _block(mlp=GemmaMLP)
    offset = RMSNorm(128, add_unit_offset=True)
    float_norm, float_mlp = RMSNorm(128), LLaMAMLP(Config(n_embd=128, intermediate_size=320, bias=False))
    with torch.inference_mode():
        assert decode_mlp.mlp_step(gemma_norm, gemma, x) is None  # another activation
        assert decode_mlp.mlp_step(offset, mlp, x) is None  # Gemma's norm
        assert decode_mlp.mlp_step(float_norm, float_mlp, x) is None  # float weights
        assert decode_mlp.mlp_step(norm, mlp, torch.randn(9, 1, 128)) is None  # a prefill chunk
        assert decode_mlp.mlp_step(norm, mlp, x.double()) is None
        monkeypatch.setattr(quant_rows, "CPU_KERNEL", False)
        assert decode_mlp.mlp_step(norm, mlp, x) is None
    monkeypatch.undo()
    grad = x.clone().requires_grad_()
    assert decode_mlp.mlp_step(norm, mlp, grad) is None  # autograd: the modules
