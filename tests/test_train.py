"""tlm train: recipes, data order, LR schedule, resume == uninterrupted, DDP/FSDP (2 gloo processes) == one
process, grad accumulation, distillation, stop/resume, the final model, one-line CLI errors."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import tlm_train.data as data_module
from tlm_io.load import byte_tokenizer
from tlm_train.data import BatchOrder, tokenize_cached
from tlm_train.recipe import RecipeError, load_recipe, recipe_from_dict
from tlm_train.trainer import TrainError, distill_loss, hidden_loss, list_checkpoints, lr_factor, train

DATA = Path(__file__).parent / "data" / "shakespeare_slice.txt"
ROOT = Path(__file__).parent.parent


def tiny_recipe(tmp_path, name="run", **sections) -> dict:
    recipe = {
        "output_dir": str(tmp_path / name),
        "tokenizer": "byte",
        "seed": 3,
        "model": {"schedule": "cosine", "ratio": "1.5/0.5",
                  "config": {"hidden_size": 24, "num_hidden_layers": 3, "num_attention_heads": 4,
                             "num_key_value_heads": 2, "intermediate_size": 40, "max_position_embeddings": 64}},
        "data": {"train": str(DATA), "seq_len": 33, "eval_tokens": 660, "cache_dir": str(tmp_path / "cache")},
        "optim": {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 2},
        "train": {"max_steps": 6, "batch_size": 4, "num_threads": 1},
        "log": {"every": 1, "eval_every": 3, "save_every": 3, "keep_last": 5, "progress": False,
                "tensorboard": False},
    }
    for key, value in sections.items():
        recipe[key] = {**recipe.get(key, {}), **value} if isinstance(value, dict) else value
    return recipe


def metrics(folder) -> list[dict]:
    return [json.loads(line) for line in (Path(folder) / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------------------------------------- recipes


def test_recipe_reports_every_problem_with_its_key_path(tmp_path):
    bad = tiny_recipe(tmp_path, optim={"lr": "fast", "betas": [0.9]}, train={"max_steps": 2.5, "precision": "fp8"},
                      extra=1)
    bad["data"]["sequence_length"] = 3
    with pytest.raises(RecipeError) as err:
        recipe_from_dict(bad)
    text = str(err.value)
    for needle in ("extra: unknown key", "data.sequence_length: unknown key", "optim.lr: expected a number",
                   "train.max_steps: expected an integer", "train.precision: expected one of fp32, bf16, auto"):
        assert needle in text, text
    assert "5 problem(s)" in text


def test_recipe_semantics_and_overrides(tmp_path):
    with pytest.raises(RecipeError, match="give exactly one"):
        recipe_from_dict({"output_dir": "x", "tokenizer": "byte"})
    with pytest.raises(RecipeError, match="optim.min_lr"):
        recipe_from_dict(tiny_recipe(tmp_path, optim={"min_lr": 1.0}))
    r = recipe_from_dict(tiny_recipe(tmp_path), ["optim.lr=1e-2", "train.max_steps=9", "distill.teacher=t"])
    assert (r.optim.lr, r.train.max_steps, r.distill.teacher, r.distill.alpha) == (1e-2, 9, "t", 0.5)
    with pytest.raises(RecipeError, match="key.path=value"):
        recipe_from_dict(tiny_recipe(tmp_path), ["optim.lr"])
    path = tmp_path / "r.yaml"
    path.write_text("output_dir: [unclosed\n")
    with pytest.raises(RecipeError, match="not valid YAML at line"):
        load_recipe(path)


def test_every_recipe_in_the_repo_validates():
    from tlm_convert.compare import load_compare

    files = sorted((ROOT / "recipes").rglob("*.yaml"))
    assert len(files) >= 10
    for file in files:
        if file.parent.name == "compare":
            load_compare(file)
            continue
        recipe = load_recipe(file)
        if recipe.model is not None:  # from-scratch configs must also build
            from tlm import TLMConfig

            TLMConfig(schedule=recipe.model.schedule, taper_ratio=recipe.model.ratio,
                      multiple_of=recipe.model.multiple_of, vocab_size=257, **recipe.model.config)


def test_generated_recipes_are_what_generate_py_writes():
    """recipes/generate.py's files are committed as it writes them: the scratch grid, and the heal recipe file from
    tlm_convert.heal.HEAL_RECIPE (the heal's one source; edit the dict, then run the script)."""
    spec = importlib.util.spec_from_file_location("generate_recipes", ROOT / "recipes" / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    files = generate.generated()
    assert ROOT / "recipes" / "cpt" / "smollm2-135m-heal.yaml" in files and len(files) == 17
    stale = [str(path.relative_to(ROOT)) for path, text in files.items() if path.read_text() != text]
    assert stale == [], "run python recipes/generate.py"
    heal = load_recipe(ROOT / "recipes" / "cpt" / "smollm2-135m-heal.yaml")
    assert heal.optim.lr == generate.HEAL_RECIPE["optim"]["lr"]
    assert heal.train.batch_size == generate.HEAL_RECIPE["train"]["batch_size"]


# ---------------------------------------------------------------------------------------------- data


def test_byte_tokenizer_round_trips_and_saves(tmp_path):
    tok = byte_tokenizer()
    text = "Hello wörld\n\t  x"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == list(text.encode()) and tok.decode(ids) == text and len(tok) == 257
    tok.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(tmp_path)(text, add_special_tokens=False)["input_ids"] == ids


def test_tokenized_data_is_cached(tmp_path, monkeypatch):
    tok = byte_tokenizer()
    first = tokenize_cached(tok, str(DATA), cache_dir=tmp_path)
    assert first.tolist() == list(DATA.read_bytes()) and len(list(tmp_path.glob("*/shard-*.bin"))) == 1

    def no_reading(*args):
        raise AssertionError("read and tokenized again")

    monkeypatch.setattr(data_module, "_documents", no_reading)
    assert torch.equal(tokenize_cached(tok, str(DATA), cache_dir=tmp_path), first)
    assert len(tokenize_cached(tok, str(DATA), max_tokens=100, cache_dir=tmp_path)) == 100  # a prefix of the cache


def test_documents_are_joined_with_eos_and_long_files_read_in_pieces(tmp_path, monkeypatch):
    tok = byte_tokenizer()
    rows = tmp_path / "docs.jsonl"
    rows.write_text('{"text": "ab"}\n{"text": "cd"}\n')
    assert tokenize_cached(tok, str(rows), cache_dir=tmp_path).tolist() == [97, 98, 256, 99, 100]
    monkeypatch.setattr(data_module, "_PIECE_CHARS", 50)  # a text file is one document, read in pieces
    ids = tokenize_cached(tok, str(DATA), max_tokens=1000, cache_dir=tmp_path / "pieces")
    assert ids.tolist() == list(DATA.read_bytes()[:1000])


def test_batch_order_splits_global_batches_across_ranks_and_epochs():
    blocks = torch.arange(10).view(10, 1)
    one = BatchOrder(blocks, batch_size=4, grad_accum=1, world=1, seed=0)
    two = [BatchOrder(blocks, batch_size=2, grad_accum=1, world=2, seed=0) for _ in range(2)]
    accum = BatchOrder(blocks, batch_size=2, grad_accum=2, world=1, seed=0)
    seen = []
    for step in range(5):  # 20 samples = 2 epochs
        whole = one.micro_batch(step, 0, 0).flatten().tolist()
        assert whole == two[0].micro_batch(step, 0, 0).flatten().tolist() + two[1].micro_batch(step, 0, 1).flatten().tolist()
        assert whole == accum.micro_batch(step, 0, 0).flatten().tolist() + accum.micro_batch(step, 1, 0).flatten().tolist()
        seen += whole
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:]) == list(range(10))
    assert seen[:10] != seen[10:]  # reshuffled per epoch


