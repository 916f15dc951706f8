"""The command line: ``tlm-convert`` refusals, a tiny successful conversion, ``tlm eval``, help and README.

Every refusal must be one ``error:`` line on stderr (the last line there; progress headings may come before it),
a non-zero exit, no traceback, nothing on stdout, no OUTPUT folder and no ``.NAME.tmp-*`` folder left behind,
and the input files byte-identical. Most checks run in-process through click's CliRunner; one runs the real
process (``python -m tlm_convert``) for the exit status and stderr of an actual interpreter.
"""

from __future__ import annotations

import hashlib
import inspect
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from safetensors.torch import load_file, save_file
from tiny_sources import DATA, make_source, tiny_tokenizer

import tlm_convert.convert as convert_module
from tlm_cli.convert import convert_main
from tlm_cli.group import COMMANDS, tlm_group
from tlm_cli.main import tlm_main
from tlm_convert.options import KNOBS, method_from
from tlm_io.archs import SUPPORTED_ARCHITECTURES
from tlm_io.errors import ConversionError

ROOT = Path(__file__).resolve().parents[1]
FAST = ["--calibration-data", str(DATA), "--calibration-tokens", "2048", "--seq-len", "64", "--batch-size", "4",
        "--set", "multiple_of=1"]
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}

# The option set of tlm-convert, pinned (torchtitan's test_no_new_cli_options): what a user chooses. A method knob is
# a Method field reached by --set (tlm_convert.options), not a flag; a new flag must show up here and in the README.
TLM_CONVERT_OPTIONS = [
    "--batch-size", "--calibration-data", "--calibration-tokens", "--device", "--dtype", "--eval-data",
    "--eval-tasks", "--eval-tokens", "--export", "--heal-tokens", "--help", "--low-memory", "--max-hours", "--mixer",
    "--output",
    "--overwrite", "--ratio", "--schedule", "--seed", "--seq-len", "--set", "--trust-remote-code",
]


def _runner() -> CliRunner:
    # click >= 8.2 always keeps stderr apart (result.stderr); click 8.1 needs mix_stderr=False for that
    if "mix_stderr" in inspect.signature(CliRunner.__init__).parameters:
        return CliRunner(mix_stderr=False)
    return CliRunner()


def _run(args, env=None, command=convert_main):
    prog = "tlm-convert" if command is convert_main else "tlm"
    return _runner().invoke(command, [str(a) for a in args], env={**OFFLINE, **(env or {})}, prog_name=prog)


def _digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _assert_refused(result, out: Path, inputs: dict[Path, dict] | None = None) -> str:
    """The refusal contract; returns the message after ``error: ``."""
    text = result.stdout + result.stderr
    assert "Traceback" not in text, text
    assert result.exit_code not in (0, None), text
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.stdout == "", result.stdout
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], result.stderr
    assert not out.exists(), f"{out} was left behind"
    leftovers = list(out.parent.glob(f".{out.name}.tmp-*")) if out.parent.exists() else []
    assert not leftovers, leftovers
    for folder, before in (inputs or {}).items():
        assert _digest(folder) == before, f"{folder} was modified"
    return errors[0].removeprefix("error:").strip()


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return make_source(tmp_path_factory.mktemp("cli") / "llama", "llama", tokenizer=tiny_tokenizer())


@pytest.fixture
def copy_of(source, tmp_path):
    """make(name) -> a private copy of the tiny source, for tests that damage it."""
    return lambda name="src": Path(shutil.copytree(source, tmp_path / name))


@pytest.fixture(scope="module")
def converted(source, tmp_path_factory):
    """One successful CLI conversion with two --eval-data sets (shared by the summary and `tlm eval` tests)."""
    out = tmp_path_factory.mktemp("converted") / "tlm"
    result = _run([source, "-o", out, *FAST, "--eval-data", DATA, "--eval-data", "default-eval",
                   "--eval-tokens", "512"])
    return result, out


# ============================================================================================ refusals


def test_missing_path(tmp_path):
    out = tmp_path / "out"
    message = _assert_refused(_run([tmp_path / "no-such-model", "-o", out, *FAST]), out)
    assert "does not exist" in message


