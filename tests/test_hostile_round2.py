"""Hostile and careless users, a second round (issue 25): each case a tiny, fast, offline test.

Files we did not write are data: a config, index, tokenizer or recipe file is read within the size a real one has
(a pipe, a device or a sparse giant is refused before a byte is read), malformed or absurdly nested JSON/YAML is one
line naming the file, NaN/Infinity in a model config names its key, an index never sends the reader outside the
model folder, and a run never writes through a link it finds in its output folder. Long phases are timed at their
measured rate and refused above ``--max-hours``; SIGTERM is exit 143 with its one line in every command.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
from test_faults import FAST, _convert, _one_error_line, _tiny_recipe, _tlm, _write_recipe
from tiny_sources import DATA, make_source, tiny_tokenizer


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return make_source(tmp_path_factory.mktemp("round2") / "llama", "llama", tokenizer=tiny_tokenizer())


def _copy(source: Path, folder: Path) -> Path:
    return Path(shutil.copytree(source, folder))


def _refused(source_dir: Path, tmp_path: Path, *extra) -> str:
    line = _one_error_line(_convert([source_dir, "-o", tmp_path / "out", *FAST, *extra]))
    assert "internal error" not in line, line
    assert not (tmp_path / "out").exists()
    return line


def _sparse(path: Path, size: int, head: bytes = b"") -> None:
    """A file of ``size`` bytes that takes no disk space (a hole after ``head``)."""
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(size)


# ============================================================================ model config and index files


def test_a_config_nested_absurdly_deep_is_one_line(source, tmp_path):
    src = _copy(source, tmp_path / "src")
    (src / "config.json").write_text('{"a": ' + "[" * 5_000 + "]" * 5_000 + ', "model_type": "llama"}')
    assert "config.json" in (line := _refused(src, tmp_path)) and "nested too deeply" in line, line


def test_a_config_with_nan_names_the_key(source, tmp_path):
    src = _copy(source, tmp_path / "src")
    text = (src / "config.json").read_text()
    (src / "config.json").write_text(text.replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": NaN'))
    line = _refused(src, tmp_path)
    assert "config.json" in line and "rms_norm_eps is nan" in line and "fix rms_norm_eps" in line, line


def test_a_config_that_is_a_pipe_is_never_opened(source, tmp_path):
    src = _copy(source, tmp_path / "src")
    (src / "config.json").unlink()
    os.mkfifo(src / "config.json")
    line = _refused(src, tmp_path)
    assert "config.json" in line and "not a regular file" in line, line


def test_a_giant_config_is_refused_before_it_is_read(source, tmp_path):
    src = _copy(source, tmp_path / "src")
    _sparse(src / "config.json", 100 << 20, b'{"model_type": "llama", "pad": "')
    line = _refused(src, tmp_path)
    assert "config.json" in line and "100.0 MiB, more than the 64.0 MiB" in line, line


def _sharded(source: Path, folder: Path, shard_name: str) -> Path:
    from safetensors import safe_open

    src = _copy(source, folder)
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    index = {"metadata": {}, "weight_map": {name: shard_name for name in names}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    return src


@pytest.mark.parametrize("shard", ["../elsewhere/model.safetensors", "/etc/passwd"])
def test_an_index_never_sends_the_reader_outside_the_model_folder(source, tmp_path, shard):
    _copy(source, tmp_path / "elsewhere")  # a readable checkpoint there: the index must still not reach it
    src = _sharded(source, tmp_path / "src", shard)
    (src / "model.safetensors").rename(src / "moved.safetensors")
    line = _refused(src, tmp_path)
    assert "model.safetensors.index.json" in line and "outside the model folder" in line and repr(shard) in line, line


def test_a_safetensors_header_above_the_format_limit_is_not_read(source, tmp_path):
    src = _copy(source, tmp_path / "src")
    _sparse(src / "model.safetensors", 150_000_000 + 8, struct.pack("<Q", 150_000_000))
    line = _refused(src, tmp_path)
    assert "model.safetensors" in line and "above the 100000000 the format allows" in line, line


# ============================================================================ tokenizer files


def _fifo(folder):
    (folder / "tokenizer.json").unlink()
    os.mkfifo(folder / "tokenizer.json")


def _deep(folder):
    (folder / "tokenizer.json").write_text('{"model": ' + "[" * 5_000 + "]" * 5_000 + "}")


def _bad_config(folder):
    (folder / "tokenizer_config.json").write_text('{"tokenizer_class": ')


def _giant_config(folder):
    _sparse(folder / "tokenizer_config.json", 200 << 20, b'{"x": "')


def _eos_object(folder):
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["eos_token"] = {"weird": [1, 2]}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("edit, file, expected", [
    (_fifo, "tokenizer.json", "not a regular file"),
    (_deep, "tokenizer.json", "nested too deeply"),
    (_bad_config, "tokenizer_config.json", "is not valid JSON"),
    (_giant_config, "tokenizer_config.json", "200.0 MiB, more than the 128.0 MiB"),
    (_eos_object, "", "cannot be loaded (TypeError"),
], ids=["fifo", "deep", "malformed-config", "giant-config", "eos-object"])
def test_a_hostile_tokenizer_file_is_one_line_naming_it(source, tmp_path, edit, file, expected):
    src = _copy(source, tmp_path / "src")
    edit(src)
    line = _refused(src, tmp_path)
    assert f"'{src / file}'".replace("/'", "'") in line and expected in line, line


def test_a_gguf_without_a_tokenizer_is_named(tmp_path):
    pytest.importorskip("gguf")
    from test_checkpoint import write_tiny_gguf

    write_tiny_gguf(tmp_path / "bare.gguf")
    line = _refused(tmp_path / "bare.gguf", tmp_path)
    assert "bare.gguf" in line and "tokenizer" in line, line


def test_a_special_token_beyond_the_vocabulary_in_the_text_is_one_line(tmp_path):
    tokenizer = tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<big>"]})  # id 320: the model has 320 embeddings
    src = make_source(tmp_path / "src", "llama", tokenizer=tokenizer)
    text = tmp_path / "calib.txt"
    text.write_text(DATA.read_text().replace("\n", " <big>\n"))  # in every block the calibration takes
    line = _one_error_line(_convert([src, "-o", tmp_path / "out", *FAST[2:], "--calibration-data", text]))
    assert "the calibration data" in line and "token id 320" in line and "vocabulary of 320" in line, line
    assert not (tmp_path / "out").exists()


# ============================================================================ options


def test_an_empty_output_option_is_named(source, tmp_path):
    line = _one_error_line(_convert([source, "-o", "", *FAST]))
    assert "option -o is empty" in line, line


def test_endless_layer_reconstruction_is_refused_with_its_estimate(source, tmp_path):
    line = _refused(source, tmp_path, "--set", "reconstruct_epochs=1000000000000")
    assert line.startswith("error: layer reconstruction: ") and " epochs, about " in line, line
    assert "above the --max-hours 24 limit" in line and "lower --set reconstruct_epochs" in line, line


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_a_bad_time_limit_is_one_line(source, tmp_path, value):
    line = _refused(source, tmp_path, "--max-hours", value)
    assert f"--max-hours {float(value)}" in line, line


def test_budget_says_a_long_phase_aloud_and_refuses_above_the_limit():
    from tlm_train.budget import Budget, Limits
    from tlm_io.errors import ConversionError

    def run(total, step_seconds, max_hours):
        now, notes = [0.0], []
        budget = Budget("phase", total, "steps", "lower --x", Limits(max_hours, notes.append),
                        clock=lambda: now[0])
        for done in range(1, 10):
            now[0] += step_seconds if done > 1 else 100.0  # the first step is start-up and not timed
            budget.update(done)
        return budget, notes

    budget, notes = run(1000, 0.5, 24)  # 500 s: said aloud, allowed
    assert budget.estimate == pytest.approx(500) and notes == ["phase: 1,000 steps, about 8 min at the rate of its "
                                                               "first 3 steps"]
    assert run(100, 0.5, 24)[1] == []  # 50 s: not worth a note
    with pytest.raises(ConversionError, match=r"phase: 1,000,000 steps, about 139 h .* above the --max-hours 24 "
                                              r"limit; lower --x, or pass --max-hours 0"):
        run(10**6, 0.5, 24)
    assert run(10**6, 0.5, None)[0].estimate == pytest.approx(5e5)  # --max-hours 0: no limit


def test_the_ranks_judge_one_estimate():
    """Under torchrun each rank measures its own rate; ``agree`` (the ranks' maximum) makes a fast rank refuse with
    the slow one, at the same step."""
    from tlm_io.errors import TrainError
    from tlm_train.budget import Budget, Limits

    now, agreed = [0.0], []

    def slowest(estimate):
        agreed.append(estimate)
        return estimate * 100  # another rank is 100x slower

    budget = Budget("training", 10**4, "steps", "lower train.max_steps", Limits(24, None, error=TrainError),
                    min_seconds=0.0, clock=lambda: now[0], agree=slowest)
    budget.update(1)
    now[0] += 0.5
    budget.update(2)
    assert agreed == []  # one timed step: too few to judge
    now[0] += 0.5
    with pytest.raises(TrainError, match=r"training: 10,000 steps, about 139 h .*above the --max-hours 24 limit"):
        budget.update(3)  # 5,000 s here, 500,000 s on the slowest rank
    assert agreed == [pytest.approx(5000)]


def test_a_short_calibration_text_is_said_aloud(source, tmp_path):
    """A text shorter than --calibration-tokens is used whole, and a note says so."""
    args = [a if a != "256" else "1000000" for a in FAST]  # --calibration-tokens 1,000,000
    res = _convert([source, "-o", tmp_path / "out", *args], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    notes = [ln for ln in res.output.splitlines() if ln.startswith("note: calibration: ")]
    assert len(notes) == 1 and "fewer than the 1,000,000 asked of it; the conversion uses all of them" in notes[0], \
        res.output
    report = json.loads((tmp_path / "out" / "conversion_report.json").read_text())
    assert report["calibration_tokens"] == 39_616  # the whole text, in blocks of 64


def test_endless_training_is_refused_with_its_estimate(tmp_path):
    """``tlm train`` with train.max_steps 10^12 is refused a second into the run, naming the estimate, the key to
    lower and --max-hours; no folder is left behind. --max-hours 0 lifts the limit (checked on a short run)."""
    recipe = _tiny_recipe(tmp_path)
    recipe["train"]["max_steps"] = 10**12
    line = _one_error_line(_tlm(["train", _write_recipe(tmp_path, recipe), "--no-progress"]))
    assert line.startswith("error: training: 1,000,000,000,000 steps, about "), line
    assert "above the --max-hours 720 limit; lower train.max_steps, or pass --max-hours 0" in line, line
    assert not (tmp_path / "run").exists()
    line = _one_error_line(_tlm(["train", _write_recipe(tmp_path, recipe), "--max-hours", "nan"]))
    assert "--max-hours nan: must be 0 (no limit) or a positive number of hours" in line, line
    recipe["train"]["max_steps"] = 3
    res = _tlm(["train", _write_recipe(tmp_path, recipe), "--no-progress", "--max-hours", "0"])
    assert res.exit_code == 0, res.output


# ============================================================================ recipes and training folders


def test_a_recipe_nested_absurdly_deep_is_one_line(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("a: " + "[" * 5_000 + "]" * 5_000)
    line = _one_error_line(_tlm(["train", path, "--no-progress"]))
    assert "r.yaml" in line and "nested too deeply" in line, line


def test_a_giant_recipe_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "r.yaml"
    _sparse(path, 64 << 20, b"output_dir: x\n#")
    line = _one_error_line(_tlm(["train", path, "--no-progress"]))
    assert "r.yaml" in line and "64 MiB, not a recipe" in line, line


def test_a_model_config_nan_in_a_recipe_is_named(tmp_path):
    recipe = _tiny_recipe(tmp_path)
    recipe["model"]["config"]["norm_eps"] = float("nan")
    line = _one_error_line(_tlm(["train", _write_recipe(tmp_path, recipe), "--no-progress"]))
    assert "norm_eps" in line, line
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A finished 3-step run folder, copied by the tests that resume it."""
    tmp = tmp_path_factory.mktemp("round2-run")
    res = _tlm(["train", _write_recipe(tmp, _tiny_recipe(tmp, train={"max_steps": 3})), "--no-progress"])
    assert res.exit_code == 0, res.output
    return tmp / "run"


def _resume(trained: Path, tmp_path: Path, steps: int = 4):
    shutil.copytree(trained, tmp_path / "run", symlinks=True)
    recipe = _tiny_recipe(tmp_path, train={"max_steps": steps})
    recipe["data"]["cache_dir"] = str(trained.parent / "cache")
    return _tlm(["train", _write_recipe(tmp_path, recipe), "--no-progress", "--resume"])


@pytest.mark.parametrize("name", ["metrics.jsonl", "recipe.yaml", "run_summary.json"])
def test_a_run_never_writes_through_a_link_in_its_folder(trained, tmp_path, name):
    precious = tmp_path / "precious.txt"
    precious.write_text('{"step": 1, "mine": true}\n{"step": 99, "mine": true}\n')
    before = precious.read_bytes()
    shutil.copytree(trained, tmp_path / "copy")
    (tmp_path / "copy" / name).unlink()
    (tmp_path / "copy" / name).symlink_to(precious)
    line = _one_error_line(_resume(tmp_path / "copy", tmp_path))
    assert f"{name} is a symbolic link" in line and "output_dir" in line, line
    assert precious.read_bytes() == before


def test_a_damaged_metrics_line_is_named_on_resume(trained, tmp_path):
    shutil.copytree(trained, tmp_path / "copy")
    with open(tmp_path / "copy" / "metrics.jsonl", "a") as f:
        f.write("garbage{\n")
    line = _one_error_line(_resume(tmp_path / "copy", tmp_path))
    assert "metrics.jsonl line" in line and "not a metrics record" in line, line


def test_a_damaged_run_summary_does_not_block_a_resume(trained, tmp_path):
    shutil.copytree(trained, tmp_path / "copy")
    (tmp_path / "copy" / "run_summary.json").write_text("[1, 2]")
    res = _resume(tmp_path / "copy", tmp_path)
    assert res.exit_code == 0 and "run_summary.json was damaged" in res.output, res.output
    summary = json.loads((tmp_path / "run" / "run_summary.json").read_text())
    assert summary["steps"] == 4 and len(summary["invocation_seconds"]) == 1


def test_a_damaged_token_cache_manifest_is_rebuilt(tmp_path):
    recipe = _tiny_recipe(tmp_path, train={"max_steps": 2})
    assert _tlm(["tokenize", _write_recipe(tmp_path, recipe)]).exit_code == 0
    (manifest,) = (tmp_path / "cache").glob("*/manifest.json")
    manifest.write_text("garbage{")
    res = _tlm(["train", _write_recipe(tmp_path, recipe), "--no-progress"])
    assert res.exit_code == 0, res.output
    assert json.loads(manifest.read_text())["complete"] is True


def test_a_failed_start_leaves_no_new_folder(tmp_path):
    line = _one_error_line(_tlm(["train", _write_recipe(tmp_path, _tiny_recipe(tmp_path)), "--no-progress",
                                 "--resume"]))
    assert "no checkpoint" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.yaml"]


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory) -> Path:
    return make_source(tmp_path_factory.mktemp("round2-vocab") / "small", "llama", tokenizer=tiny_tokenizer(),
                       vocab_size=100)


