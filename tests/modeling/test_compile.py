"""The decode step: compiled without graph breaks or recompilation, same tokens as eager, no host
synchronisation, and no copy of the cache (buffers keep their storage; nothing cache-sized is created).

Most compiled runs use dynamo's "eager" backend: graph breaks and recompilations are decided by
dynamo's tracing, whatever the backend; one test runs inductor end to end.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch._dynamo
from helpers import tiny_gpt
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code
from torch.utils._python_dispatch import TorchDispatchMode

from litkv import GPT, KVCacheConfig, generate
from litkv.kvcache.kernels import cpu_decode
from litkv.kvcache.storage_kinds import known_storages
from litkv.modeling import attention

POLICIES = ["dense", "last-recent", "h2o", "qh2o", "tova", "knorm", "keydiff", "snapkv", "expected-attention"]
POLICIES += ["learned"]


def _model() -> GPT:
    return tiny_gpt(3, overrides={"block_size": 1024}, gates=True)


def _config(policy: str, storage: str = "float") -> KVCacheConfig:
    if policy == "dense":
        return KVCacheConfig("dense", cache_length=400, chunk_size=16, storage=storage)
    return KVCacheConfig(policy, cache_length=32, chunk_size=16, storage=storage)


def _prompts() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, 128, (45,), generator=gen), torch.randint(0, 128, (70,), generator=gen)]


@contextmanager
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    counters.clear()
    try:
        yield
    finally:
        torch._dynamo.reset()


STORAGES = known_storages()  # float, int4, int8
STEPS = 200  # decode steps of `test_compiled_decode_is_one_graph_with_static_addresses` (issue 44 asks 200)


def _cache_addresses(model: GPT) -> dict[str, int]:
    """Address of every tensor a decode step may touch: each layer cache's, its storage's and its policy's
    tensor attributes, and `last_pos` (what a CUDA graph replays on, `KVCaches.mark_static_addresses`)."""
    caches = model.caches
    out = {"last_pos": caches.last_pos.data_ptr()}
    for i, cache in enumerate(caches.policy_caches):
        for where, holder in (("cache", cache), ("storage", cache.storage), ("policy", cache.policy)):
            for name, value in vars(holder).items():
                parts = value if isinstance(value, tuple) else (value,)
                for j, t in enumerate(parts):
                    if isinstance(t, torch.Tensor):
                        out[f"{i}.{where}.{name}.{j}"] = t.data_ptr()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("policy", POLICIES)
def test_compiled_decode_is_one_graph_with_static_addresses(policy: str, storage: str) -> None:
    """Every policy x storage, a ragged batch: 200 compiled steps (`fullgraph=True`, dynamo erroring on any
    recompilation), then a second `generate` (fresh caches) reusing the graph; one graph, no break; every
    cache tensor keeps its address over the steps (what a CUDA graph's replay needs); eager's tokens."""
    model = _model()
    kv = _config(policy, storage)
    eager = generate(model, _prompts(), STEPS, kv)
    addresses: list[dict[str, int]] = []
    with _fresh_dynamo(), torch._dynamo.config.patch(error_on_recompile=True):
        model.compiled_decode_step(backend="eager")
        first = generate(
            model, _prompts(), STEPS, kv, compile=True, on_tokens=lambda _: addresses.append(_cache_addresses(model))
        )
        second = generate(model, _prompts(), 20, kv, compile=True)
        assert dict(counters["graph_break"]) == {}
        assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    # addresses[0] is after the prefill's token (eager), then one per compiled step
    moved = {name for step in addresses[2:] for name, ptr in step.items() if ptr != addresses[1][name]}
    assert len(addresses) == STEPS and not moved, sorted(moved)
    for ref, a, b in zip(eager, first, second, strict=True):
        assert len(ref) == STEPS
        assert torch.equal(ref, a) and torch.equal(ref[:20], b)


@pytest.mark.slow
@pytest.mark.parametrize("storage", ["float", "int4"])
def test_compiled_inductor_matches_eager_and_writes_the_cache_in_place(storage: str) -> None:
    """The real compiler (inductor, C++ on the CPU) gives eager's greedy tokens for an evicting policy, and its
    step allocates nothing as large as a layer's cache buffer (the step's writes of the slots stay in place, not
    made functional: a copy of every buffer per layer)."""
    model = _model()
    kv = KVCacheConfig("h2o", cache_length=200, chunk_size=16, storage=storage)
    eager = generate(model, _prompts(), 60, kv)
    with _fresh_dynamo():
        model.compiled_decode_step(backend="inductor")
        compiled, sources = run_and_get_code(generate, model, _prompts(), 60, kv, compile=True)
        assert dict(counters["graph_break"]) == {}
    for ref, out in zip(eager, compiled, strict=True):
        assert torch.equal(ref, out)
    buffers = model.build_kv_caches(kv, 2)[0].storage.buffers().values()
    smallest = min(t.numel() for t in buffers)
    shapes = [m for code in sources for m in re.findall(r"empty_strided_cpu\(\(([\d, ]*)\)", code)]
    assert shapes, "no allocation found in inductor's code: the pattern no longer matches it"
    sizes = [math.prod(int(x) for x in shape.split(",") if x.strip()) for shape in shapes]
    assert max(sizes) < smallest, f"the compiled step allocates {max(sizes)} elements (cache buffer {smallest})"


class _Recorder(TorchDispatchMode):
    """Records every aten op's name and the largest tensor it allocates (views and in-place results,
    which share an input's memory, count 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        inputs = [*args, *(kwargs or {}).values()]
        inputs += [t for item in inputs if isinstance(item, (tuple, list)) for t in item]
        shared = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        outputs = out if isinstance(out, (tuple, list)) else (out,)
        fresh = [t for t in outputs if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in shared]
        largest = max((t.numel() for t in fresh), default=0)
        self.ops.append((str(func.overloadpacket.__name__), largest))
        return out