# ---------------------------------------------------------------------------------------------- schedule and losses


def test_lr_warmup_then_cosine_to_min(tmp_path):
    r = recipe_from_dict(tiny_recipe(tmp_path, optim={"lr": 1.0, "min_lr": 0.1, "warmup_steps": 4},
                                     train={"max_steps": 14}))
    f = [lr_factor(s, r) for s in range(15)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]
    assert f[4] == pytest.approx(1.0) and f[9] == pytest.approx(0.55) and f[14] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(f[4:], f[5:]))


def test_distill_loss_is_the_kl_divergence():
    gen = torch.Generator().manual_seed(0)
    s, t = torch.randn(2, 5, 7, generator=gen), torch.randn(2, 5, 7, generator=gen)
    assert distill_loss(s, s, 2.0).abs() < 1e-6
    p_t, log_p_s = torch.softmax(t[:, :-1] / 2, -1), torch.log_softmax(s[:, :-1] / 2, -1)
    manual = (p_t * (p_t.log() - log_p_s)).sum(-1).mean() * 4
    assert torch.allclose(distill_loss(s, t, 2.0), manual, atol=1e-6)


def test_hidden_loss_is_the_relative_residual_error_per_token():
    gen = torch.Generator().manual_seed(0)
    t = tuple(torch.randn(2, 5, 7, generator=gen) for _ in range(4))  # embeddings + 3 layers
    s = tuple(x + 0.1 * torch.randn(x.shape, generator=gen) for x in t)
    assert hidden_loss(t, t) == 0
    s0 = (t[0] + 100,) + s[1:]  # the embeddings (index 0) do not count
    manual = torch.stack([((a - b).square().sum(-1) / b.square().sum(-1)).mean() for a, b in zip(s[1:], t[1:])])
    assert torch.allclose(hidden_loss(s0, t), manual.mean(), rtol=1e-6)
    with pytest.raises(TrainError, match="teacher of the student's depth: 2 layers against 3"):
        hidden_loss(s, t[:3])