def test_a_recipe_tokenizer_larger_than_the_checkpoint_is_refused(small_vocab, source, tmp_path):
    recipe = _tiny_recipe(tmp_path, init_from=str(small_vocab), tokenizer=str(source))
    del recipe["model"]
    line = _one_error_line(_tlm(["train", _write_recipe(tmp_path, recipe), "--no-progress"]))
    assert "beyond the 100 embeddings" in line and "set tokenizer:" in line, line
    assert not (tmp_path / "run").exists()


def test_a_training_sequence_longer_than_the_positions_is_refused(tmp_path):
    gpt2 = make_source(tmp_path / "gpt2", "gpt2", tokenizer=tiny_tokenizer())
    recipe = _tiny_recipe(tmp_path, init_from=str(gpt2), tokenizer=None, data={"seq_len": 256})
    del recipe["model"], recipe["tokenizer"]
    line = _one_error_line(_tlm(["train", _write_recipe(tmp_path, recipe), "--no-progress"]))
    assert "data.seq_len 256 is longer than the 128 positions" in line, line
    assert not (tmp_path / "run").exists()


# ============================================================================ SIGTERM in every command


def _sigterm_when_called(monkeypatch, module, name):
    """``module.name`` sends this process a real SIGTERM, then does what it did."""
    import signal

    real = getattr(module, name)

    def wrapper(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)