def test_folder_without_config(tmp_path):
    folder = tmp_path / "empty-model"
    folder.mkdir()
    (folder / "notes.txt").write_text("not a model")
    before, out = _digest(folder), tmp_path / "out"
    message = _assert_refused(_run([folder, "-o", out, *FAST]), out, {folder: before})
    assert "config.json" in message


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_safetensors(damage, copy_of, tmp_path):
    folder = copy_of()
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncated" else os.urandom(1000))
    before, out = _digest(folder), tmp_path / "out"
    message = _assert_refused(_run([folder, "-o", out, *FAST]), out, {folder: before})
    assert "model.safetensors" in message and "corrupt or truncated" in message


def test_corrupt_safetensors_real_process(copy_of, tmp_path):
    """The installed entry point's module form, in a real interpreter: exit 1, one error line, no traceback."""
    folder = copy_of()
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    before, out = _digest(folder), tmp_path / "out"
    env = {**os.environ, **OFFLINE, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "tlm_convert", str(folder), "-o", str(out), *FAST],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert proc.stdout == ""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error:") and "corrupt or truncated" in lines[-1], proc.stderr
    assert sum(line.startswith("error:") for line in lines) == 1
    assert not out.exists() and not list(tmp_path.glob(".out.tmp-*"))
    assert _digest(folder) == before


def test_unsupported_architecture_lists_supported_ones(copy_of, tmp_path):
    folder = copy_of()
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="bert", architectures=["BertForMaskedLM"])
    (folder / "config.json").write_text(json.dumps(config))
    before, out = _digest(folder), tmp_path / "out"
    message = _assert_refused(_run([folder, "-o", out, *FAST]), out, {folder: before})
    assert "unsupported architecture" in message and "'bert'" in message
    for model_type in SUPPORTED_ARCHITECTURES:
        assert model_type in message


@pytest.mark.parametrize("ratio", ["1.5-0.5", "abc", "1.5/", ""])
def test_malformed_ratio(ratio, source, tmp_path):
    before, out = _digest(source), tmp_path / "out"
    message = _assert_refused(_run([source, "-o", out, *FAST, "--ratio", ratio]), out, {source: before})
    assert "ratio" in message and "A/B" in message


@pytest.mark.parametrize(("ratio", "expected"), [("1.99/0.01", r"width of 0.*>= 1"), ("2/1", r"sum to 2.*budget")])
def test_ratio_that_cannot_be_met(ratio, expected, source, tmp_path):
    before, out = _digest(source), tmp_path / "out"
    message = _assert_refused(_run([source, "-o", out, *FAST, "--ratio", ratio]), out, {source: before})
    assert re.search(expected, message), message


def test_calibration_data_shorter_than_one_block(source, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text(DATA.read_text()[:40])
    before, out = _digest(source), tmp_path / "out"
    args = [source, "-o", out, *FAST[2:], "--calibration-data", short]  # FAST[2:]: FAST less its calibration data
    message = _assert_refused(_run(args), out, {source: before})
    assert "fewer than one block" in message and "--seq-len 64" in message


def test_missing_calibration_file(source, tmp_path):
    before, out = _digest(source), tmp_path / "out"
    message = _assert_refused(_run([source, "-o", out, *FAST[2:], "--calibration-data", tmp_path / "nope.txt"]), out,
                              {source: before})
    assert "does not exist" in message


@pytest.mark.parametrize("value", ["nan", "inf"])
@pytest.mark.parametrize("streaming", [False, True], ids=["in-memory", "low-memory"])
def test_non_finite_weights(value, streaming, copy_of, tmp_path):
    folder = copy_of()
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name][3, 5] = float(value)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    before, out = _digest(folder), tmp_path / "new" / "out"  # parents the run creates are removed again
    args = [folder, "-o", out, *FAST] + (["--low-memory"] if streaming else [])
    message = _assert_refused(_run(args), out, {folder: before})
    assert "NaN or Inf" in message and "up_proj" in message
    assert not (tmp_path / "new").exists()


