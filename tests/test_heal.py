"""``tlm-convert --heal-tokens``: logit distillation from the source right after conversion (tlm_convert.heal)."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file
from tiny_sources import DATA, make_source, tiny_tokenizer

from tlm_cli.convert import convert_main
from tlm_convert import heal as heal_module
from tlm_convert.convert import convert, stage_ratio
from tlm_convert.options import Ratio, options_from
from tlm_io.load import load_model
from tlm_io.text import token_blocks
from tlm_train.build import select_trainable, weight_rms
from tlm_train.trainer import distill_loss, train

ROOT = Path(__file__).resolve().parents[1]
# a lossy conversion of the tiny source (no refit, a steep taper), so that distillation has something to recover
FAST = ["--calibration-data", str(DATA), "--calibration-tokens", "256", "--seq-len", "64", "--batch-size", "4",
        "--set", "multiple_of=1", "--set", "importance=activation", "--set", "refit=false", "--ratio", "1.8/0.2"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(ROOT),
       "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """The tiny llama source with its embeddings and MLPs scaled up 8x: peaked next-token distributions, which the
    lossy conversion of FAST changes (KL about 0.7 per position; a random tiny model's are near uniform)."""
    from transformers import AutoModelForCausalLM

    folder = make_source(tmp_path_factory.mktemp("heal") / "llama", "llama", tokenizer=tiny_tokenizer())
    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".mlp." in name or "embed_tokens" in name:
                p.mul_(8)
    model.save_pretrained(folder)
    return folder


@pytest.fixture()
def fast_lr(monkeypatch):
    """A learning rate that moves a tiny random model visibly in a few steps (the default suits SmolLM2): relative
    as the recipe's, about 3e-3 for weights of RMS 0.02."""
    recipe = copy.deepcopy(heal_module.HEAL_RECIPE)
    assert recipe["optim"]["lr_relative"]
    recipe["optim"].update(lr=0.15, min_lr=0.15, warmup_steps=1)
    monkeypatch.setattr(heal_module, "HEAL_RECIPE", recipe)


def _convert(args):
    return CliRunner().invoke(convert_main, [str(a) for a in args])


def _digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def _kd(student_dir: Path, teacher_dir: Path) -> float:
    """KL(source || model) per position on the first 8 blocks of the calibration text."""
    teacher, tokenizer, _ = load_model(str(teacher_dir))
    student, _, _ = load_model(str(student_dir), with_tokenizer=False)
    blocks = token_blocks(tokenizer, DATA.read_text(), 64, 512, spread=False)
    with torch.no_grad():
        return float(distill_loss(student(input_ids=blocks).logits, teacher(input_ids=blocks).logits, 1.0))


def test_heal_lowers_the_distillation_loss_and_reports_three_perplexities(source, tmp_path, fast_lr):
    plain, healed = tmp_path / "plain", tmp_path / "healed"
    assert _convert([source, "-o", plain, *FAST]).exit_code == 0
    res = _convert([source, "-o", healed, *FAST, "--heal-tokens", 4096, "--eval-data", DATA,
                    "--eval-data", "default-eval", "--eval-tokens", 512])
    assert res.exit_code == 0, res.output
    assert _kd(healed, source) < 0.8 * _kd(plain, source)

    report = json.loads((healed / "conversion_report.json").read_text())
    assert report["heal"]["tokens"] == 4096 and report["heal"]["steps"] == 16  # 4 x 64 tokens a step
    for s in report["perplexity_sets"]:
        assert {"before", "after", "healed", "healed_ratio"} <= set(s)
        assert s["healed_ratio"] == pytest.approx(s["healed"] / s["before"])
    assert "perplexity_ratio_ood_geomean_healed" in report
    healed_lines = [ln for ln in res.output.splitlines() if "healed" in ln and ln.startswith("perplexity on")]
    assert len(healed_lines) == 2, res.output
    assert "after healing (4,096 tokens" in (healed / "report.md").read_text()
    converted, _, _ = load_model(str(plain), with_tokenizer=False)  # the model the heal started from
    select_trainable(converted, heal_module.HEAL_RECIPE["train"]["trainable"])
    assert report["heal"]["lr"] == pytest.approx(0.15 * weight_rms(converted), rel=1e-5)
    assert f"lr {report['heal']['lr']:.3g} = 0.15 x the weights' RMS" in (healed / "report.md").read_text()
    # the heal's log is kept, its checkpoints and work folder are not
    assert sorted(p.name for p in (healed / "heal").iterdir()) == ["metrics.jsonl", "recipe.yaml",
                                                                   "run_summary.json"]
    assert not list(healed.rglob("checkpoint-*")) and not list(tmp_path.glob(".*tmp*"))
    metrics = [json.loads(ln) for ln in (healed / "heal" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["step"] == 16
    # the healed model loads and is not the plain conversion
    assert _digest(plain)["model.safetensors"] != _digest(healed)["model.safetensors"]


def test_zero_heal_tokens_is_exactly_the_plain_conversion(source, tmp_path):
    a = convert(str(source), str(tmp_path / "a"), options_from(**_options()))
    b = convert(str(source), str(tmp_path / "b"), options_from(**_options(), heal_tokens=0))
    da, db = _digest(tmp_path / "a"), _digest(tmp_path / "b")
    assert da.pop("conversion_report.json") and db.pop("conversion_report.json")
    da.pop("report.md"), db.pop("report.md")  # they differ in the seconds only
    assert da == db and "heal" not in a and "heal" not in b
    assert not (tmp_path / "b" / "heal").exists()


def test_the_heal_in_memory_trains_what_the_heal_through_the_disk_trained(source, tmp_path, fast_lr):
    """The heal hands the converted model and the source to the trainer in memory. Heals used to cross the disk:
    the conversion written out, tlm train from it (init_from) with the source as distill.teacher, final/ read back.
    That path trains the same tensors (max |diff| 0): both start from the same fp32 weights and buffers and see the
    same batches, and nothing the trainer computes depends on where a module came from."""
    plain, healed = tmp_path / "plain", tmp_path / "healed"
    convert(str(source), str(plain), options_from(**_options()))
    convert(str(source), str(healed), options_from(**_options(), heal_tokens=1024))
    recipe = heal_module.heal_recipe(str(plain), str(source), str(DATA), 1024, str(tmp_path / "disk"), 64,
                                     cache_dir=str(tmp_path / "tokens"))
    through_disk = load_file(Path(train(recipe).final_dir) / "model.safetensors")
    in_memory, start = load_file(healed / "model.safetensors"), load_file(plain / "model.safetensors")
    assert in_memory.keys() == through_disk.keys() == start.keys()
    assert max(float((in_memory[k] - through_disk[k]).abs().max()) for k in start) == 0.0
    assert any(not torch.equal(in_memory[k], start[k]) for k in start)  # the heal moved the weights
    # the trainer's run folder is the log OUT keeps: no checkpoint, no final/ (the module came back in memory)
    assert sorted(p.name for p in (healed / "heal").iterdir()) == ["metrics.jsonl", "recipe.yaml",
                                                                   "run_summary.json"]


def test_a_healed_conversion_is_written_as_the_plain_one_is(source, tmp_path):
    """The heal changes the weights only: the healed model is written in --dtype with the plain conversion's
    config (the trainer's training-time settings, such as use_cache off, stay out of it)."""
    for name, tokens in (("plain", 0), ("healed", 256)):
        convert(str(source), str(tmp_path / name), options_from(**_options(), dtype="bfloat16", heal_tokens=tokens))
    configs = [json.loads((tmp_path / name / "config.json").read_text()) for name in ("plain", "healed")]
    assert configs[0] == configs[1] and configs[1]["use_cache"] is True
    weights = load_file(tmp_path / "healed" / "model.safetensors")
    assert {w.dtype for w in weights.values()} == {torch.bfloat16}


def _options() -> dict:
    return dict(calibration_data=str(DATA), calibration_tokens=256, seq_len=64, batch_size=4, multiple_of=1,
                importance="activation", refit=False, ratio="1.8/0.2")


@pytest.mark.parametrize("args, words", [
    (["--heal-tokens", "-5"], "must be 0 (no heal) or a positive"),
    (["--heal-tokens", "100"], "less than one training step (256 tokens"),
    (["--heal-tokens", "1024", "--low-memory"], "drop --low-memory"),
    (["--set", "taper_stages=0"], "taper_stages=0: must be an integer >= 1"),
    (["--set", "taper_stages=3", "--heal-tokens", "512"], "pass --heal-tokens 768 or more"),
    (["--set", "taper_stages=2", "--heal-tokens", "1024", "--schedule", "measured-taper"], "measures its widths"),
])
def test_bad_heal_values_are_one_line(source, tmp_path, args, words):
    res = _convert([source, "-o", tmp_path / "out", *FAST, *args])
    assert res.exit_code not in (0, None)
    errors = [ln for ln in res.output.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and words in errors[0] and "Traceback" not in res.output, res.output
    assert not (tmp_path / "out").exists() and not list(tmp_path.iterdir())


def test_stage_ratios_move_every_multiplier_from_one():
    ratios = [str(stage_ratio(Ratio.parse("1.5/0.5"), k, 3)) for k in (1, 2, 3)]
    assert ratios == ["1.1666666666666667/0.8333333333333334", "1.3333333333333333/0.6666666666666667", "1.5/0.5"]
    assert str(stage_ratio(Ratio.parse("1.5/1/0.5"), 1, 2)) == "1.25/1/0.75"


def test_a_staged_conversion_ends_at_the_one_shot_widths_healed_from_the_source(source, tmp_path):
    once, staged = tmp_path / "once", tmp_path / "staged"
    evals = ["--eval-data", DATA, "--eval-tokens", 512]
    assert _convert([source, "-o", once, *FAST, *evals]).exit_code == 0
    res = _convert([source, "-o", staged, *FAST, *evals, "--set", "taper_stages=2", "--heal-tokens", 1024])
    assert res.exit_code == 0, res.output
    a, b = (json.loads((f / "conversion_report.json").read_text()) for f in (once, staged))
    assert b["widths_after"] == a["widths_after"] and b["params_after"] == a["params_after"] == a["params_before"]
    assert b["source"] == a["source"] == str(source) and b["widths_before"] == a["widths_before"]
    assert [(s["stage"], s["ratio"], s["heal_tokens"]) for s in b["taper_stages"]] == [(1, "1.4/0.6", 512),
                                                                                      (2, "1.8/0.2", 512)]
    assert b["taper_stages"][0]["widths_after"] not in (a["widths_before"], a["widths_after"])  # halfway
    assert b["heal"]["tokens"] == 512 and b["options"]["method"]["taper_stages"] == 2
    assert b["options"]["heal_tokens"] == 1024
    before = [s["before"] for s in a["perplexity_sets"]]
    assert [s["before"] for s in b["perplexity_sets"]] == before  # evaluated against the source, not stage 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["once", "staged"]  # the stages' folder is gone
    assert "taper stages: 2, ratios 1.4/0.6, 1.8/0.2, 512 heal tokens after each" in res.output
    healed = b["perplexity_sets"][0]  # the held-out figure, not the training loss of two batches
    assert re.search(rf"^heal: 512 tokens of distillation from the source in .*; perplexity on {re.escape(str(DATA))} "
                     rf"{healed['after']:.3f} converted -> {healed['healed']:.3f} healed$", res.output, re.M), res.output
    assert "heal: 100%" in res.output.replace("\r", "\n")  # the heal's bar says what it is
    assert "reached in 2 stages (--set taper_stages)" in (staged / "report.md").read_text()
    load_model(str(staged), with_tokenizer=False)


def _heal_process(source: Path, out: Path, extra=()) -> subprocess.Popen:
    args = [sys.executable, "-m", "tlm_convert", str(source), "-o", str(out), *FAST, "--heal-tokens", "100000000",
            "--max-hours", "0", *extra]  # a long heal on purpose: the test stops it
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)


def _wait_for_training(parent: Path, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 180
    while proc.poll() is None and time.monotonic() < deadline:
        if any(m.read_text().strip() for m in parent.glob(".*tmp*/heal-work/train/metrics.jsonl")):
            return
        time.sleep(0.05)
    raise AssertionError(f"the heal did not start: {proc.communicate()}")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_an_interrupted_heal_leaves_the_output_untouched(source, tmp_path, sig):
    """A kill during the heal (real signals to a real tlm-convert) leaves the previous OUTPUT as it was; SIGTERM
    stops the training at a step boundary and exits 143 with no temporary folder left; after SIGKILL the next run
    into OUTPUT removes what the dead one left."""
    out = tmp_path / "out"
    assert _convert([source, "-o", out, *FAST]).exit_code == 0
    before = _digest(out)
    proc = _heal_process(source, out, ["--overwrite"])
    _wait_for_training(tmp_path, proc)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=120)
    assert _digest(out) == before
    if sig == signal.SIGTERM:
        assert proc.returncode == 143 and "error: stopped by SIGTERM during the heal" in stderr, stdout + stderr
        assert not list(tmp_path.glob(".*tmp*"))
    else:
        assert list(tmp_path.glob(".*tmp*"))  # the dead run's folder, removed by the next run
        assert _convert([source, "-o", out, *FAST, "--overwrite"]).exit_code == 0
        assert not list(tmp_path.glob(".*tmp*"))


def test_heal_steps_count_the_batch_the_overrides_set():
    """N heal tokens are N / (batch x accumulation x seq_len) steps, rounded up, with the batch after overrides."""
    assert heal_module.heal_recipe("s", "t", "default", 3000, "out", 64).train.max_steps == 12  # 4 x 64 a step
    assert heal_module.heal_recipe("s", "t", "default", 3000, "out", 64,
                                   overrides=("train.batch_size=4", "train.grad_accum=3")).train.max_steps == 4


def test_trainable_patterns_freeze_the_rest(source, tmp_path):
    from tlm_train.recipe import RecipeError
    from tlm_train.trainer import select_trainable

    model, _, _ = load_model(str(source), with_tokenizer=False)
    n = select_trainable(model, ["*.mlp.*"])
    mlp = [p for name, p in model.named_parameters() if ".mlp." in name]
    assert n == sum(p.numel() for p in mlp) and all(p.requires_grad for p in mlp)
    assert not any(p.requires_grad for name, p in model.named_parameters() if ".mlp." not in name)
    with pytest.raises(RecipeError, match="no parameter name matches"):
        select_trainable(model, ["nothing.*"])