def _prefilled(policy: str, storage: str = "float") -> tuple[GPT, list, torch.Tensor]:
    """A model with caches attached, full (evicting) or part full (dense); returns next positions `(B, 1)`."""
    model = _model()
    kv = _config(policy, storage)
    caches = model.build_kv_caches(kv, 2)
    model.set_kv_caches(caches)
    idx = torch.randint(0, 128, (2, 48))
    pos = torch.arange(48).expand(2, 48).clone()
    pos[0, :5] = -1  # a left-padded row
    with torch.inference_mode():
        for s in range(0, 48, 16):
            model(idx[:, s : s + 16], pos[:, s : s + 16])
    return model, caches, torch.full((2, 1), 48)


_CACHE_SIZED = {
    "expected-attention": "its query statistics (B, H, D, D), renewed every step, are as large as a layer's keys here",
}
if cpu_decode.find_compiler() is None:  # no CPU decode kernel
    _CACHE_SIZED["qh2o"] = "without a C compiler quantised slots are converted whole to floats at every step"


@pytest.mark.parametrize(
    "policy",
    [
        pytest.param(p, marks=pytest.mark.xfail(strict=True, reason=_CACHE_SIZED[p])) if p in _CACHE_SIZED else p
        for p in POLICIES
    ],
)
def test_decode_step_keeps_buffers_and_copies_nothing_cache_sized(policy: str) -> None:
    """50 decode steps: the storage and position buffers keep their memory; no op inside a step
    returns a tensor as large as one layer's cached keys; no op reads a value on the host."""
    model, caches, next_pos = _prefilled(policy)
    before = [[t.data_ptr() for t in (*c.storage.buffers().values(), c.positions)] for c in caches]
    shape = caches[0].shape
    cache_numel = shape.batch_size * shape.n_query_groups * shape.cache_length * shape.key_size
    tokens = torch.zeros(2, 1, dtype=torch.long)
    recorder = _Recorder()
    with torch.inference_mode(), model.trusted_inputs(200):
        for step in range(50):
            if step == 49:
                with recorder:
                    model(tokens, next_pos + step)
            else:
                model(tokens, next_pos + step)
    after = [[t.data_ptr() for t in (*c.storage.buffers().values(), c.positions)] for c in caches]
    assert before == after
    assert recorder.ops, "the recorder saw no op"
    largest = max(recorder.ops, key=lambda op: op[1])
    assert largest[1] < cache_numel, f"{largest[0]} returned {largest[1]} elements (cache keys: {cache_numel})"
    syncs = [name for name, _ in recorder.ops if name in ("_local_scalar_dense", "item", "nonzero")]
    assert syncs == []


def test_checked_call_reads_the_host_and_trusted_one_does_not() -> None:
    """The recorder does see host reads where they happen (outside `trusted_inputs`): it can fail."""
    model, _, next_pos = _prefilled("h2o")
    recorder = _Recorder()
    with torch.inference_mode(), recorder:
        model(torch.zeros(2, 1, dtype=torch.long), next_pos)
    assert {"item", "_local_scalar_dense"} & {name for name, _ in recorder.ops}


def test_static_step_on_dense_matches_eager_logits() -> None:
    """A dense cache that is filling: the static step (all slots attended, empty ones masked) gives
    the eager step's logits up to rounding, and counts its tokens only through `advance`."""
    model, caches, next_pos = _prefilled("dense")
    tokens = torch.randint(0, 128, (2, 1))
    state = [({k: v.clone() for k, v in c.state_tensors().items()}, c.num_filled) for c in caches]
    last = model.last_pos.clone()
    with torch.inference_mode(), model.trusted_inputs(100):
        eager = model(tokens, next_pos)
        filled = caches[0].num_filled
        for cache, (tensors, n) in zip(caches, state, strict=True):
            cache.load_state_tensors(tensors, n)
            cache.static_shapes = True
        model.last_pos = last
        static = model(tokens, next_pos)
    assert caches[0].num_filled == filled - 1
    caches[0].advance(1)
    assert caches[0].num_filled == filled
    assert (eager - static).abs().max() < 1e-4 * eager.abs().max()


