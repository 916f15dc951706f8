"""Absurd sizes and endless phases are refused before the memory or the hours are spent (issue 25): a config,
GGUF or recipe declaring an absurd model is refused before anything is built (by the console entry point itself,
before torch is imported), a model beyond the available memory is refused, and a long phase is timed on its first
steps, said aloud, and refused above ``--max-hours``.
"""

from __future__ import annotations

import json
import os
import re

import pytest
from hostile_helpers import refused, source, with_config  # noqa: F401 - fixture
from test_faults import FAST, _convert, _one_error_line, _tiny_recipe, _tlm, _write_recipe

from tlm_io.errors import ConversionError
# ============================================================================ sizes before memory


@pytest.mark.parametrize("fields", [{"num_hidden_layers": 10_000_000}, {"num_hidden_layers": 100_000},
                                    {"hidden_size": 1 << 20}, {"vocab_size": 10**12},
                                    {"intermediate_size": 60_000, "hidden_size": 60_000, "num_hidden_layers": 3000}])
def test_an_absurd_source_config_is_refused_before_anything_is_built(source, tmp_path, fields):
    import time

    src = with_config(source, tmp_path / "src", **fields)
    t0 = time.perf_counter()
    line = _one_error_line(_convert([src, "-o", tmp_path / "out"]))
    assert time.perf_counter() - t0 < 20
    assert "config.json" in line and any(f"{k}={v}" in line for k, v in fields.items()), line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fields", [{"num_hidden_layers": 10_000_000}, {"hidden_size": 1048576}])
def test_an_absurd_recipe_model_is_refused_before_anything_is_built(tmp_path, fields):
    recipe = _tiny_recipe(tmp_path)
    recipe["model"]["config"].update(fields)
    line = _one_error_line(_tlm(["train", _write_recipe(tmp_path, recipe), "--no-progress"]))
    key, value = next(iter(fields.items()))
    assert f"model.config.{key}={value}" in line, line
    assert not (tmp_path / "run" / "recipe.yaml").exists()


def test_a_model_beyond_the_available_memory_is_refused(monkeypatch):
    from tlm_io import sizes

    monkeypatch.setattr(sizes, "available_memory", lambda: 1 << 30)
    cfg = {"num_hidden_layers": 64, "hidden_size": 8192, "intermediate_size": 28672, "vocab_size": 128256}
    with pytest.raises(ConversionError, match="more than the 1.0 GiB of available memory"):
        sizes.check_model_size(cfg, "config.json")
    assert sizes.check_model_size({**cfg, "num_hidden_layers": 1, "hidden_size": 64, "vocab_size": 100}, "x") > 0


def test_a_gguf_with_an_absurd_block_count_is_refused(tmp_path, monkeypatch):
    gguf = pytest.importorskip("gguf")
    from test_checkpoint import write_tiny_gguf

    real = gguf.GGUFWriter.add_block_count
    monkeypatch.setattr(gguf.GGUFWriter, "add_block_count", lambda self, n: real(self, 10_000_000))
    write_tiny_gguf(tmp_path / "bomb.gguf")
    monkeypatch.setattr(gguf.GGUFWriter, "add_block_count", real)
    line = _one_error_line(_convert([tmp_path / "bomb.gguf", "-o", tmp_path / "out"]))
    assert "bomb.gguf" in line and "num_hidden_layers=10000000" in line, line


LAUNCH = """import sys
sys.argv = sys.argv[1:]
from tlm_cli import launch
try:
    getattr(launch, sys.argv[0])()
except SystemExit as stop:
    print("exit", stop.code, "torch imported" if "torch" in sys.modules else "no torch")
"""


def _launch(command: str, *args) -> tuple[str, str]:
    """(stdout, stderr) of a console entry point of tlm_cli.launch run in a fresh interpreter."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", LAUNCH, command, *map(str, args)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "TLM_DEBUG": ""})
    return done.stdout.strip(), done.stderr.strip()


def test_the_console_commands_refuse_a_bomb_before_importing_torch(source, tmp_path, monkeypatch):
    """A config, GGUF or recipe declaring 10^7 layers is refused by the entry point itself, in one line, before the
    commands' modules (and torch behind them: seconds of start-up) are imported."""
    gguf = pytest.importorskip("gguf")
    from test_checkpoint import write_tiny_gguf

    real = gguf.GGUFWriter.add_block_count
    monkeypatch.setattr(gguf.GGUFWriter, "add_block_count", lambda self, n: real(self, 10_000_000))
    write_tiny_gguf(tmp_path / "bomb.gguf")
    monkeypatch.undo()
    folder = with_config(source, tmp_path / "src", num_hidden_layers=10_000_000)
    recipe = _tiny_recipe(tmp_path)
    recipe["model"]["config"]["hidden_size"] = 1 << 20
    cases = [("convert_main", [folder, "-o", tmp_path / "out"],
              f"{folder / 'config.json'}: num_hidden_layers=10000000"),
             ("convert_main", [tmp_path / "bomb.gguf", "-o", tmp_path / "out", "--low-memory"],
              f"{tmp_path / 'bomb.gguf'}: num_hidden_layers=10000000"),
             ("tlm_main", ["train", _write_recipe(tmp_path, recipe), "--no-progress"],
              "recipe: model.config.hidden_size=1048576 is above the supported maximum")]
    for command, args, named in cases:
        out, err = _launch(command, *args)
        assert out == "exit 1 no torch", (command, args, out, err)
        assert err.startswith("error: ") and named in err and "\n" not in err, err
    assert not (tmp_path / "out").exists() and not (tmp_path / "run").exists()