# ---------------------------------------------------------------------------------------------- runs


def test_train_from_scratch_writes_checkpoints_metrics_and_a_loadable_model(tmp_path):
    r = recipe_from_dict(tiny_recipe(tmp_path, log={"keep_last": 1}))
    result = train(r)
    out = Path(r.output_dir)
    assert result.steps == 6 and result.tokens == 6 * 4 * 33 and math.isfinite(result.eval_loss)
    assert result.losses[-1] < result.losses[0]
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-6"]  # keep_last
    lines = metrics(out)
    assert [m["step"] for m in lines if "loss" in m] == [1, 2, 3, 4, 5, 6]
    assert [m["step"] for m in lines if "eval_loss" in m] == [3, 6]
    assert lines[-1]["eval_loss"] == pytest.approx(result.eval_loss)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out / "final").eval()
    assert model.config.intermediate_sizes[0] > model.config.intermediate_sizes[-1]  # cosine taper
    assert sum(model.config.intermediate_sizes) == 3 * 40
    tok = AutoTokenizer.from_pretrained(out / "final")
    ids = torch.tensor([tok("To be", add_special_tokens=False)["input_ids"]])
    assert model.generate(ids, max_new_tokens=3, do_sample=False).shape == (1, 8)


def test_resume_continues_the_exact_loss_curve(tmp_path):
    full = train(recipe_from_dict(tiny_recipe(tmp_path, "full")))
    half = recipe_from_dict(tiny_recipe(tmp_path, "half"))
    first = train(half)
    # interrupt after step 3: drop the later checkpoint and the final model, then resume
    import shutil

    shutil.rmtree(Path(half.output_dir) / "checkpoint-6")
    shutil.rmtree(Path(half.output_dir) / "final")
    with pytest.raises(TrainError, match="already has checkpoints"):
        train(half)
    resumed = train(half, resume=True)
    assert resumed.losses == full.losses[3:] and first.losses == full.losses
    assert resumed.eval_loss == full.eval_loss
    strip = lambda rows: [{k: v for k, v in m.items() if k != "tokens_per_s"} for m in rows]  # noqa: E731
    assert strip(metrics(half.output_dir)) == strip(metrics(full.output_dir))