def test_existing_output_is_refused_then_replaced_with_overwrite(source, copy_of, tmp_path):
    from tlm_io.outputs import write_marker

    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("previous run")
    write_marker(out, "tlm-convert")  # an earlier output of ours (its marker lists keep.txt): --overwrite replaces it
    before_src, before_out = _digest(source), _digest(out)
    result = _run([source, "-o", out, *FAST])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.stderr.strip().splitlines()[-1].startswith("error:") and "already exists" in result.stderr
    assert "--overwrite" in result.stderr
    assert _digest(out) == before_out and _digest(source) == before_src
    # --overwrite with a bad input keeps the previous output
    broken = copy_of("broken")
    (broken / "model.safetensors").write_bytes(b"\0" * 64)
    result = _run([broken, "-o", out, *FAST, "--overwrite"])
    assert result.exit_code == 1 and "corrupt or truncated" in result.stderr and "Traceback" not in result.output
    assert _digest(out) == before_out
    # --overwrite with a good input replaces it
    result = _run([source, "-o", out, *FAST, "--calibration-tokens", "256", "--overwrite"])
    assert result.exit_code == 0, result.output
    assert not (out / "keep.txt").exists() and (out / "config.json").is_file()
    assert not list(tmp_path.glob(".out.tmp-*"))
    assert _digest(source) == before_src


def test_calibration_tokens_below_seq_len(source, tmp_path):
    before, out = _digest(source), tmp_path / "out"
    args = [source, "-o", out, *FAST, "--calibration-tokens", "32"]
    message = _assert_refused(_run(args), out, {source: before})
    assert "calibration-tokens 32" in message and "seq-len 64" in message


def test_option_names_keep_their_dashes(source, tmp_path):
    out = tmp_path / "out"
    message = _assert_refused(_run([source, "-o", out, *FAST, "--calibration-tokens", "32"]), out)
    assert message.startswith("--calibration-tokens 32"), message


def test_hub_id_while_offline_asks_for_a_local_path(tmp_path):
    out = tmp_path / "out"
    result = _run(["tapered-lm-tests/no-such-model", "-o", out, *FAST], env={"HF_HUB_OFFLINE": "1"})
    message = _assert_refused(result, out)
    assert "tapered-lm-tests/no-such-model" in message and "local" in message


@pytest.mark.parametrize(("flag", "value", "expected"), [("--device", "no-such-device", "not a torch device"),
                                                          ("--set", "multiple_of=0", "integer >= 1"),
                                                          ("--seq-len", "0", "positive integer")])
def test_bad_option_values(flag, value, expected, source, tmp_path):
    before, out = _digest(source), tmp_path / "out"
    message = _assert_refused(_run([source, "-o", out, *FAST, flag, value]), out, {source: before})
    assert expected in message


@pytest.mark.parametrize("args", [["--calibration-tokens", "abc"], ["--schedule", "nope"], ["--no-such-flag"]])
def test_usage_errors_are_one_line(args, source, tmp_path):
    out = tmp_path / "out"
    result = _run([source, "-o", out, *args])
    message = _assert_refused(result, out)
    assert result.exit_code == 2 and "tlm-convert --help" in message
    result = _run([source], command=convert_main)  # no -o
    assert result.exit_code == 2 and _assert_refused(result, out).startswith("Missing option '-o'")


@pytest.mark.parametrize(("setting", "expected"), [
    ("no_such_knob=1", r"^no_such_knob: unknown method knob; the knobs: importance, .*, fold_iters \(docs/knobs.md\)"),
    ("importance=bogus", r"^importance: expected one of auto, activation, .*, fisher_obs, got 'bogus'"),
    ("fisher_draws=two", r"^fisher_draws: expected an integer, got 'two'"),
    ("refit=maybe", r"^refit: expected true or false, got 'maybe'"),
    ("fisher_draws=0", r"^fisher_draws=0: must be an integer >= 1"),
    ("seed=1", r"^seed: not a method knob but an option: use --seed"),
    ("importance", r"expected name=value")])
