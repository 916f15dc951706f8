"""tlm-convert's options and method knobs (tlm_convert.options): one default per knob, the --set mechanism, the ratio
parsed once and checked as tlm.schedule checks it, the choice lists, and the generated table of knobs."""

import json
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

import tlm
from tlm_convert.calibrate import LayerSettings
from tlm_convert.convert import layer_settings
from tlm_convert.options import (EXPORT_FORMATS, KNOBS, MEASURED, MIXER_CHOICES, SCHEDULES,
                                 ConvertOptions, Method, Ratio, method_from, method_settings, options_from)
from tlm_io.errors import ConversionError
from tlm_io.export import FORMATS

ROOT = Path(__file__).resolve().parents[1]


def test_the_choice_lists_are_the_librarys():
    """The torch-free copies tlm-convert offers are the lists the library uses."""
    assert SCHEDULES == tlm.SCHEDULES and MIXER_CHOICES == tuple(tlm.MIXERS) and EXPORT_FORMATS == FORMATS


def test_the_layer_loop_keeps_no_second_set_of_defaults():
    """The knobs' defaults live in Method alone: the layer loop takes a Method and the run's batch size and seed."""
    assert not {f.name for f in fields(LayerSettings)} & set(KNOBS)
    opts = ConvertOptions(batch_size=3, seed=7)
    opts.validate()
    settings = layer_settings(opts)
    assert settings.method is opts.method and (settings.batch_size, settings.seed) == (3, 7)
    assert settings.method == Method(importance="fisher")  # auto in memory: the whole model's Fisher cost


def test_set_reads_yaml_scalars_into_typed_knobs():
    method = method_from(["importance=obs", "fisher_draws=3", "refit=false", "damp=1e-2", "multiple_of=null",
                          "grow_init = split"])
    assert (method.importance, method.fisher_draws, method.refit, method.damp, method.grow_init) == \
        ("obs", 3, False, 0.01, "split")
    assert method_settings(method) == ["importance=obs", "fisher_draws=3", "grow_init=split", "refit=false",
                                       "damp=0.01"]
    assert method_from(method_settings(method)) == method  # what the settings say, read back
    assert method_from({"fisher_draws": 3}, base=method) == method and method_from([]) == Method()


@pytest.mark.parametrize(("settings", "message"), [
    (["nope=1"], r"^--set nope: unknown method knob; the knobs: importance, fisher_draws, .*, taper_stages"),
    (["batch_size=2"], r"^--set batch_size: not a method knob but an option: use --batch-size$"),
    (["fisher_mask=both"], r"^--set fisher_mask: expected one of token, sequence, got 'both'$"),
    (["reconstruct_lr=fast"], r"^--set reconstruct_lr: expected a number, got 'fast'$"),
    (["taper_stages=1.5"], r"^--set taper_stages: expected an integer, got 1.5$"),
    (["refit=yes please"], r"^--set refit: expected true or false, got 'yes please'$"),
    (["noise_scale=-1"], r"^--set noise_scale=-1.0: must be a number >= 0$"),
    (["damp=0"], r"^--set damp=0.0: must be a number > 0$"),
    (["damp=.nan"], r"^--set damp: expected a finite number"),
    (["=3"], r"^--set '=3': expected name=value"),
    ({"importance": "bogus"}, r"^--set importance: expected one of auto, activation, "),
])
def test_bad_knobs_are_one_line_errors(settings, message):
    with pytest.raises(ConversionError, match=message):
        method_from(settings)


def test_a_knob_given_in_python_is_checked_as_set_checks_it():
    with pytest.raises(ConversionError, match=r"^--set grow_init: expected one of noise, zero, split, got 'copy'$"):
        ConvertOptions(method=Method(grow_init="copy")).validate()
    with pytest.raises(ConversionError, match=r"^--set fisher_draws: expected an integer, got '2'$"):
        ConvertOptions(method=Method(fisher_draws="2")).validate()
    opts = options_from(seq_len=64, importance="obs", multiple_of=1)  # option and knob names alike
    assert (opts.seq_len, opts.method.importance, opts.method.multiple_of) == (64, "obs", 1)
    with pytest.raises(TypeError):
        options_from(no_such_field=1)


def test_the_ratio_is_parsed_once_and_printed_as_given():
    ratio = Ratio.parse(" 1.4 / 0.6 ")
    assert ratio == Ratio((1.4, 0.6)) and (ratio.first, ratio.last) == (1.4, 0.6) and str(ratio) == "1.4/0.6"
    assert str(Ratio.parse("2/0.0")) == "2/0" and str(Ratio((1 + 0.5 / 3, 1 - 0.5 / 3))) == \
        "1.1666666666666667/0.8333333333333334"
    opts = ConvertOptions(ratio="1.25/0.75")
    assert opts.ratio == Ratio((1.25, 0.75)) and ConvertOptions(ratio=opts.ratio).ratio is opts.ratio
    opts.validate()
    record = opts.record()
    assert record["ratio"] == "1.25/0.75" and record["method"]["importance"] == "fisher"
    assert json.loads(json.dumps(record)) == record  # JSON as it is
    for text in ("1.5-0.5", "abc", "1.5/", "", "nan/1", "1/inf"):
        with pytest.raises(ConversionError, match=r"^--ratio .* is malformed; expected the form A/B"):
            Ratio.parse(text)


RATIOS = ["1.5/0.5", "1.4/0.6", "0.5/1.5", "2/0", "2/1", "1/1", "1.5/1/0.5", "-0.5/2.5", "3/1", "1.2/0.8", "0/2",
          "0.75/1.5/0.75", "1.5/0.5/0", "2/0.0001", "1.9/0.1"]


@pytest.mark.filterwarnings("ignore:ratio=.*reverse taper")
@pytest.mark.parametrize("schedule", SCHEDULES + MEASURED)
@pytest.mark.parametrize("text", RATIOS)
def test_the_early_ratio_check_refuses_what_the_schedule_would(schedule, text):
    """Ratio.check (before the model loads) refuses a ratio exactly when tlm.schedule refuses it for a model where
    only the ratio can fail: wide layers (no width below 1), three layers (the three-group budget is their sum)."""
    ratio = Ratio.parse(text)
    reference = "cosine" if schedule in MEASURED else schedule  # a measured schedule is planned beside cosine
    try:
        tlm.taper_widths(3, 3000, reference, ratio.values, multiple_of=1)
        if schedule in MEASURED:
            tlm.measured_widths([3, 2, 1], 3000, 1, bounds=(min(ratio.values), max(ratio.values)))
        library = None
    except ValueError as err:
        library = str(err)
    try:
        ratio.check(schedule)
        early = None
    except ConversionError as err:
        early = str(err)
    if schedule == "three-group" and early is None and library is not None:
        assert "budget" in library  # depends on the layer count: checked when the widths are planned
    else:
        assert (early is None) == (library is None), (early, library)


def test_the_knob_table_in_the_docs_is_fresh():
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "knob_table.py"), "--check"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    page = (ROOT / "docs" / "knobs.md").read_text(encoding="utf-8")
    assert all(f"| `{name}` |" in page for name in KNOBS)
