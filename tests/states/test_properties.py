"""Property-based tests (hypothesis, fixed seed, bounded examples): random cache configs and policy
options through `generate`, and random `select`/`truncate`/`restore`/`save` sequences on cache states
against a model of the expected state.

Every input either works (and the output is checked) or raises ValueError/TypeError raised by litkv's
own code (the innermost frame of the traceback is in the `litkv` package: never a raw torch error).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import litkv
from litkv import GPT, KVCacheConfig, generate
from litkv.kvcache import get_kv_cache_class, known_policies
from litkv.kvcache.storage_kinds import known_storages
from litkv.states.state import CacheState, restore, snapshot
from litkv.states.undo import truncate

POLICIES = [name for name in known_policies() if get_kv_cache_class(name).__module__.startswith("litkv.")]
PACKAGE = str(Path(litkv.__file__).parent)
VOCAB = 128
RAN = {"worked": 0, "refused": 0}
REASONS: list[str] = []
SETTINGS = settings(
    derandomize=True, deadline=None, max_examples=250, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def model(tiny_model: Callable[..., GPT]) -> GPT:
    return tiny_model(3, overrides={"block_size": 128}, gates=True)


def _raised_by_litkv(err: BaseException) -> None:
    """A ValueError/TypeError whose innermost frame is litkv's own code, with a one-line message."""
    frames = traceback.extract_tb(err.__traceback__)
    inner = [f for f in frames if f.filename.startswith(PACKAGE)]
    assert inner and frames[-1].filename.startswith(PACKAGE), f"not raised by litkv: {frames[-1]} {err!r}"
    assert str(err).strip(), f"{type(err).__name__} without a message"


# -- configs and prompts through generate --------------------------------------------------------------

OPTION_VALUES = st.one_of(st.integers(-2, 40), st.booleans(), st.sampled_from(["full", "none", "x"]), st.none())
OPTIONS = st.dictionaries(
    st.sampled_from(["sinks", "recent", "window", "kernel", "n_stats", "covariance", "normalize_scores", "bogus"]),
    OPTION_VALUES,
    max_size=2,
)


def _mostly(valid: st.SearchStrategy, invalid: st.SearchStrategy) -> st.SearchStrategy:
    """`valid` about 9 times in 10, else `invalid`."""
    return st.integers(0, 9).flatmap(lambda i: invalid if i == 9 else valid)  # hypothesis favours 0


@st.composite
def configs(draw: st.DrawFn) -> dict[str, object]:
    return {
        "policy": draw(_mostly(st.sampled_from(POLICIES), st.just("no-such-policy"))),
        "cache_length": draw(_mostly(st.integers(1, 48), st.sampled_from([-1, 0, 4.5, True]))),
        "chunk_size": draw(_mostly(st.one_of(st.none(), st.integers(1, 16)), st.integers(-1, 60))),
        "prefill_length": draw(_mostly(st.one_of(st.none(), st.integers(1, 16)), st.integers(0, 60))),
        "storage": draw(_mostly(st.sampled_from(known_storages()), st.just("int3"))),
        "quant_group_size": draw(_mostly(st.sampled_from([16, 8]), st.sampled_from([64, 0, 5]))),
        "options": draw(_mostly(st.just({}), OPTIONS)),
    }


def _greedy_without_cache(model: GPT, prompt: torch.Tensor, n: int) -> list[int]:
    """The reference: greedy tokens from a full forward over the whole sequence at every step."""
    ids = prompt.tolist()
    model.set_kv_caches(None)
    for _ in range(n):
        logits = model(torch.tensor([ids]))
        ids.append(int(logits[0, -1].argmax()))
    return ids[prompt.numel() :]