def test_bad_knobs_are_refused_as_bad_options_are(setting, expected, source, tmp_path):
    """A bad --set: one usage error line naming the knob and what it takes, as a bad option value gets."""
    out = tmp_path / "out"
    result = _run([source, "-o", out, "--set", setting])
    message = _assert_refused(result, out)
    assert result.exit_code == 2 and message.startswith("Invalid value for '--set': "), message
    assert re.search(expected, message.removeprefix("Invalid value for '--set': ")), message


# a valid value other than the default for every knob (with what it needs of the options)
KNOB_VALUES = {"importance": ("obs", []), "fisher_draws": (3, []), "fisher_mask": ("sequence", []),
               "fisher_blocks": (4, []), "fisher_seq_len": (32, []), "grow_init": ("split", []),
               "noise_scale": (0.5, []), "refit": (False, []), "refit_target": ("local", []), "damp": (0.01, []),
               "token_weighting": ("sink", []), "reconstruct_epochs": (2, []), "reconstruct_lr": (0.001, []),
               "multiple_of": (8, []), "taper_stages": (2, ["--heal-tokens", "100000"]),
               "shrink": ("fold", []), "fold_iters": (3, []),
               "fisher_dtype": ("bfloat16", [])}


@pytest.mark.parametrize("knob", sorted(KNOB_VALUES))
def test_every_knob_reaches_the_conversion(knob, monkeypatch, source, tmp_path):
    """--set KNOB=VALUE arrives in the options convert() is given, every other knob at its default."""
    assert set(KNOB_VALUES) == set(KNOBS)  # a new knob gets a value here
    seen = []

    def recorded(source, output, opts, **callbacks):
        seen.append(opts)
        raise ConversionError("recorded")

    monkeypatch.setattr(convert_module, "convert", recorded)
    value, extra = KNOB_VALUES[knob]
    text = str(value).lower() if isinstance(value, bool) else str(value)
    out = tmp_path / "out"
    assert _assert_refused(_run([source, "-o", out, "--set", f"{knob}={text}", *extra]), out) == "recorded"
    method = seen[0].method
    assert getattr(method, knob) == value
    default = method_from([])
    assert all(getattr(method, k) == getattr(default, k) for k in KNOBS if k not in (knob, "importance"))


def test_unexpected_error_inside_convert_is_one_line_and_leaves_nothing(monkeypatch, source, tmp_path):
    """A bug (not a ConversionError) raised after convert() started writing: one line, partial files removed (the
    staged folder and the parents of OUTPUT the run created; tlm_io.outputs.output_run)."""
    from tlm_io.outputs import staged

    def broken_convert(source, out, opts, on_phase, on_layer, *limits):
        on_phase("load")
        with staged(out) as tmp:
            (tmp / "model.safetensors").write_bytes(b"partial")
            raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(convert_module, "_convert", broken_convert)
    out = tmp_path / "new" / "nested" / "out"
    message = _assert_refused(_run([source, "-o", out, *FAST]), out)
    assert message.startswith("internal error: RuntimeError: boom; second line") and "TLM_DEBUG" in message
    assert not (tmp_path / "new").exists()
    result = _run([source, "-o", out, *FAST], env={"TLM_DEBUG": "1"})
    assert isinstance(result.exception, RuntimeError)  # the traceback on request


# ============================================================================================ success


def test_progress_says_where_it_is_and_how_much_is_left(converted):
    """The phases in order, then one bar over the layers that knows their number; notes on lines of their own."""
    result, _ = converted
    screen = result.stderr.replace("\r", "\n")
    markers = re.findall(r"^\[(\w+)\]$", screen, re.M)
    assert markers[:2] == ["load", "eval"] and "rank" in markers, markers
    assert re.search(r"^layers: 100%\|.*\| 4/4 ", screen, re.M), screen
    assert screen.index("[rank]") < screen.index("layers:") < screen.index("[save]")


def test_a_note_during_a_progress_bar_gets_a_line_of_its_own(monkeypatch):
    from tqdm import tqdm

    from tlm_cli.common import say

    monkeypatch.setattr(sys, "stderr", io.StringIO())
    bar = tqdm(total=3, desc="layers", file=sys.stderr)
    bar.update(1)
    say("note: heal: 1,024 tokens, about 3 min")
    bar.close()
    assert "note: heal: 1,024 tokens, about 3 min" in sys.stderr.getvalue().replace("\r", "\n").splitlines()