def test_declared_sizes_never_read_a_pipe_or_a_huge_config(tmp_path):
    """What the entry point reads is bounded like every side file: a FIFO config.json is not waited on, and a 65 MiB
    one is not read (each gives no sizes; the command then names the problem)."""
    import threading

    from tlm_io.sizes import declared_sizes

    for name in ("fifo", "huge"):
        (tmp_path / name).mkdir()
    os.mkfifo(tmp_path / "fifo" / "config.json")
    (tmp_path / "huge" / "config.json").write_text('{"num_hidden_layers": 10000000' + " " * (65 << 20) + "}")
    for name in ("fifo", "huge"):
        found = []
        reader = threading.Thread(target=lambda: found.append(declared_sizes(tmp_path / name)), daemon=True)
        reader.start()
        reader.join(timeout=20)
        assert found == [{}], name  # a plain read would block on the FIFO and parse the huge file's layers


def test_the_entry_points_pass_what_they_cannot_judge_to_the_command(source, tmp_path):
    """A good source, an output folder holding a bomb (never read), a file that is no checkpoint, a missing path and
    a built-in name pass the entry point's check: the command itself reads (and judges) them."""
    from tlm_cli.launch import preflight

    bomb = with_config(source, tmp_path / "old_out", num_hidden_layers=10_000_000)
    (tmp_path / "notes.txt").write_text("text")
    preflight([str(source), "-o", str(bomb), "--calibration-data", str(tmp_path / "notes.txt"), "--overwrite"])
    (tmp_path / "deep.yaml").write_text("model: " + "[" * 200_000)  # refused by depth before PyYAML recurses
    (tmp_path / "huge.yaml").write_bytes(b"")
    os.truncate(tmp_path / "huge.yaml", 17 << 20)  # sparse, over the recipe bound: never read
    preflight(["train", str(tmp_path / "deep.yaml"), str(tmp_path / "huge.yaml")])
    (tmp_path / "device").mkdir()
    (tmp_path / "device" / "config.json").symlink_to("/dev/zero")  # never read: it would never end
    preflight([str(tmp_path / "device"), "-o", str(tmp_path / "x")])  # the command names the problem
    preflight(["smollm2-135m", "-o", str(tmp_path / "x"), str(tmp_path / "missing")])
    with pytest.raises(SystemExit):
        preflight([str(source), "--teacher", str(bomb)])


# ============================================================================ times before hours


def test_a_heal_of_a_trillion_tokens_is_refused_after_its_first_steps(source, tmp_path):
    line = _one_error_line(_convert([source, "-o", tmp_path / "out", *FAST, "--heal-tokens", "1000000000000"]))
    assert line.startswith("error: heal: 3,906,250,000 steps of 256 tokens, about "), line
    steps = re.search(r" h at the rate of its first (\d+) steps", line)
    assert steps and 2 <= int(steps.group(1)) < 1000, line  # refused a few steps (about a second) in, not after
    assert "above the --max-hours 24 limit" in line and "lower --heal-tokens" in line, line
    assert not list(tmp_path.iterdir())


def test_self_calibration_of_a_trillion_tokens_is_refused_before_sampling(source, tmp_path):
    line = _one_error_line(_convert([source, "-o", tmp_path / "out", *FAST[2:], "--calibration-data", "self",
                                     "--calibration-tokens", "1000000000000"]))
    assert "--calibration-tokens 1000000000000 needs about" in line and "available memory" in line, line
    assert not list(tmp_path.iterdir())


def test_self_calibration_above_the_time_limit_is_refused_with_its_estimate(source, tmp_path):
    out = tmp_path / "out"
    res = _convert([source, "-o", out, *FAST[2:], "--calibration-data", "self", "--calibration-tokens", "200000",
                    "--max-hours", "0.0001"])
    line = _one_error_line(res)
    assert "self samples: 200,000 tokens, about" in line and "above the --max-hours 0.0001 limit" in line, line
    assert "lower --calibration-tokens" in line and "--max-hours 0 (no limit)" in line, line
    assert not list(tmp_path.iterdir())


def test_endless_layer_reconstruction_is_refused_with_its_estimate(source, tmp_path):
    line = refused(source, tmp_path, "--set", "reconstruct_epochs=1000000000000")
    assert line.startswith("error: layer reconstruction: ") and " epochs, about " in line, line
    assert "above the --max-hours 24 limit" in line and "lower --set reconstruct_epochs" in line, line


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_a_bad_time_limit_is_one_line(source, tmp_path, value):
    line = refused(source, tmp_path, "--max-hours", value)
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


def test_the_seed_is_checked_against_its_range(source, tmp_path):
    line = _one_error_line(_convert([source, "-o", tmp_path / "out", *FAST, "--seed", "10000000000000"]))
    assert "--seed 10000000000000: must be in 0..4294967295" in line, line
    line = _one_error_line(_tlm(["train", _write_recipe(tmp_path, _tiny_recipe(tmp_path, seed=10**13)),
                                 "--no-progress"]))
    assert "seed: must be in 0..4294967295" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.yaml"]