@SETTINGS
@given(
    fields=configs(),
    lengths=_mostly(st.lists(st.integers(1, 40), min_size=1, max_size=3), st.lists(st.integers(0, 40), max_size=3)),
    new=st.integers(-1, 4),
    seed=st.integers(0, 2**16),
    dtype=_mostly(
        st.sampled_from([torch.long, torch.int32]), st.sampled_from([torch.float32, torch.bool, torch.uint8])
    ),
    high=_mostly(st.just(VOCAB), st.sampled_from([VOCAB + 1, 10**6])),
)
@pytest.mark.slow
@torch.no_grad()
def test_any_config_and_prompts_work_or_raise_a_litkv_error(
    model: GPT, fields: dict[str, object], lengths: list[int], new: int, seed: int, dtype: torch.dtype, high: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, high, (n,), generator=gen).to(dtype) for n in lengths]
    try:
        cfg = KVCacheConfig(**fields)  # type: ignore[arg-type]
        out = generate(model, prompts, new, cfg)
    except (ValueError, TypeError) as err:
        _raised_by_litkv(err)
        RAN["refused"] += 1
        REASONS.append(str(err)[:90])
        return
    RAN["worked"] += 1
    assert isinstance(out, list) and len(out) == len(prompts) and len(prompts) > 0
    for row in out:
        assert row.dim() == 1 and row.dtype == torch.long and row.numel() == new
        assert bool(((row >= 0) & (row < VOCAB)).all())
    lossless = cfg.policy == "dense" and cfg.storage == "float"
    if lossless and len(prompts) == 1:  # nothing evicted, float slots: the tokens of attention without a cache
        assert out[0].tolist() == _greedy_without_cache(model, prompts[0], new)


# -- cache state sequences against a model of the expected state ---------------------------------------

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("feed"), st.integers(1, 7)),
        st.tuples(st.just("truncate"), st.integers(-1, 10)),
        st.tuples(st.just("select"), st.lists(st.integers(-1, 3), max_size=4)),
        st.tuples(st.just("restore"), st.integers(1, 4)),
        st.tuples(st.just("save"), st.just(0)),
    ),
    max_size=7,
)
CACHE = KVCacheConfig("dense", cache_length=24, chunk_size=4)


class Expected:
    """What the caches must hold: per row, the token ids seen (positions 0..n-1)."""

    def __init__(self, rows: list[list[int]]) -> None:
        self.rows = rows

    def check(self, model: GPT) -> None:
        last = model.last_pos
        for cache in model.kv_caches:
            assert cache.positions.shape[0] == len(self.rows)
            for r, ids in enumerate(self.rows):
                held = cache.positions[r, 0]
                assert sorted(held[held >= 0].tolist()) == list(range(len(ids))), (r, held.tolist())
        if last is not None:
            assert last.tolist() == [len(ids) - 1 for ids in self.rows]


def _feed(model: GPT, expected: Expected, n: int, gen: torch.Generator) -> None:
    ids = torch.randint(0, VOCAB, (len(expected.rows), n), generator=gen)
    start = len(expected.rows[0])
    if start + n > CACHE.cache_length:  # a dense cache that is full refuses
        before = snapshot(model)
        with pytest.raises(ValueError) as info:
            model(ids, torch.arange(start, start + n)[None].expand(len(expected.rows), n))
        _raised_by_litkv(info.value)
        after = snapshot(model)  # a refused call changes nothing (see the test below)
        assert torch.equal(after.last_pos, before.last_pos)
        assert all(
            torch.equal(a.tensors[k], b.tensors[k])
            for a, b in zip(after.layers, before.layers, strict=True)
            for k in a.tensors
        )
        return
    model(ids, torch.arange(start, start + n)[None].expand(len(expected.rows), n))
    for row, new in zip(expected.rows, ids.tolist(), strict=True):
        row.extend(new)


def _apply(model: GPT, expected: Expected, op: tuple[str, object], gen: torch.Generator, tmp: Path) -> None:
    name, arg = op
    if name == "feed":
        _feed(model, expected, int(arg), gen)  # type: ignore[arg-type]
    elif name == "truncate":
        n = int(arg)  # type: ignore[arg-type]
        if n < 0 or n > len(expected.rows[0]):
            with pytest.raises(ValueError) as info:
                truncate(model, n)
            _raised_by_litkv(info.value)
            return
        truncate(model, n)
        expected.rows = [row[: len(row) - n] for row in expected.rows]
    elif name == "select":
        rows = list(arg)  # type: ignore[call-overload]
        state = snapshot(model)
        if not rows or any(r < 0 or r >= len(expected.rows) for r in rows):
            with pytest.raises((ValueError, TypeError)) as info:
                state.select(rows)
            _raised_by_litkv(info.value)
            return
        restore(model, state.select(rows))
        expected.rows = [list(expected.rows[r]) for r in rows]
    elif name == "restore":  # go on, then come back: bitwise the state taken
        state = snapshot(model)
        _feed(model, Expected([list(r) for r in expected.rows]), int(arg), gen)  # type: ignore[arg-type]
        restore(model, state)
    else:
        snapshot(model).save(tmp / "s.safetensors")
        restore(model, CacheState.load(tmp / "s.safetensors"))


