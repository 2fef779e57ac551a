"""A decode step's two halves of a block, each in one C call (`litkv.modeling.fused_decode`), against the block's own
modules and float64 oracles, both ways the library is built (`quant_rows.INT8_ACTIVATIONS`); and a whole int4 model's
decode through them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_gpt
from litgpt.config import Config
from litgpt.model import GemmaMLP, LLaMAMLP, RMSNorm

from litkv import KVCacheConfig, generate
from litkv.core.rope import apply_rope
from litkv.modeling import fused_decode, quant_rows
from litkv.modeling import model as model_module
from litkv.modeling.quant_weights import Int4Linear, WeightQuant, quantize_model
from litkv.modeling.self_attention import CausalSelfAttention

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
    if isinstance(module.fc_1, Int4Linear):
        _needs_layout(module.fc_1)
    return norm.eval(), module.eval()


def _needs_layout(layer: Int4Linear) -> None:
    if not layer.unpackable:
        pytest.skip("this CPU packs int4 in a layout litkv does not read (the blocks run their modules)")


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
        fused = fused_decode.mlp_step(norm, mlp, x, None, None)
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


@pytest.mark.parametrize("threads", [1, 2])
def test_the_attention_projection_in_the_same_call(threads: int, activations: bool) -> None:
    """`h = x + attn_proj(heads)`, then `h + mlp(norm(h))`: against the modules (on two threads bit for bit: the
    modules' own operators), a batch's rows alone, compiled; a projection of another group size is not taken."""
    norm, mlp = _block()
    attn_proj = Int4Linear.from_linear(_scaled(torch.randn(128, 192) * 192**-0.5, 1.0), 32)
    x, heads = torch.randn(3, 1, 128), torch.randn(3, 1, 192)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            fused = fused_decode.mlp_step(norm, mlp, x, heads, attn_proj)
            h = attn_proj(heads) + x
            modules = _modules(norm, mlp, h)
            alone = [fused_decode.mlp_step(norm, mlp, x[r : r + 1], heads[r : r + 1], attn_proj) for r in range(3)]
            step = torch.compile(
                lambda a, b: fused_decode.mlp_step(norm, mlp, a, b, attn_proj), backend="aot_eager", fullgraph=True
            )
            compiled = step(x, heads)
    finally:
        torch.set_num_threads(previous)
    if threads == 2:
        assert torch.equal(fused, modules)
    else:
        tolerance = 2e-3 if activations else 64 * EPS
        assert (fused - modules).abs().max() <= tolerance * modules.abs().max()
    assert torch.equal(torch.cat(alone), fused) and torch.equal(compiled, fused)
    other = Int4Linear.from_linear(_scaled(torch.randn(128, 192), 1.0), 64)
    assert fused_decode.mlp_step(norm, mlp, x, heads, other) is None


def test_silu_across_its_range_and_the_clamp(activations: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    norm, mlp = _block()
    with torch.no_grad():  # fc_1's outputs from -400 to 400: exp's clamp at both ends
        mlp.fc_1 = Int4Linear.from_linear(_scaled(mlp.fc_1.dequantized(torch.float32), 60.0), 32)
    x = torch.randn(4, 1, 128)
    with torch.inference_mode():
        fused = fused_decode.mlp_step(norm, mlp, x, None, None)
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
        together = fused_decode.mlp_step(norm, mlp, x, None, None)
        for r in range(5):
            assert torch.equal(fused_decode.mlp_step(norm, mlp, x[r : r + 1], None, None), together[r : r + 1])


def test_compiled_steps_take_the_same_call_as_an_op(activations: bool) -> None:
    norm, mlp = _block()
    x = torch.randn(2, 1, 128)
    with torch.inference_mode():
        eager = fused_decode.mlp_step(norm, mlp, x, None, None)
        compiled = torch.compile(
            lambda t: fused_decode.mlp_step(norm, mlp, t, None, None), backend="aot_eager", fullgraph=True
        )(x)
    assert torch.equal(compiled, eager)


def test_on_more_threads_the_call_gives_the_modules_bits() -> None:
    norm, mlp = _block()
    x = torch.randn(2, 1, 128)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.inference_mode():
            fused = fused_decode.mlp_step(norm, mlp, x, None, None)
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
        assert fused_decode.mlp_step(gemma_norm, gemma, x, None, None) is None  # another activation
        assert fused_decode.mlp_step(offset, mlp, x, None, None) is None  # Gemma's norm
        assert fused_decode.mlp_step(float_norm, float_mlp, x, None, None) is None  # float weights
        assert fused_decode.mlp_step(norm, mlp, torch.randn(9, 1, 128), None, None) is None  # a prefill chunk
        assert fused_decode.mlp_step(norm, mlp, x.double(), None, None) is None
        monkeypatch.setattr(quant_rows, "CPU_KERNEL", False)
        assert fused_decode.mlp_step(norm, mlp, x, None, None) is None
    monkeypatch.undo()
    grad = x.clone().requires_grad_()
    assert fused_decode.mlp_step(norm, mlp, grad, None, None) is None  # autograd: the modules


def _attention(heads: int = 4, groups: int = 2, hs: int = 32, width: int = 128, seed: int = 0, **overrides: object):
    """An RMSNorm and an attention layer of litkv's with an int4 `qkv`, and its config."""
    torch.manual_seed(seed)
    settings: dict[str, object] = dict(n_embd=width, n_head=heads, n_query_groups=groups, head_size=hs, n_layer=1)
    settings.update(rotary_percentage=1.0, bias=False, padded_vocab_size=64)
    config = Config(**{**settings, **overrides})
    norm, attn = RMSNorm(width, eps=1e-5), CausalSelfAttention(config, 0)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(width) + 0.5)
    attn.qkv = Int4Linear.from_linear(attn.qkv, 32)
    _needs_layout(attn.qkv)
    return norm.eval(), attn.eval(), config