def test_stop_file_checkpoints_then_resume_finishes(tmp_path):
    full = train(recipe_from_dict(tiny_recipe(tmp_path, "full", log={"save_every": 100})))
    r = recipe_from_dict(tiny_recipe(tmp_path, "stop", log={"save_every": 100}))
    Path(r.output_dir).mkdir(parents=True)
    (Path(r.output_dir) / "STOP").touch()
    stopped = train(r)
    assert stopped.stopped and stopped.steps == 0 and stopped.final_dir is None
    (Path(r.output_dir) / "STOP").unlink()
    assert train(r, resume=True).losses == full.losses


def test_mismatched_checkpoint_is_refused(tmp_path):
    r = tiny_recipe(tmp_path, "a", train={"max_steps": 3})
    train(recipe_from_dict(r))
    r["model"]["config"]["intermediate_size"] = 48
    with pytest.raises(TrainError, match="model shapes differ"):
        train(recipe_from_dict(r), resume=True)
    r["model"]["config"]["intermediate_size"] = 40
    r["train"]["batch_size"] = 2
    with pytest.raises(TrainError, match="global_batch differ"):
        train(recipe_from_dict(r), resume=True)
    with pytest.raises(TrainError, match="not a checkpoint folder"):
        train(recipe_from_dict(r), resume=str(tmp_path))


def test_gradient_accumulation_matches_a_larger_batch(tmp_path):
    big = train(recipe_from_dict(tiny_recipe(tmp_path, "big")))
    acc = train(recipe_from_dict(tiny_recipe(tmp_path, "acc", train={"batch_size": 2, "grad_accum": 2})))
    assert acc.losses == pytest.approx(big.losses, abs=1e-5)


def test_bf16_autocasts_on_the_cpu_with_fp32_master_weights(tmp_path):
    fp32 = train(recipe_from_dict(tiny_recipe(tmp_path, "fp32", train={"max_steps": 3})))
    bf16 = train(recipe_from_dict(tiny_recipe(tmp_path, "bf16", train={"max_steps": 3, "precision": "bf16"})))
    # the same model, data and updates, with bf16 matrix products: close to the fp32 losses, not equal to them
    assert bf16.losses == pytest.approx(fp32.losses, rel=2e-2)
    assert bf16.losses != fp32.losses
    from safetensors.torch import load_file

    weights = load_file(str(Path(bf16.final_dir) / "model.safetensors"))
    assert {w.dtype for w in weights.values()} == {torch.float32}


def test_auto_precision_is_bf16_exactly_where_bf16_is_fast(tmp_path, monkeypatch):
    import tlm_train.trainer as trainer_module

    runs = {}
    for fast in (True, False):
        monkeypatch.setattr(trainer_module, "bf16_is_fast", lambda device, fast=fast: fast)
        runs[fast] = train(recipe_from_dict(tiny_recipe(tmp_path, f"auto{fast}",
                                                        train={"max_steps": 2, "precision": "auto"})))
    fixed = {p: train(recipe_from_dict(tiny_recipe(tmp_path, p, train={"max_steps": 2, "precision": p})))
             for p in ("bf16", "fp32")}
    assert runs[True].losses == fixed["bf16"].losses and runs[False].losses == fixed["fp32"].losses
    summary = json.loads((Path(runs[True].final_dir).parent / "run_summary.json").read_text())
    assert summary["precision"] == "bf16"