@pytest.mark.slow
@SETTINGS
@given(ops=OPS, seed=st.integers(0, 2**16))
@torch.no_grad()
def test_state_operation_sequences_match_the_model(model: GPT, ops: list[tuple[str, object]], seed: int) -> None:
    """Positions held per row after any sequence of operations, and the next logits equal those of a
    cache-free forward over each row's tokens."""
    import tempfile

    gen = torch.Generator().manual_seed(seed)
    model.set_kv_caches(model.build_kv_caches(CACHE, 2))
    expected = Expected([[], []])
    _feed(model, expected, 3, gen)
    with tempfile.TemporaryDirectory() as tmp:
        for op in ops:
            _apply(model, expected, op, gen, Path(tmp))
            expected.check(model)
    n = len(expected.rows[0])
    if n + 1 > CACHE.cache_length:
        return
    probe = torch.randint(0, VOCAB, (len(expected.rows), 1), generator=gen)
    logits = model(probe, torch.full((len(expected.rows), 1), n))[:, -1]
    full = torch.cat((torch.tensor(expected.rows, dtype=torch.long).reshape(len(expected.rows), n), probe), dim=1)
    model.set_kv_caches(None)
    reference = model(full)[:, -1]
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)


TRUNCATED = {True: 0, False: 0}  # examples that rolled back some calls / none
EVICTING = [p for p in ("h2o", "tova", "last-recent", "knorm", "keydiff", "snapkv", "learned") if p in POLICIES]