def test_successful_conversion_prints_the_summary(converted, source):
    result, out = converted
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == f"wrote {out} (tlm format)"
    params = re.fullmatch(r"parameters: ([\d,]+) before, ([\d,]+) after \(equal\)", lines[1])
    assert params and params[1] == params[2], lines[1]
    assert re.fullmatch(r"widths: 48 x 4 -> 72 \.\. 24 \(cosine\)", lines[2]), lines[2]
    ratios = []
    # calibrated on DATA: DATA is the calibration domain, the bundled default-eval is not
    for line, name in zip(lines[3:5], (re.escape(str(DATA)) + r" \(calibration domain\)", "default-eval")):
        ppl = re.fullmatch(rf"perplexity on {name}: ([\d.]+) before, ([\d.]+) after \(x([\d.]+)\)", line)
        assert ppl and all(math.isfinite(float(x)) and float(x) > 0 for x in ppl.groups()), line
        ratios.append(float(ppl[3]))
    mean = re.fullmatch(r"perplexity ratio x([\d.]+), geometric mean over the 1 out-of-domain set", lines[5])
    assert mean and float(mean[1]) == pytest.approx(ratios[1], abs=1e-3), lines[5]  # the one set outside the domain
    assert lines[6].startswith("time: ")
    assert "error:" not in result.stderr and "Traceback" not in result.output
    assert (out / "config.json").is_file() and (out / "conversion_report.json").is_file()
    assert not list(out.parent.glob(f".{out.name}.tmp-*"))


def test_tlm_eval_prints_json_with_a_finite_perplexity(converted):
    _, out = converted
    assert out.is_dir()
    result = _run(["eval", out, "--data", DATA, "--seq-len", "64", "--max-tokens", "256", "--batch-size", "4"],
                  command=tlm_main)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["tokens"] == 256 and report["seq_len"] == 64 and report["stride"] == 32
    assert report["scored_tokens"] == 255 and report["windows"] == 7 and report["window_prefix"] == []
    assert math.isfinite(report["perplexity"]) and report["perplexity"] > 1


def test_tlm_eval_reads_plain_text_of_any_suffix_and_several_sets(converted, tmp_path):
    """`tlm eval --data wiki.test.raw`: a UTF-8 file is text whatever its suffix; repeated --data gives one JSON line
    per set, in order; --data-format text reads a file as text even under a data-file suffix."""
    _, out = converted
    raw, jsonl = tmp_path / "wiki.test.raw", tmp_path / "prose.jsonl"
    raw.write_bytes(Path(DATA).read_bytes())
    jsonl.write_bytes(Path(DATA).read_bytes())
    args = ["--seq-len", "64", "--max-tokens", "256", "--batch-size", "4"]
    result = _run(["eval", out, "--data", DATA, "--data", raw, *args], command=tlm_main)
    assert result.exit_code == 0, result.output
    reports = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["data"] for r in reports] == [str(DATA), str(raw)]
    assert reports[0]["perplexity"] == reports[1]["perplexity"]  # the same text, read the same way
    forced = _run(["eval", out, "--data", jsonl, "--data-format", "text", *args], command=tlm_main)
    assert forced.exit_code == 0, forced.output
    assert json.loads(forced.stdout)["perplexity"] == reports[0]["perplexity"]


def test_tlm_eval_refuses_a_binary_file_in_one_line(converted, tmp_path):
    _, out = converted
    blob = tmp_path / "weights.raw"
    blob.write_bytes(bytes(range(256)) * 64)
    result = _run(["eval", out, "--data", blob], command=tlm_main)
    assert result.exit_code == 1 and "Traceback" not in result.output and result.stdout == ""
    assert result.stderr.strip().splitlines() == [result.stderr.strip()] and "not UTF-8 text" in result.stderr


def test_tlm_eval_refuses_a_missing_model(tmp_path):
    result = _run(["eval", tmp_path / "nope", "--data", DATA], command=tlm_main)
    assert result.exit_code == 1 and "Traceback" not in result.output and result.stdout == ""
    assert result.stderr.strip().splitlines() == [result.stderr.strip()] and "does not exist" in result.stderr