def test_continued_pretraining_with_distillation(tmp_path):
    base = train(recipe_from_dict(tiny_recipe(tmp_path, "base")))
    teacher = str(base.final_dir)
    cpt = tiny_recipe(tmp_path, "cpt", distill={"teacher": teacher, "alpha": 1.0}, optim={"lr": 1e-3})
    del cpt["model"], cpt["tokenizer"]
    cpt["init_from"] = teacher
    result = train(recipe_from_dict(cpt))
    # the student starts as the teacher: the pure KL loss starts at 0 and stays small
    assert result.losses[0] == pytest.approx(0.0, abs=1e-6)
    assert max(result.losses) < 0.05
    assert result.eval_loss == pytest.approx(base.eval_loss, abs=0.05)


def test_distillation_of_the_residual_streams_adds_to_the_first_loss(tmp_path):
    teacher = str(train(recipe_from_dict(tiny_recipe(tmp_path, "base", train={"max_steps": 2}))).final_dir)
    first = {}
    for weight in (0.0, 1.0):  # a fresh student (another seed) against the trained teacher, same data order
        run = tiny_recipe(tmp_path, f"hw{weight}", seed=4, train={"max_steps": 1},
                          distill={"teacher": teacher, "alpha": 1.0, "hidden_weight": weight})
        first[weight] = train(recipe_from_dict(run)).losses[0]
    assert first[1.0] > first[0.0] + 0.1  # a random student's residual streams are far from the teacher's
    narrow = tiny_recipe(tmp_path, "narrow", train={"max_steps": 1}, distill={"teacher": teacher, "hidden_weight": 1.0})
    narrow["model"]["config"] = {**narrow["model"]["config"], "num_hidden_layers": 2}
    with pytest.raises(TrainError, match=r"teacher of the student's depth and width: \(3, 24\) .* \(2, 24\)"):
        train(recipe_from_dict(narrow))
    with pytest.raises(RecipeError, match="distill.hidden_weight: must be >= 0"):
        recipe_from_dict(tiny_recipe(tmp_path, distill={"teacher": teacher, "hidden_weight": -1.0}))


def _torchrun(tmp_path, recipe: dict, nproc: int = 2) -> subprocess.CompletedProcess:
    import yaml

    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "-m", "tlm_train", "train", str(path), "--no-progress"]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_gloo_processes_match_one_process(tmp_path, parallel):
    single = train(recipe_from_dict(tiny_recipe(tmp_path, "single", train={"max_steps": 4})))
    proc = _torchrun(tmp_path, tiny_recipe(tmp_path, parallel, train={"max_steps": 4, "batch_size": 2,
                                                                     "parallel": parallel}))
    assert proc.returncode == 0, proc.stderr[-2000:]
    losses = [m["loss"] for m in metrics(tmp_path / parallel) if "loss" in m]
    assert losses == pytest.approx(single.losses, abs=1e-5)
    assert json.loads(proc.stdout.strip().splitlines()[-1])["eval_loss"] == pytest.approx(single.eval_loss, abs=1e-5)


# ---------------------------------------------------------------------------------------------- CLI


def _cli(args):
    from tlm_cli.main import tlm_main

    return CliRunner().invoke(tlm_main, args)


def test_cli_train_runs_a_recipe_with_overrides(tmp_path):
    import yaml

    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(tiny_recipe(tmp_path)))
    res = _cli(["train", str(path), "--set", "train.max_steps=2", "--no-progress"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output.strip().splitlines()[-1])["steps"] == 2


@pytest.mark.parametrize("content, needle", [
    (None, "does not exist"),
    ("output_dir: x\nmodel: {config: {}}\ntokenizer: byte\noptim: {lr: fast}\n", "optim.lr: expected a number"),
    ("output_dir: x\ninit_from: /no/such/model\n", "does not exist"),
])
def test_cli_train_bad_input_is_one_line(tmp_path, monkeypatch, content, needle):
    monkeypatch.chdir(tmp_path)  # output_dir: x is relative to the working directory
    path = tmp_path / "r.yaml"
    if content is not None:
        path.write_text(content)
    res = _cli(["train", str(path), "--no-progress"])
    assert res.exit_code != 0
    lines = [ln for ln in res.output.strip().splitlines() if ln]
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], res.output
    assert "Traceback" not in res.output