def _angles(batch: int, t: int, hs: int) -> tuple[torch.Tensor, torch.Tensor]:
    theta = torch.rand(batch, t, hs // 2) * 50
    theta = torch.cat((theta, theta), dim=-1)  # half-split pairs share an angle
    return theta.cos(), theta.sin()


@pytest.mark.parametrize(("heads", "groups", "hs", "width"), [(4, 2, 32, 128), (9, 3, 64, 576)])
@pytest.mark.parametrize(("batch", "t", "cos_rows"), [(1, 1, 1), (3, 1, 3), (2, 3, 1)])
def test_qkv_call_is_the_norm_projection_and_rope(
    heads: int, groups: int, hs: int, width: int, batch: int, t: int, cos_rows: int, activations: bool
) -> None:
    norm, attn, config = _attention(heads, groups, hs, width)
    x = torch.randn(batch, t, width) * 2
    cos, sin = _angles(cos_rows, t, hs)
    with torch.inference_mode():
        m, q, k, v = fused_decode.qkv_step(norm, attn.qkv, config, x, cos, sin)
        normed = norm(x)
        q_ref, k_ref, v_ref = attn.heads(attn.qkv(normed), cos, sin)
    assert q.shape == q_ref.shape and k.shape == k_ref.shape and v.shape == v_ref.shape
    assert all(part.is_contiguous() for part in (m, q, k, v))
    assert (m - normed).abs().max() <= 8 * EPS * normed.abs().max()
    # float64 oracle: the dequantised weight times the normed row (as the C call quantises it), RoPE in float64
    row = quant_rows.quantized_rows(m.reshape(-1, width)) if activations else m.reshape(-1, width)
    projected = (row.double() @ attn.qkv.dequantized(torch.float64).T).view(batch, t, -1, hs).transpose(1, 2)
    rotated = apply_rope(projected[:, : heads + groups], cos.double(), sin.double())
    scale = projected.abs().max()
    assert (q.double() - rotated[:, :heads]).abs().max() <= 1e-5 * scale
    assert (k.double() - rotated[:, heads:]).abs().max() <= 1e-5 * scale
    assert (v.double() - projected[:, heads + groups :]).abs().max() <= 1e-5 * scale
    tolerance = (2e-3 if activations else 1e-5) * scale
    for got, want in ((q, q_ref), (k, k_ref), (v, v_ref)):
        assert (got - want).abs().max() <= tolerance


def test_qkv_rows_give_the_same_bits_alone_and_in_a_batch_and_compiled(activations: bool) -> None:
    norm, attn, config = _attention()
    x = torch.randn(4, 1, 128)
    cos, sin = _angles(4, 1, 32)
    with torch.inference_mode():
        together = fused_decode.qkv_step(norm, attn.qkv, config, x, cos, sin)
        for r in range(4):
            alone = fused_decode.qkv_step(norm, attn.qkv, config, x[r : r + 1], cos[r : r + 1], sin[r : r + 1])
            assert all(torch.equal(a, b[r : r + 1]) for a, b in zip(alone, together, strict=True))
        step = torch.compile(
            lambda t, c, s: fused_decode.qkv_step(norm, attn.qkv, config, t, c, s), backend="aot_eager", fullgraph=True
        )
        assert all(torch.equal(a, b) for a, b in zip(step(x, cos, sin), together, strict=True))


def test_qkv_on_more_threads_gives_the_modules_bits() -> None:
    norm, attn, config = _attention()
    x = torch.randn(2, 1, 128)
    cos, sin = _angles(1, 1, 32)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.inference_mode():
            m, q, k, v = fused_decode.qkv_step(norm, attn.qkv, config, x, cos, sin)
            normed = norm(x)
            want = attn.heads(attn.qkv(normed), cos, sin)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(m, normed) and all(torch.equal(a, b) for a, b in zip((q, k, v), want, strict=True))


@pytest.mark.parametrize(
    "overrides", [{"norm_qk": True}, {"rope_interleave": True}, {"rotary_percentage": 0.5}, {"bias": True}]
)
def test_attention_layers_it_does_not_fit_run_their_modules(overrides: dict[str, object]) -> None:
    norm, attn, config = _attention(**overrides)
    x = torch.randn(1, 1, 128)
    cos, sin = _angles(1, 1, config.rope_n_elem)
    with torch.inference_mode():
        assert fused_decode.qkv_step(norm, attn.qkv, config, x, cos, sin) is None


def test_an_int4_models_decode_through_the_c_calls_is_its_modules_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole model, float32 rows (so the only differences are the norms', RoPE's and silu's last bits): the same
    greedy tokens with the C calls and without (or parting only at a near tie); compiled the same tokens as eager."""
    monkeypatch.setattr(quant_rows, "INT8_ACTIVATIONS", False)
    if quant_rows.library() is None or torch.get_num_threads() != 1:
        pytest.skip("no C compiler, or PyTorch on more than one thread: the blocks run their modules")
    model = quantize_model(tiny_gpt(seed=5), WeightQuant("int4"))
    _needs_layout(model.transformer.h[0].attn.qkv)
    calls = {"qkv": 0, "mlp": 0}

    def counted(name: str, step):
        def call(*args):
            result = step(*args)
            calls[name] += result is not None
            return result

        return call

    monkeypatch.setattr(model_module, "qkv_step", counted("qkv", fused_decode.qkv_step))
    monkeypatch.setattr(model_module, "mlp_step", counted("mlp", fused_decode.mlp_step))
    prompt = torch.randint(0, 128, (7,))
    kv = KVCacheConfig(policy="h2o", cache_length=12, chunk_size=4)
    fused = generate(model, [prompt], 20, kv)[0]
    assert calls["qkv"] > 0 and calls["mlp"] > 0
    monkeypatch.setattr(model_module, "qkv_step", fused_decode.qkv_step)  # uncounted: a counter would recompile
    monkeypatch.setattr(model_module, "mlp_step", fused_decode.mlp_step)
    compiled = generate(model, [prompt], 20, kv, compile=True)[0]
    monkeypatch.setattr(model_module, "qkv_step", lambda *args: None)
    monkeypatch.setattr(model_module, "mlp_step", lambda *args: None)
    modules = generate(model, [prompt], 20, kv)[0]
    assert torch.equal(compiled, fused)
    differ = (fused != modules).nonzero()
    if len(differ):  # greedy paths may part only where the top two logits are within float32 rounding
        first = int(differ[0])
        with torch.no_grad():
            logits = model(torch.cat((prompt, modules[:first]))[None])[0, -1]
        top = logits.topk(2).values
        assert top[0] - top[1] < 1e-4 * logits.abs().max()