@settings(derandomize=True, deadline=None, max_examples=200, suppress_health_check=list(HealthCheck))
@given(
    policy=st.sampled_from(EVICTING),
    calls=st.lists(st.integers(1, 6), min_size=1, max_size=8),
    rollbacks=st.lists(
        st.one_of(st.tuples(st.just(True), st.integers(1, 4)), st.tuples(st.just(False), st.integers(0, 20))),
        min_size=1,
        max_size=3,
    ),
    depth=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
@pytest.mark.slow
@torch.no_grad()
def test_truncate_of_an_evicting_cache_equals_never_having_made_the_calls(
    model: GPT, policy: str, calls: list[int], rollbacks: list[tuple[bool, int]], depth: int, seed: int
) -> None:
    """Calls of random sizes through an 8-slot evicting cache (it evicts), then random `truncate(n)`:
    allowed exactly when `n` ends on a call boundary within the undo log's `depth` calls, and then the
    caches are bitwise those of a fresh run of the calls that remain."""
    from litkv.states.undo import keep_undo_log

    cfg = KVCacheConfig(policy, cache_length=8, chunk_size=6)
    gen = torch.Generator().manual_seed(seed)
    chunks = [torch.randint(0, VOCAB, (1, n), generator=gen) for n in calls]
    model.set_kv_caches(model.build_kv_caches(cfg, 1))
    keep_undo_log(model, depth)
    done: list[torch.Tensor] = []
    for chunk in chunks:
        start = sum(c.shape[1] for c in done)
        model(chunk, torch.arange(start, start + chunk.shape[1])[None])
        done.append(chunk)
    logged = len(done) if len(done) <= depth else depth
    for by_calls, k in rollbacks:  # the tokens of the last k calls, or k tokens
        n = sum(c.shape[1] for c in done[len(done) - min(k, len(done)) :]) if by_calls else k
        ends = [sum(c.shape[1] for c in done[len(done) - j :]) for j in range(logged + 1)]
        if n not in ends:
            with pytest.raises(ValueError) as info:
                truncate(model, n)
            _raised_by_litkv(info.value)
            continue
        truncate(model, n)
        j = ends.index(n)
        done, logged = done[: len(done) - j], logged - j
    fresh = snapshot(model)
    model.set_kv_caches(model.build_kv_caches(cfg, 1))
    start = 0
    for chunk in done:
        model(chunk, torch.arange(start, start + chunk.shape[1])[None])
        start += chunk.shape[1]
    replay = snapshot(model)
    TRUNCATED[len(done) < len(chunks)] += 1
    for got, want in zip(fresh.layers, replay.layers, strict=True):
        g, w = got.full_tensors(), want.full_tensors()
        assert all(torch.equal(g[k], w[k]) for k in w), policy
    if done:
        assert fresh.last_pos.tolist() == replay.last_pos.tolist()


@torch.no_grad()
def test_a_call_the_cache_refuses_leaves_the_model_unchanged(model: GPT) -> None:
    """Found by the sequence test above: a dense cache refuses a call that does not fit, but the model's
    `last_pos` has already moved on, so the next call at the right positions is refused as well."""
    model.set_kv_caches(model.build_kv_caches(CACHE, 1))
    model(torch.zeros(1, 20, dtype=torch.long), torch.arange(20)[None])
    with pytest.raises(ValueError, match="full|room|slots"):
        model(torch.zeros(1, 7, dtype=torch.long), torch.arange(20, 27)[None])
    assert model.last_pos.tolist() == [19]


# -- the command line's argument layer -------------------------------------------------------------------

CLI_VALUES = {
    "--kv_cache": st.sampled_from(["h2o", "dense", "tova", "nope", "{policy: h2o}", "x.yaml"]),
    "--kv_cache.cache_length": st.sampled_from(["16", "0", "-3", "abc", "1e3", "true", ""]),
    "--kv_cache.chunk_size": st.sampled_from(["4", "null", "0", "99", "x"]),
    "--kv_cache.storage": st.sampled_from(["float", "int4", "int2"]),
    "--kv_cache.sinks": st.sampled_from(["2", "-1", "a"]),
    "--temperature": st.sampled_from(["0", "-1", "nan", "inf", "0.5"]),
    "--top_k": st.sampled_from(["1", "0", "null", "x"]),
    "--undo_depth": st.sampled_from(["1", "0", "-5"]),
    "--max_new_tokens": st.sampled_from(["2", "0", "-1", "1.5"]),
    "--device": st.sampled_from(["cpu", "foo", "meta", "cuda:99"]),
}


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_checkpoint import make_tiny_checkpoint

    path = tmp_path_factory.mktemp("ckpt")
    make_tiny_checkpoint(path)
    return path


@settings(derandomize=True, deadline=None, max_examples=30, suppress_health_check=list(HealthCheck))
@given(
    options=st.dictionaries(st.sampled_from(sorted(CLI_VALUES)), st.none(), max_size=4).flatmap(
        lambda keys: st.fixed_dictionaries({k: CLI_VALUES[k] for k in keys})
    )
)
@pytest.mark.slow
def test_chat_options_work_or_fail_with_one_error_line(
    tiny_ckpt: Path, options: dict[str, str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`litkv chat` with random option values (input: one line, then end of input): status 0, or a
    usage error (2, jsonargparse), or status 1 with exactly one `error:` line; never a traceback."""
    import io
    import sys

    from litkv.__main__ import main

    argv = ["chat", str(tiny_ckpt), "--num_threads", "1"] + [t for k, v in options.items() for t in (k, v)]
    monkeypatch.setattr(sys, "stdin", io.StringIO("The fox\n"))
    try:
        main(argv)
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err
    assert "Traceback" not in err and code in (0, 1, 2), (argv, code, err)
    if code == 1:
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: "), (argv, err)
    if code == 2:
        assert "error:" in err, (argv, err)


def test_most_generated_configs_ran(model: GPT) -> None:
    """The generators are not so wild that everything is refused (runs last: after the property tests)."""
    if RAN["worked"] + RAN["refused"] == 0:
        pytest.skip("the property test did not run in this session")
    assert RAN["worked"] >= 80, (RAN, REASONS)
    if sum(TRUNCATED.values()):
        assert TRUNCATED[True] >= 50, TRUNCATED  # the rollback property rolled back calls in many examples