# ---------------------------------------------------------------------------------------------- compare


def test_compare_runs_the_four_arms_at_equal_params_and_tokens(tmp_path):
    from tlm_convert.compare import CompareSpec, RUN_NAMES, run_comparison

    base = tiny_recipe(tmp_path, "base", model={"schedule": "uniform"}, log={"eval_every": 2})
    spec = CompareSpec(base=base, output_dir=str(tmp_path / "cmp"), pretrain_steps=3, continue_steps=2,
                       convert={"calibration_tokens": 330, "batch_size": 4}, cpt_optim={"warmup_steps": 1})
    rows = run_comparison(spec, progress=False)
    assert [r["run"] for r in rows] == list(RUN_NAMES)
    assert len({r["params"] for r in rows}) == 1  # equal parameter counts
    assert len({r["tokens"] for r in rows}) == 1 and rows[0]["tokens"] == 5 * 4 * 33  # equal tokens
    assert all(math.isfinite(r["eval_loss"]) for r in rows)
    out = tmp_path / "cmp"
    assert (out / "loss_curves.png").stat().st_size > 1000 and (out / "compare.md").is_file()
    saved = json.loads((out / "compare.json").read_text())
    # (c) and (d) continue the data stream: they skip the N pretraining batches
    assert yaml_load(out / "converted-cpt" / "recipe.yaml")["data"]["skip_batches"] == 3
    widths = json.loads((out / "converted" / "config.json").read_text())["intermediate_sizes"]
    assert widths[0] > widths[-1]
    # the (d) control's curve starts with the shared pretraining prefix
    assert saved["curves"]["uniform-continued"]["train"][:3] == saved["curves"]["converted-cpt"]["train"][:3]
    # a second call collects the finished runs instead of training again
    again = run_comparison(spec, progress=False)
    assert [r["eval_loss"] for r in again] == [r["eval_loss"] for r in rows]
    assert [r["seconds"] for r in again] == pytest.approx([r["seconds"] for r in rows], abs=0.01)  # from summaries


def yaml_load(path):
    import yaml

    return yaml.safe_load(Path(path).read_text())


def test_compare_spec_errors_are_listed(tmp_path):
    from tlm_convert.compare import load_compare

    path = tmp_path / "c.yaml"
    path.write_text("base: missing.yaml\noutput_dir: x\npretrain_steps: two\n")
    with pytest.raises(RecipeError) as err:
        load_compare(path)
    text = str(err.value)
    assert "pretrain_steps: expected an integer" in text and "continue_steps: missing" in text


def test_cli_resume_continues_and_a_bad_compare_file_is_one_line(tmp_path):
    import yaml

    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(tiny_recipe(tmp_path, train={"max_steps": 2})))
    assert _cli(["train", str(path), "--no-progress"]).exit_code == 0
    res = _cli(["train", str(path), "--set", "train.max_steps=4", "--resume", "--no-progress"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output.strip().splitlines()[-1])["steps"] == 4
    again = _cli(["train", str(path), "--no-progress"])  # checkpoints exist and no --resume: refused
    assert again.exit_code != 0 and "pass --resume" in again.output and "Traceback" not in again.output
    bad = tmp_path / "c.yaml"
    bad.write_text("base: nope.yaml\noutput_dir: x\npretrain_steps: 1\ncontinue_steps: 1\n")
    res = _cli(["compare", str(bad), "--no-progress"])
    lines = res.output.strip().splitlines()
    assert res.exit_code != 0 and len(lines) == 1 and lines[0].startswith("error:") and "does not exist" in lines[0]
