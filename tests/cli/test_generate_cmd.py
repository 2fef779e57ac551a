"""Hostile input to the generation API and the CLI (issue 9): a clear error, never a silent cast.

Each test is one case of the probe: float/bool token ids and positions, non-finite sampling options,
a kv_cache that is not a KVCacheConfig, non-BMP prompts on the command line, `--kv-cache NAME` next
to a file of that name, speeds of runs without a decode step, unusable devices, bench options and
NaN weights.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch
from test_cli import main_error

from litkv import GPT, KVCacheConfig, Sampling, forward_chunked, generate
from litkv.__main__ import main, normalize_argv
from litkv.checkpoints.runtime import resolve_device
from litkv.cli import generate_cmd
from litkv.cli.generate_cmd import _Stream
from litkv.eval.evaluate import cache_config, evaluate_policies, recall_accuracy
from litkv.eval.recall import RecallExample
from litkv.inference.generate import pad_prompts
from litkv.inference.sampling import sample

H2O = KVCacheConfig(policy="h2o", cache_length=16, chunk_size=4)
# The shipped default model with a small H2O cache, greedy: a fast, deterministic `litkv generate`.
FAST = ("--kv-cache", "h2o", "--kv_cache.cache_length", "32", "--temperature", "0")


def _prompt(n: int = 5) -> torch.Tensor:
    return torch.arange(1, n + 1)


# -- 1. token ids and positions must be integer tensors -------------------------------------------


@pytest.mark.parametrize("prompt", [torch.rand(5), torch.tensor([3.0, 7.0, 9.0]), torch.ones(4, dtype=torch.bool)])
def test_float_or_bool_prompt_is_refused(model: GPT, prompt: torch.Tensor) -> None:
    with pytest.raises(TypeError, match=rf"prompt 0 .*integer.*{re.escape(str(prompt.dtype))}"):
        generate(model, [prompt], 3, H2O)
    with pytest.raises(TypeError, match=rf"prompt 1 .*{re.escape(str(prompt.dtype))}"):
        pad_prompts([_prompt(), prompt], torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.int16, torch.int32, torch.uint8])
def test_integer_prompts_of_any_width_are_accepted(model: GPT, dtype: torch.dtype) -> None:
    expected = generate(model, [_prompt()], 4, H2O)[0]
    assert torch.equal(generate(model, [_prompt().to(dtype)], 4, H2O)[0], expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bool])
def test_float_or_bool_idx_is_refused(model: GPT, dtype: torch.dtype) -> None:
    idx = torch.ones(2, 6, dtype=dtype)
    pattern = rf"idx must be an integer.*{re.escape(str(dtype))}"
    with pytest.raises(TypeError, match=pattern):
        forward_chunked(model, idx, H2O)
    with pytest.raises(TypeError, match=pattern):
        model(idx)
    model.set_kv_caches(model.build_kv_caches(H2O, 2))
    try:
        with pytest.raises(TypeError, match=pattern):
            model(idx, torch.arange(6).expand(2, 6))
    finally:
        model.set_kv_caches(None)


def test_narrow_integer_idx_gives_the_int64_result(model: GPT) -> None:
    idx = torch.randint(0, 128, (2, 6))
    expected = forward_chunked(model, idx, H2O)
    torch.testing.assert_close(forward_chunked(model, idx.to(torch.int16), H2O), expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
def test_float_or_bool_input_pos_is_refused(model: GPT, dtype: torch.dtype) -> None:
    idx = torch.ones(2, 6, dtype=torch.long)
    pos = torch.arange(6).expand(2, 6).to(dtype)
    pattern = rf"input_pos must be an integer.*{re.escape(str(dtype))}"
    with pytest.raises(TypeError, match=pattern):
        forward_chunked(model, idx, H2O, input_pos=pos)
    model.set_kv_caches(model.build_kv_caches(H2O, 2))
    try:
        with pytest.raises(TypeError, match=pattern):
            model(idx, pos)
    finally:
        model.set_kv_caches(None)


# -- 2. sampling options --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "error", "named"),
    [
        (dict(temperature=float("nan")), ValueError, "temperature .* got nan"),
        (dict(temperature=float("inf")), ValueError, "temperature .* got inf"),
        (dict(temperature=-0.5), ValueError, "temperature .* got -0.5"),
        (dict(temperature=1.0, top_p=float("nan")), ValueError, "top_p .* got nan"),
        (dict(temperature=1.0, top_k=2.5), TypeError, "top_k must be an int .* got float 2.5"),
        (dict(temperature=1.0, top_k=True), TypeError, "top_k must be an int .* got bool True"),
        (dict(temperature=1.0, top_k=0), ValueError, "top_k must be an int >= 1 .* got 0"),
    ],
)
def test_bad_sampling_options(model: GPT, options: dict, error: type[Exception], named: str) -> None:
    with pytest.raises(error, match=named):
        Sampling(**options)
    with pytest.raises(error, match=named):
        sample(torch.zeros(1, 8), **options)


def test_temperature_nan_on_the_command_line(capsys: pytest.CaptureFixture) -> None:
    line = main_error(capsys, "generate", "--max_new_tokens", "2", "--temperature", ".nan")  # YAML's NaN
    assert line == "error: --temperature must be a finite float >= 0 (0: greedy), got nan"
    assert capsys.readouterr().out == ""  # refused before the prompt is echoed


# -- 3. kv_cache must be a KVCacheConfig or a list of them ----------------------------------------

BAD_KV_CACHES = [
    pytest.param({"policy": "h2o"}, "dict", id="dict"),
    pytest.param("h2o", "str", id="str"),
    pytest.param([H2O, {"policy": "h2o"}], r"kv_cache\[1\] is dict", id="list-with-dict"),
    pytest.param([], "list", id="empty-list"),
]


@pytest.mark.parametrize(("kv_cache", "given"), BAD_KV_CACHES)
def test_kv_cache_must_be_a_config(model: GPT, kv_cache: object, given: str) -> None:
    pattern = rf"KVCacheConfig.*{given}"
    idx = torch.ones(1, 6, dtype=torch.long)
    calls = {
        "generate": lambda: generate(model, [_prompt()], 3, kv_cache),
        "generate (0 new tokens)": lambda: generate(model, [_prompt()], 0, kv_cache),
        "forward_chunked": lambda: forward_chunked(model, idx, kv_cache),
        "build_kv_caches": lambda: model.build_kv_caches(kv_cache, 1),
        "recall_accuracy": lambda: recall_accuracy(model, [RecallExample([1, 2, 3, 4], 3, 0.0, "4")], kv_cache),
    }
    for name, call in calls.items():
        with pytest.raises(TypeError, match=pattern):
            call()
        assert all(cache is None for cache in model.kv_caches), name


@pytest.mark.parametrize("template", [{"policy": "h2o"}, "h2o"])
def test_evaluate_template_must_be_a_config(model: GPT, template: object) -> None:
    windows = torch.randint(0, 128, (2, 9))
    with pytest.raises(TypeError, match=rf"KVCacheConfig.*{type(template).__name__}"):
        evaluate_policies(model, windows, ["h2o"], [8], template=template)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=rf"KVCacheConfig.*{type(template).__name__}"):
        cache_config(template, "h2o", 8)  # type: ignore[arg-type]


def test_evaluate_refuses_float_windows_and_zero_batch(model: GPT) -> None:
    with pytest.raises(TypeError, match=r"windows must be an integer.*torch\.float32"):
        evaluate_policies(model, torch.rand(2, 9), ["h2o"], [8])
    with pytest.raises(ValueError, match="batch_size must be an int >= 1, got 0"):
        evaluate_policies(model, torch.randint(0, 128, (2, 9)), ["h2o"], [8], batch_size=0)


# -- 4. non-BMP characters in --prompt ------------------------------------------------------------


def test_non_bmp_prompt_reaches_the_tokenizer(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    prompt = "🦀 crab"
    assert normalize_argv(["generate", "--prompt", prompt]) == ["generate", "--prompt", '["🦀 crab"]']
    seen: list[str] = []
    load = generate_cmd.load_tokenizer

    def recording_load(path: Path):  # noqa: ANN202 - litgpt's Tokenizer
        tokenizer = load(path)
        encode = tokenizer.encode

        def recording_encode(text: str, **kwargs: object) -> torch.Tensor:
            seen.append(text)
            return encode(text, **kwargs)

        tokenizer.encode = recording_encode
        return tokenizer

    monkeypatch.setattr(generate_cmd, "load_tokenizer", recording_load)
    main(["generate", "--prompt", prompt, "--max_new_tokens", "3", *FAST])
    out = capsys.readouterr()
    assert seen == [prompt]
    assert out.err.startswith(prompt) and prompt not in out.out  # the echo on stderr, the answer on stdout
    assert "new tokens: 3 |" in out.err


def test_prompt_that_is_not_utf8_is_one_error_line(capsys: pytest.CaptureFixture) -> None:
    bad = b"caf\xe9".decode("utf-8", errors="surrogateescape")  # how Python passes a latin-1 argv
    line = main_error(capsys, "generate", "--prompt", bad)
    assert "--prompt 0 is not valid UTF-8" in line


# -- 5. --kv-cache NAME is the policy even where a file NAME exists -------------------------------


def test_kv_cache_name_is_a_policy_not_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "h2o").write_text("policy: dense\ncache_length: 3\n")
    assert normalize_argv(["generate", "--kv-cache", "h2o"]) == ["generate", "--kv_cache.policy", "h2o"]
    assert normalize_argv(["generate", "--kv_cache=h2o"]) == ["generate", "--kv_cache.policy", "h2o"]
    for config in ("kv.yaml", "kv.YML", "kv.json", "{policy: h2o}"):
        assert normalize_argv(["generate", "--kv_cache", config]) == ["generate", "--kv_cache", config]
    main(["generate", "--max_new_tokens", "2", "--kv-cache", "h2o", "--kv_cache.cache_length", "32"])
    assert "cache: h2o, 32 slots" in capsys.readouterr().err


# -- 6. speeds only from measured, non-zero durations ---------------------------------------------


def test_no_speed_without_new_tokens(capsys: pytest.CaptureFixture) -> None:
    main(["generate", "--max_new_tokens", "0", *FAST])
    summary = capsys.readouterr().err.strip().splitlines()[-1]
    assert "tok/s" not in summary
    assert "new tokens: 0 | prefill: n/a | decode: n/a | cache: h2o, 32 slots, not built" in summary


def test_no_decode_speed_with_one_new_token(capsys: pytest.CaptureFixture) -> None:
    main(["generate", "--max_new_tokens", "1", *FAST])
    summary = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.search(r"new tokens: 1 \| prefill: [0-9.]+ tok/s \| decode: n/a \|", summary), summary


def test_summary_with_zero_durations_has_no_speed(model: GPT) -> None:
    """A clock that did not move (coarse timer) gives `n/a`, never prompt_tokens / 1e-9."""
    stream = _Stream(tokenizer=None, model=model, echo=False)
    stream.steps, stream.t_start = 3, 5.0
    stream.t_first = stream.t_last = 5.0
    line = stream.summary(1, 7, 3, H2O)
    assert "tok/s" not in line and "prefill: n/a | decode: n/a" in line


# -- 7. devices that cannot compute ---------------------------------------------------------------


def test_meta_device_is_one_error_line(capsys: pytest.CaptureFixture) -> None:
    line = main_error(capsys, "generate", "--device", "meta")
    assert line.startswith("error: device 'meta' cannot run generation") and "'cpu', 'cuda'" in line


@pytest.mark.parametrize("device", ["meta", "not-a-device", "cpu:x"])
def test_resolve_device_refuses(device: str) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(device))):
        resolve_device(device)


# -- 8. bench options -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (("--prompt_lengths", "[-5]"), "prompt_lengths must be ints >= 1, got -5"),
        (("--prompt_lengths", "[0]"), "prompt_lengths must be ints >= 1, got 0"),
        (("--prompt_lengths", "[512, 0]"), "got 0 in [512, 0]"),
        (("--prompt_lengths", "[]"), "prompt_lengths must be a non-empty list"),
        (("--max_new_tokens", "0"), "max_new_tokens must be an int >= 2"),
        (("--max_new_tokens", "1"), "got 1"),
        (("--chunk_size", "0"), "chunk_size must be an int >= 1, got 0"),
        (("--threads", "-1"), "threads must be an int >= 1 or None, got -1"),
        (("--repeats", "0"), "repeats must be an int >= 1, got 0"),
    ],
)
def test_bench_options_must_be_positive(capsys: pytest.CaptureFixture, args: tuple[str, ...], named: str) -> None:
    assert named in main_error(capsys, "bench", *args)


# -- 9. NaN weights -------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_logits_after_prefill(model: GPT, bad: float) -> None:
    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken.transformer.h[0].mlp.fc_1.weight[0, 0] = bad
    with pytest.raises(ValueError, match=r"NaN/inf logits.*check the checkpoint's weights"):
        generate(broken, [_prompt()], 4, H2O)
    assert all(cache is None for cache in broken.kv_caches)
    tokens: list[torch.Tensor] = []
    with pytest.raises(ValueError, match="NaN/inf logits"):
        generate(broken, [_prompt()], 4, H2O, Sampling(temperature=1.0), on_tokens=tokens.append)
    assert tokens == []  # nothing was emitted (no silent EOS)