def test_sigterm_while_a_conversion_loads_exits_143(source, tmp_path, monkeypatch):
    import tlm_convert.convert

    _sigterm_when_called(monkeypatch, tlm_convert.convert, "load_source")
    res = _convert([source, "-o", tmp_path / "out", *FAST])
    assert res.exit_code == 143 and "stopped by SIGTERM during load" in _one_error_line(res), res.output
    assert not list(tmp_path.iterdir())


def test_sigterm_during_eval_exits_143(source, monkeypatch):
    import tlm_cli.main

    _sigterm_when_called(monkeypatch, tlm_cli.main, "strided_perplexity")
    res = _tlm(["eval", source, "--data", str(DATA), "--seq-len", "32", "--max-tokens", "64"])
    assert res.exit_code == 143 and "stopped by SIGTERM" in _one_error_line(res), res.output


def test_sigterm_during_export_exits_143_and_writes_nothing(source, tmp_path, monkeypatch):
    import tlm_io.export

    _sigterm_when_called(monkeypatch, tlm_io.export, "export_model")
    res = _tlm(["export", source, "--to", "tlm", "-o", tmp_path / "out"])
    assert res.exit_code == 143 and "nothing was written" in _one_error_line(res), res.output
    assert not list(tmp_path.iterdir())


def test_sigterm_during_tokenize_exits_143(tmp_path, monkeypatch):
    import tlm_train.shards

    _sigterm_when_called(monkeypatch, tlm_train.shards, "groups")
    res = _tlm(["tokenize", _write_recipe(tmp_path, _tiny_recipe(tmp_path))])
    assert res.exit_code == 143 and "run it again to continue" in _one_error_line(res), res.output


def test_sigterm_while_a_training_run_sets_up_exits_143(tmp_path, monkeypatch):
    import tlm_train.trainer

    _sigterm_when_called(monkeypatch, tlm_train.trainer, "student_and_tokenizer")
    res = _tlm(["train", _write_recipe(tmp_path, _tiny_recipe(tmp_path)), "--no-progress"])
    assert res.exit_code == 143 and "nothing was trained" in _one_error_line(res), res.output
    assert not (tmp_path / "run").exists()
