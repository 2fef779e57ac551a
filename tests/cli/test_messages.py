"""Messages that say what is wrong with what the user gave, naming it (issue: a new user's first hour):
a file given to `litkv convert` as a model directory, a misspelt model name, a one-sided range, the
checkpoint positional in `--help`, `litkv download` of a model already there, a warning as one clean line,
a dense cache's slots for a short prompt, and the gate-training loss that rises while its goal ramps."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

import litkv.cli.download_cmd as download_cmd
from litkv.__main__ import HELP_DIR, main, show_warning
from litkv.checkpoints.checkpoint import check_checkpoint_dir, load_tokenizer
from litkv.cli.generate_cmd import fit_cache
from litkv.core.validation import check_float
from litkv.finetune.gate_training import GateTrainArgs
from litkv.finetune.learn_eviction import ramp_note
from litkv.modeling.config import KVCacheConfig


def error_line(capsys: pytest.CaptureFixture, *args: str) -> str:
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    assert exc.value.code == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def test_convert_of_a_file_says_it_is_a_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    notes = tmp_path / "FILE.txt"
    notes.write_text("not a model", encoding="utf-8")
    line = error_line(capsys, "convert", str(notes), str(tmp_path / "OUT"))
    assert f"{str(notes)!r} is a file, not a Hugging Face model directory" in line and "does not exist" not in line


def test_a_misspelt_model_name_gets_the_known_names() -> None:
    with pytest.raises(FileNotFoundError) as err:
        check_checkpoint_dir("smollm2-135m")
    assert "did you mean smollm2-135m-instruct?" in str(err.value) and "known models: smollm2-135m-instruct" in str(
        err.value
    )
    with pytest.raises(FileNotFoundError, match="did you mean smollm2-135m-instruct"):
        load_tokenizer("smollm2-135m-instruc")
    with pytest.raises(FileNotFoundError, match=r"^checkpoint directory 'no/such' does not exist$"):
        check_checkpoint_dir("no/such")  # a path: no model names


def test_one_sided_ranges_say_only_their_bound() -> None:
    with pytest.raises(ValueError, match=r"^x must be >= 0.0, got -1.0$"):
        check_float("x", -1.0, 0.0)
    with pytest.raises(ValueError, match=r"^x must be <= 1.0, got 2.0$"):
        check_float("x", 2.0, None, 1.0)
    with pytest.raises(ValueError, match=r"^x must be in \[0.0, 1.0\], got 2.0$"):
        check_float("x", 2.0, 0.0, 1.0)


@pytest.mark.parametrize("command", ["generate", "chat", "serve", "evaluate", "finetune"])
def test_help_shows_the_checkpoint_positional(command: str) -> None:
    text = (HELP_DIR / f"{command}.txt").read_text(encoding="utf-8")
    assert text.startswith(f"usage: litkv [options] {command} [CHECKPOINT] [-h]")
    assert "CHECKPOINT (first or last): a checkpoint directory or a known model name" in text


def test_download_of_a_model_already_there_says_only_that(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    there = tmp_path / "smollm2-135m-instruct"
    monkeypatch.setattr(download_cmd, "cache_dir", lambda name: there)
    monkeypatch.setattr(download_cmd, "download_model", lambda name: (there, "already there"))
    there.mkdir()
    download_cmd.download("smollm2-135m-instruct")
    out = capsys.readouterr()
    assert "getting it" not in out.err and out.out == f"smollm2-135m-instruct: already there: {there}\n"
    there.rmdir()
    download_cmd.download("smollm2-135m-instruct")
    assert "getting it into" in capsys.readouterr().err
    with pytest.raises(ValueError, match="did you mean smollm2-135m-instruct"):
        download_cmd.download("smollm2-135m")


def test_a_warning_is_one_clean_line(ckpt: Path, capsys: pytest.CaptureFixture) -> None:
    """The command line prints a warning (qh2o choosing its storage) as `warning: MESSAGE`, without the
    category, the file and the source line Python shows."""
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        main(["generate", str(ckpt), "--kv-cache", "qh2o", "--kv_cache.cache_length", "32", "--max_new_tokens", "2"])
    err = capsys.readouterr().err
    assert "warning: policy 'qh2o' needs quantised storage; using storage='int4'" in err
    assert "UserWarning" not in err and ".py:" not in err
    assert warnings.showwarning is not show_warning  # main put Python's back
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show_warning
        warnings.warn("two\n  lines", UserWarning, stacklevel=1)
    assert capsys.readouterr().err == "warning: two lines\n"


def test_a_dense_cache_for_a_short_prompt_holds_prompt_plus_new_tokens(
    ckpt: Path, capsys: pytest.CaptureFixture
) -> None:
    main(["generate", str(ckpt), "--prompt", "the quick", "--max_new_tokens", "3", "--temperature", "0"])
    summary = capsys.readouterr().err.strip().splitlines()[-1]
    prompt_tokens = int(re.search(r"prompt tokens: (\d+)", summary).group(1))
    assert f"cache: dense, {prompt_tokens + 2} slots" in summary  # the last new token is never stored
    default = KVCacheConfig()
    assert fit_cache(default, 5, 3).cache_length == 7
    assert fit_cache(KVCacheConfig(chunk_size=16), 5, 3).cache_length == 16  # never below a chunk
    assert fit_cache(KVCacheConfig(cache_length=64), 5, 3).cache_length == 64  # the user's size stays
    assert fit_cache(KVCacheConfig(policy="h2o"), 5, 3) == KVCacheConfig(policy="h2o")


def test_gate_training_says_its_loss_rises_while_the_goal_ramps() -> None:
    note = ramp_note(GateTrainArgs(steps=100, ramp=0.5, target_keep=0.1))
    assert note is not None and "ramps from 1 to 0.1 over the first 50 of 100 steps" in note and "rises" in note
    assert ramp_note(GateTrainArgs(method="lstsq")) is None


@pytest.mark.parametrize("word", ["yes", "Off", "n"])
def test_a_policy_option_given_a_yaml_boolean_word_is_refused(word: str, capsys: pytest.CaptureFixture) -> None:
    """`--kv_cache.across_layers yes` used to arrive as `True` (jsonargparse reads policy options as YAML 1.1);
    strict types (issue 61 item 7): only true / false, the option and the word named."""
    for args in (["--kv_cache.across_layers", word], [f"--kv_cache.across_layers={word}"]):
        line = error_line(capsys, "generate", "--kv-cache", "learned", *args, "--prompt", "hi")
        assert f"--kv_cache.across_layers {word!r}" in line and "true or false" in line


def test_a_policy_option_given_true_or_a_number_still_parses() -> None:
    from litkv.__main__ import normalize_argv

    out = normalize_argv(["generate", "--kv_cache.sinks", "4", "--kv_cache.across_layers", "true"])
    assert out[1:5] == ["--kv_cache.options.sinks", "4", "--kv_cache.options.across_layers", "true"]