def test_cli_compile_switch_reaches_generate(tmp_path, monkeypatch, capsys) -> None:  # noqa: ANN001
    """`litkv generate --compile` (a bare switch) compiles the decode steps: the summary line reports the
    compiling first step apart, and the tokens are eager's (dynamo's eager backend, to stay quick)."""
    from tiny_checkpoint import make_tiny_checkpoint

    from litkv.__main__ import main, normalize_argv

    assert normalize_argv(["generate", "--compile"]) == ["generate", "--compile=true"]
    assert normalize_argv(["generate", "--compile", "false"]) == ["generate", "--compile", "false"]
    make_tiny_checkpoint(tmp_path)
    args = ["generate", str(tmp_path), "--kv-cache", "h2o", "--kv_cache.cache_length", "16", "--temperature", "0"]
    args += ["--max_new_tokens", "30", "--prompt", "hello there, a prompt longer than the cache of sixteen slots"]
    main(args)
    eager = capsys.readouterr()
    original = GPT.compiled_decode_step
    monkeypatch.setattr(GPT, "compiled_decode_step", lambda self, backend=None: original(self, "eager"))
    with _fresh_dynamo():
        main([*args, "--compile"])
        assert counters["stats"]["unique_graphs"] == 1
    compiled = capsys.readouterr()
    assert "first step, compiling" in compiled.err and "compiling" not in eager.err
    assert compiled.out == eager.out


@pytest.mark.slow
@pytest.mark.parametrize(("policy", "storage", "cache_length"), [("qh2o", "int4", 1024), ("h2o", "int8", 64)])
def test_inductor_quantised_storage_gives_eager_tokens_on_the_shipped_model(
    policy: str, storage: str, cache_length: int
) -> None:
    """Quantisation is one opaque op under inductor (`litkv::quantize` / `litkv::dequantize`), so compiled
    codes are eager's bit for bit: a fused kernel that rounds one product differently flips a code and
    changes what attention sees by a quantum (this model's 90-token prompt differed at token 21 before).
    A ragged batch of three prompts, 40 tokens each."""
    from pathlib import Path

    from litkv.checkpoints.checkpoint import load_model, load_tokenizer

    ckpt = Path(__file__).resolve().parents[2] / "litkv" / "assets" / "default"
    model, tokenizer = load_model(ckpt).eval(), load_tokenizer(ckpt)
    ids = torch.as_tensor(tokenizer.encode((ckpt / "heldout.txt").read_text(encoding="utf-8")[:6000])).long()
    prompts = [ids[:90], ids[100:230], ids[300:350]]
    cfg = KVCacheConfig(policy, cache_length=cache_length, chunk_size=16, storage=storage)
    torch._dynamo.reset()
    eager = generate(model, prompts, 40, cfg)
    compiled = generate(model, prompts, 40, cfg, compile=True)
    assert [t.tolist() for t in compiled] == [t.tolist() for t in eager]


@pytest.mark.slow  # compiling: about 5 s of CPU
def test_compiled_decode_attends_without_a_mask_when_every_slot_holds_a_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ragged batch whose h2o caches are full of tokens after the prefill: the compiled step is traced with no mask
    (layout `None`, fixed when the steps begin: `KVCache.static_slots_valid`), eager's tokens. A cache whose slots
    are written otherwise forgets it; a cache not full (dense, most tests above) keeps the mask."""
    layouts = []
    for name in ("_sdpa", "_scores_pass", "_one_query_pass", "_one_query_kernel"):
        real = getattr(attention, name)

        def spy(q, k, v, mask, *rest, real=real):  # noqa: ANN001, ANN202
            layouts.append((q.shape[-2], mask is None))  # (queries per head, no mask)
            return real(q, k, v, mask, *rest)

        monkeypatch.setattr(attention, name, spy)
    model = _model()
    kv = _config("h2o")
    eager = generate(model, _prompts(), 6, kv)
    with _fresh_dynamo():  # the spy's list makes dynamo recompile (no recompilation: the 100-step test above)
        model.compiled_decode_step(backend="eager")
        layouts.clear()
        compiled = generate(model, _prompts(), 6, kv, compile=True)
    steps = [none for t, none in layouts if t == 1]  # the traced step's layers (the prefill's calls are longer)
    assert steps and all(steps), layouts
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled, strict=True))
    with torch.inference_mode(), model.kv_caches_attached(_config("h2o"), 1) as caches:
        for start in (0, 20):
            model(torch.arange(start, start + 20)[None], torch.arange(start, start + 20)[None])
        caches.static_shapes = True
        assert all(cache.static_slots_valid and cache.slots_known_valid() for cache in caches.policy_caches)
        caches.policy_caches[0].forget_valid_slots()
        assert not caches.policy_caches[0].slots_known_valid() and caches.policy_caches[1].slots_known_valid()
        caches.static_shapes = False
        assert not any(cache.static_slots_valid for cache in caches.policy_caches)
