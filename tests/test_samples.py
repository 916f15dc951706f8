"""Calibration blends and text sampled from the source (``--calibration-data self``), on tiny checkpoints."""

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from tiny_sources import DATA, make_source, tiny_tokenizer

from tlm_cli.convert import convert_main
from tlm_convert.convert import SAMPLES_FILE, convert
from tlm_convert.heal import heal_data
from tlm_convert.options import DEFAULT_CALIBRATION, calibration_sources, options_from
from tlm_convert.samples import calibration_blocks, sample_blocks, samples_text
from tlm_io.checkpoint import load_source
from tlm_io.errors import ConversionError
from tlm_io.load import materialize
from tlm_io.text import load_text, token_blocks
from tlm_train.trainer import bf16_is_fast

OPTS = dict(calibration_tokens=1024, seq_len=64, batch_size=4, multiple_of=1)


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def source(tmp_path_factory, tokenizer):
    return make_source(tmp_path_factory.mktemp("src"), "llama", tokenizer=tokenizer)


@pytest.fixture(scope="module")
def model(source):
    src = load_source(str(source), dtype=torch.float32)
    return materialize(src.tlm_config, src.state_dict).eval()


def test_samples_are_seeded_fill_their_blocks_and_leave_the_global_rng(model, tokenizer):
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a = sample_blocks(model, tokenizer, 5, 17, seed=1, batch_size=2)  # batches of 2, 2, 1
    assert torch.equal(torch.random.get_rng_state(), before)
    assert a.shape == (5, 17) and a.dtype == torch.long
    assert not (a == tokenizer.eos_token_id).any()  # the start (EOS: no BOS here) and EOS are suppressed
    assert torch.equal(a, sample_blocks(model, tokenizer, 5, 17, seed=1, batch_size=2))
    assert not torch.equal(a, sample_blocks(model, tokenizer, 5, 17, seed=2, batch_size=2))
    assert len(set(map(tuple, a.tolist()))) == 5  # sampled, not greedy: the rows differ


def test_sampling_progress_counts_every_generated_token(model, tokenizer, capsys):
    sample_blocks(model, tokenizer, 3, 9, batch_size=2, progress=True)
    err = capsys.readouterr().err
    assert "self samples" in err and "27/27" in err


def test_a_blend_gives_each_source_an_equal_share(model, tokenizer, tmp_path):
    other = tmp_path / "other.txt"
    other.write_text(load_text(str(DATA))[::-1], encoding="utf-8")
    blocks, samples = calibration_blocks(tokenizer, (str(DATA), str(other)), 64, 1024)
    assert samples is None and blocks.shape == (16, 64)
    assert torch.equal(blocks[:8], token_blocks(tokenizer, load_text(str(DATA)), 64, 512))
    assert torch.equal(blocks[8:], token_blocks(tokenizer, load_text(str(other)), 64, 512))
    blocks, samples = calibration_blocks(tokenizer, (str(DATA), "self"), 64, 1024, model, seed=0)
    assert blocks.shape == (16, 64) and torch.equal(blocks[8:], samples)
    assert torch.equal(samples, sample_blocks(model, tokenizer, 8, 64, seed=0))
    with pytest.raises(ConversionError, match="gives each of the 2 calibration sources 32 tokens, less than one"):
        calibration_blocks(tokenizer, (str(DATA), "self"), 64, 64, model)


def test_default_sources_and_the_low_memory_refusal():
    assert calibration_sources(None) == DEFAULT_CALIBRATION == ("default", "self")
    assert calibration_sources(()) == DEFAULT_CALIBRATION
    assert calibration_sources(None, low_memory=True) == ("default",)
    assert calibration_sources("x.txt", low_memory=True) == ("x.txt",)
    with pytest.raises(ConversionError, match="with --low-memory pass calibration text only"):
        calibration_sources(("default", "self"), low_memory=True)


def test_conversion_calibrated_on_a_blend_keeps_its_samples(source, tokenizer, model, tmp_path):
    report = convert(str(source), str(tmp_path / "out"),
                     options_from(calibration_data=(str(DATA), "self"), eval_data=str(DATA), **OPTS))
    assert report["calibration_data"] == [str(DATA), "self"] and report["calibration_tokens"] == 1024
    assert report["calibration_samples"] == {"file": SAMPLES_FILE, "blocks": 8}
    assert report["seconds"]["sample"] > 0
    text = (tmp_path / "out" / SAMPLES_FILE).read_bytes().decode("utf-8")
    assert text == samples_text(tokenizer, sample_blocks(model, tokenizer, 8, 64, seed=0))
    assert report["perplexity_sets"][0]["in_domain"]  # the evaluation set is one of the sources
    saved = json.loads((tmp_path / "out" / "conversion_report.json").read_text())
    assert saved["calibration_data"] == [str(DATA), "self"]
    assert "`self` (text sampled from the source" in (tmp_path / "out" / "report.md").read_text()


def test_cli_blend_and_low_memory_self_refusal(source, tmp_path):
    common = ["--calibration-tokens", "1024", "--seq-len", "64", "--batch-size", "4", "--set", "multiple_of=1"]
    res = CliRunner().invoke(convert_main, [str(source), "-o", str(tmp_path / "a"), *common, "--calibration-data",
                                            str(DATA), "--calibration-data", "self"])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "a" / SAMPLES_FILE).is_file()
    res = CliRunner().invoke(convert_main, [str(source), "-o", str(tmp_path / "b"), *common, "--low-memory",
                                            "--calibration-data", "self"])
    assert res.exit_code == 1 and res.output.count("\n") == 1 and "with --low-memory pass calibration text" in \
        res.output, res.output
    assert not (tmp_path / "b").exists()


def test_heal_data_is_one_text_source_or_the_sources_joined(tmp_path):
    assert heal_data("default", None, tmp_path / "h.txt") == "default"
    assert heal_data(["x.txt"], None, tmp_path / "h.txt") == "x.txt" and not (tmp_path / "h.txt").exists()
    samples = tmp_path / SAMPLES_FILE
    samples.write_text("sampled one\n\nsampled two\n\n", encoding="utf-8")
    joined = heal_data([str(DATA), "self"], samples, tmp_path / "h.txt")
    assert joined == str(tmp_path / "h.txt")
    assert (tmp_path / "h.txt").read_text() == load_text(str(DATA)).strip("\n") + "\n\nsampled one\n\nsampled two\n"
    with pytest.raises(ConversionError, match="text sampled for --calibration-data self"):
        heal_data([str(DATA), "self"], tmp_path / "missing.txt", tmp_path / "h2.txt")


def test_a_heal_after_a_blended_calibration_trains_on_the_sources_joined(source, tmp_path):
    import yaml

    out = tmp_path / "out"
    report = convert(str(source), str(out), options_from(calibration_data=(str(DATA), "self"), heal_tokens=256,
                                                           **OPTS))
    recipe = yaml.safe_load((out / "heal" / "recipe.yaml").read_text())
    assert Path(recipe["data"]["train"]).name == "heal-data.txt" and report["heal"]["tokens"] == 256
    assert recipe["train"]["precision"] == "auto"  # resolved by the trainer: bf16 where it is fast
    summary = json.loads((out / "heal" / "run_summary.json").read_text())
    assert summary["precision"] == ("bf16" if bf16_is_fast("cpu") else "fp32")
    assert (out / SAMPLES_FILE).is_file() and not list(tmp_path.glob(".out.tmp-*"))