# ============================================================================================ help and README


def _long_options(command: click.Command) -> list[str]:
    params = command.get_params(click.Context(command))
    return sorted(o for p in params for o in (*p.opts, *getattr(p, "secondary_opts", ())) if o.startswith("--"))


def test_help():
    for command, args in ((convert_main, ["--help"]), (tlm_main, ["--help"]), (tlm_main, ["eval", "--help"])):
        result = _run(args, command=command)
        assert result.exit_code == 0 and result.stdout.startswith("Usage: "), result.output
    help_text = _run(["--help"], command=convert_main).stdout
    assert "eval" in _run(["--help"], command=tlm_main).stdout
    for option in _long_options(convert_main):
        assert option in help_text, option


def test_one_tlm_group_and_tlm_convert_is_tlm_convert():
    assert set(tlm_main.commands) == {"convert", "train", "tokenize", "export", "eval", "analyze", "compare"}
    assert tlm_main.commands["convert"] is convert_main
    via_group = _run(["convert", "--help"], command=tlm_main).stdout
    assert via_group.replace("Usage: tlm convert", "Usage: tlm-convert") == _run(["--help"], command=convert_main).stdout


def test_tlm_convert_option_set_is_pinned():
    assert _long_options(convert_main) == TLM_CONVERT_OPTIONS


def test_tlm_help_lists_the_commands_without_importing_them():
    """The console's tlm group (tlm_cli.group) shows tlm_cli.main's help and runs its commands."""
    assert _run(["--help"], command=tlm_group).stdout == _run(["--help"], command=tlm_main).stdout
    assert set(COMMANDS) == set(tlm_main.commands)
    assert all(tlm_group.get_command(None, name) is tlm_main.commands[name] for name in COMMANDS)


def test_help_and_refusals_come_before_torch(source, tmp_path):
    """tlm --help, tlm-convert --help, and a bad option, knob or input refused before torch or transformers is
    imported (a fresh interpreter: the help in well under a second, every option and path checked before the load)."""
    out = tmp_path / "out"
    cases = [["tlm", "--help"], ["tlm-convert", "--help"], ["tlm", "convert", "--help"],
             ["tlm-convert", source, "-o", out, "--ratio", "2/0"], ["tlm-convert", source, "-o", out, "--ratio", "x"],
             ["tlm-convert", tmp_path / "missing", "-o", out], ["tlm-convert", source, "-o", out, "--set", "x=1"],
             ["tlm-convert", source, "-o", out, "--calibration-tokens", "32", "--seq-len", "64"],
             ["tlm-convert", source, "-o", source], ["tlm-convert", source, "-o", out, "--low-memory", "--export", "hf"]]
    script = ("import json, sys\nfrom tlm_cli.launch import convert_main, tlm_main\ncodes = []\n"
              "for case in json.loads(sys.argv[1]):\n    sys.argv = case\n    try:\n"
              "        (tlm_main if case[0] == 'tlm' else convert_main)()\n    except SystemExit as done:\n"
              "        codes.append(done.code)\n"
              "print(json.dumps([codes, sorted({'torch', 'transformers'} & set(sys.modules))]))\n")
    env = {**os.environ, **OFFLINE, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", script, json.dumps([[str(w) for w in c] for c in cases])],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    codes, heavy = json.loads(proc.stdout.splitlines()[-1])
    assert codes == [0, 0, 0, 1, 1, 1, 2, 1, 1, 1] and heavy == [], proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 7 and "Traceback" not in proc.stderr, proc.stderr
    assert "every multiplier must be > 0" in errors[0] and "does not exist" in errors[2], errors


def test_readme_synopsis_covers_every_option():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Converting a checkpoint", 1)[1]
    synopsis = re.search(r"```bash\n(.*?)```", section, re.S)[1]
    assert synopsis.lstrip().startswith("tlm-convert ")
    mentioned = set(re.findall(r"(?<![\w-])(--?[a-z][a-z0-9-]*)", synopsis))
    params = convert_main.get_params(click.Context(convert_main))
    known = set()
    for param in params:
        names = [*param.opts, *getattr(param, "secondary_opts", ())]
        known.update(names)
        if isinstance(param, click.Option) and "--help" not in names:
            assert mentioned & set(names), f"README synopsis does not mention {names}"
    assert mentioned <= known, f"README synopsis mentions unknown options {sorted(mentioned - known)}"


# Every command example in the README, the docs/ pages and the recipes' comments, checked against the commands' own
# options: a renamed or removed option (or choice value, or recipe file) fails here, not in a user's terminal.
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RECIPE_COMMENT = re.compile(r"(?:^#\s{2,}|^#.*?(?::\s+|\())((?:tlm-convert|tlm|torchrun|python -m tlm_\w+) [^()#]*)")


def _doc_commands() -> list[tuple[str, str]]:
    """(where, command line) for every command line in the docs' bash blocks and the recipes' comment examples;
    comments stripped, continuation lines (a trailing backslash, or an indented line) joined."""
    found = []
    for path in DOC_FILES:
        for block in re.findall(r"```bash\n(.*?)```", path.read_text(encoding="utf-8"), re.S):
            current = None
            for line in block.replace("\\\n", " ").splitlines():
                code = re.split(r"(?:^|\s)#", line, maxsplit=1)[0]
                if line[:1].isspace() and current is not None:
                    current[1] += " " + code
                elif code.strip():
                    current = [path.name, code]
                    found.append(current)
    for path in sorted((ROOT / "recipes").rglob("*.yaml")):
        for line in path.read_text(encoding="utf-8").splitlines():
            m = RECIPE_COMMENT.match(line)
            if m:
                found.append([path.relative_to(ROOT).as_posix(), m[1].rstrip(" :")])
    return [(where, code.strip()) for where, code in found]


def _cli_args(words: list[str]):
    """(click command, its arguments) for a tlm / tlm-convert / ``-m tlm_train`` / ``-m tlm_convert`` command line."""
    if words[0] == "tlm-convert":
        return convert_main, words[1:]
    if words[0] == "tlm" and len(words) > 1:
        return tlm_main.commands[words[1]], words[2:]
    if "-m" in words and words.index("-m") + 1 < len(words):
        i = words.index("-m")
        module = words[i + 1]
        if module == "tlm_convert":
            return convert_main, words[i + 2:]
        if module == "tlm_train":
            return tlm_main.commands[words[i + 2]], words[i + 3:]
    return None, []


def test_every_command_example_in_the_docs_matches_its_help():
    checked = 0
    for where, line in _doc_commands():
        for part in line.split("&&"):
            words = part.split()
            if not words:
                continue
            command, args = _cli_args(words)
            if command is None:
                continue
            checked += 1
            params = command.get_params(click.Context(command))
            by_name = {o: p for p in params for o in (*p.opts, *getattr(p, "secondary_opts", ()))}
            words = [w.strip("[]") for w in args]
            for i, word in enumerate(words):
                if command is convert_main and i and words[i - 1] == "--set" and re.fullmatch(r"[a-z_]+=[\w.-]+", word):
                    method_from([word])  # a literal knob setting (not KNOB=VALUE) must be a valid one
                for option in re.findall(r"(?<![\w-])(--?[a-z][a-z0-9-]*)", word):
                    assert option in by_name, f"{where}: `{part.strip()}` uses {option}, which is not an option"
                name, _, value = word.partition("=")
                param = by_name.get(name)
                if isinstance(getattr(param, "type", None), click.Choice) and not getattr(param, "is_flag", False):
                    value = value or (words[i + 1] if i + 1 < len(words) else "")
                    if re.fullmatch(r"[a-z0-9_.|-]+", value):  # a literal value (or a|b|c), not a PLACEHOLDER
                        for v in value.split("|"):
                            assert v in param.type.choices, f"{where}: {name} {v} is not one of {param.type.choices}"
                if word.startswith("recipes/"):
                    assert (ROOT / word).is_file(), f"{where}: {word} does not exist"
    assert checked >= 40  # the README alone has about 20 command lines; a parser that finds none must fail
