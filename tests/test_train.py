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
from safetensors.torch import load_file

import tlm_train.data as data_module
from tlm_io.load import byte_tokenizer
from tlm_train.data import BatchOrder, tokenize_cached
from tlm_train.recipe import RecipeError, load_recipe, recipe_from_dict
from tlm_train.trainer import (TrainError, distill_loss, hidden_loss, list_checkpoints, load_pretrained, lr_factor,
                                 train)

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
    from tlm_study.compare import load_compare

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


def test_lr_wsd_is_flat_until_the_last_fraction_then_decays():
    r = recipe_from_dict(tiny_recipe(tmp_path_dummy(), optim={"lr": 1.0, "min_lr": 0.1, "warmup_steps": 2,
                                                              "decay": "wsd", "decay_fraction": 0.25},
                                     train={"max_steps": 12}))
    f = [lr_factor(s, r) for s in range(12)]
    assert f[:2] == [0.5, 1.0] and f[2:9] == [1.0] * 7  # decay from step 12 - 3 = 9
    assert f[9] == 1.0 and f[10] == pytest.approx(0.1 + 0.9 * 0.75) and f[11] == pytest.approx(0.1 + 0.9 * 0.25)
    longer = recipe_from_dict(tiny_recipe(tmp_path_dummy(), optim={**r.optim.__dict__, "betas": [0.9, 0.95]},
                                          train={"max_steps": 40}))
    assert [lr_factor(s, longer) for s in range(9)] == f[:9]  # the first steps do not depend on the length
    offset = recipe_from_dict(tiny_recipe(tmp_path_dummy(), optim={**r.optim.__dict__, "step_offset": 5,
                                                                   "rewarm_steps": 2}, train={"max_steps": 7}))
    assert [lr_factor(s, offset) for s in range(7)] == [f[5] / 2, f[6]] + f[7:]  # step 5 on, after a re-warm
    with pytest.raises(RecipeError, match="optim.schedule_steps: 5 is shorter than the run"):
        recipe_from_dict(tiny_recipe(tmp_path_dummy(), optim={"schedule_steps": 5}, train={"max_steps": 6}))
    with pytest.raises(RecipeError, match="optim.decay_fraction: must be in"):
        recipe_from_dict(tiny_recipe(tmp_path_dummy(), optim={"decay_fraction": 1.5}))


def tmp_path_dummy() -> Path:
    return Path("/nonexistent-run")  # recipes only: nothing is written


def test_wsd_prefix_resumed_to_a_longer_schedule_is_the_uninterrupted_run(tmp_path):
    wsd = {"decay": "wsd", "decay_fraction": 0.5, "warmup_steps": 1}
    full = train(recipe_from_dict(tiny_recipe(tmp_path, "full", optim=wsd, train={"max_steps": 6})))
    # 3 steps of a 4-step wsd schedule (its decay starts at step 4 - 2 = 2 < 3: not shared) would differ; of a
    # 6-step one (decay from 3) it is the shared prefix, resumable to the longer schedule
    prefix = train(recipe_from_dict(tiny_recipe(tmp_path, "prefix", optim={**wsd, "schedule_steps": 6},
                                                train={"max_steps": 3})))
    assert prefix.losses == full.losses[:3]
    resumed = train(recipe_from_dict(tiny_recipe(tmp_path, "rest", optim=wsd, train={"max_steps": 6})),
                    resume=str(Path(prefix.output_dir) / "checkpoint-3"))
    assert resumed.losses == full.losses[3:] and resumed.eval_loss == full.eval_loss


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


def test_modules_in_memory_train_as_the_checkpoints_they_were_read_from(tmp_path):
    """train(recipe, model, teacher) starts from the modules it is given, not from init_from / distill.teacher: the
    same losses and weights as the run that reads those checkpoints. The caller takes the module back (trained in
    place, its flags as given), so no final/ is written, and no checkpoint beyond what log.save_every asks for."""
    base = train(recipe_from_dict(tiny_recipe(tmp_path, "base", train={"max_steps": 2})))
    teacher_run = train(recipe_from_dict(tiny_recipe(tmp_path, "teacher", seed=5, train={"max_steps": 3})))
    teacher_dir = str(teacher_run.final_dir)

    def recipe(name, save_every=100):
        spec = tiny_recipe(tmp_path, name, train={"max_steps": 4, "trainable": ["model.layers.*"]},
                           distill={"teacher": teacher_dir, "alpha": 0.5}, log={"save_every": save_every})
        del spec["model"]
        spec["init_from"] = str(base.final_dir)
        return recipe_from_dict(spec)  # tokenizer: byte

    from_disk = train(recipe("disk"))
    student, _ = load_pretrained(str(base.final_dir), with_tokenizer=False)
    teacher, _ = load_pretrained(teacher_dir, with_tokenizer=False)
    student.config.use_cache = True  # final/ was written by a run (use_cache off); the trainer gives it back as given
    memory = recipe("memory")
    memory.tokenizer = None  # init_from's tokenizer files (byte, saved in final/) read the data
    in_memory = train(memory, student, teacher)
    assert in_memory.model is student and in_memory.losses == from_disk.losses
    trained = student.state_dict()
    for name, tensor in load_file(str(Path(from_disk.final_dir) / "model.safetensors")).items():
        assert torch.equal(trained[name], tensor), name
    assert in_memory.final_dir is None and not (tmp_path / "memory" / "final").exists()
    assert list_checkpoints(tmp_path / "memory") == [] and len(list_checkpoints(tmp_path / "disk")) == 1
    assert not student.training and student.config.use_cache and all(p.requires_grad for p in student.parameters())
    saved = train(recipe("every2", save_every=2), student, teacher)  # 4 steps: checkpoints 2 and 4
    assert [p.name for p in list_checkpoints(saved.output_dir)] == ["checkpoint-2", "checkpoint-4"]
    with pytest.raises(TrainError, match="no distill: section"):
        train(recipe_from_dict(tiny_recipe(tmp_path, "plain")), student, teacher)


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


def test_cli_resume_continues(tmp_path):
    import yaml

    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(tiny_recipe(tmp_path, train={"max_steps": 2})))
    assert _cli(["train", str(path), "--no-progress"]).exit_code == 0
    res = _cli(["train", str(path), "--set", "train.max_steps=4", "--resume", "--no-progress"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output.strip().splitlines()[-1])["steps"] == 4
    again = _cli(["train", str(path), "--no-progress"])  # checkpoints exist and no --resume: refused
    assert again.exit_code != 0 and "pass --resume" in again.output and "Traceback" not in again.output

# ---------------------------------------------------------------------------------------------- grown neurons


def _grown_pair(seed=0):
    """(teacher: uniform width 40, student: widths 60/40/20, whose layer 0 has 20 neurons past the teacher's)."""
    from conftest import tiny_config

    from tlm import TLMForCausalLM

    torch.manual_seed(seed)
    vocab = len(byte_tokenizer())
    teacher = TLMForCausalLM(tiny_config(intermediate_size=40, vocab_size=vocab)).eval()
    student = TLMForCausalLM(tiny_config(intermediate_size=40, intermediate_sizes=[60, 40, 20], vocab_size=vocab))
    return teacher, student


def test_grown_neurons_learn_at_their_scaled_rate_with_the_same_moments():
    """One AdamW step with scale_updates(5) moves the neurons past the teacher's width 5x as far as the plain step
    does, and leaves every other entry where the plain step puts it."""
    from tlm_train.build import grown_neurons, scale_updates

    teacher, student = _grown_pair()
    slices = grown_neurons(student, teacher.config.intermediate_sizes)
    assert [(tuple(p.shape), dim, start) for p, dim, start in slices] == [((60, 32), 0, 40), ((60, 32), 0, 40),
                                                                          ((32, 60), 1, 40)]
    ids = torch.randint(0, 99, (2, 12), generator=torch.Generator().manual_seed(1))
    start = {k: v.clone() for k, v in student.state_dict().items()}
    after = {}
    for scale in (1.0, 5.0):
        student.load_state_dict(start)
        student.zero_grad(set_to_none=True)
        optimizer = torch.optim.AdamW(student.parameters(), lr=1e-2, weight_decay=0.1)
        if scale != 1:
            scale_updates(optimizer, grown_neurons(student, teacher.config.intermediate_sizes), scale)
        student(ids, labels=ids).loss.backward()
        optimizer.step()
        after[scale] = {k: v.clone() for k, v in student.state_dict().items()}
    mlp = "model.layers.0.mlp."
    for name, key in [("gate", mlp + "gate_proj.weight"), ("up", mlp + "up_proj.weight")]:
        plain, scaled, old = after[1.0][key], after[5.0][key], start[key]
        assert torch.allclose(scaled[40:], old[40:] + 5 * (plain[40:] - old[40:]), atol=1e-7), name
        assert torch.equal(scaled[:40], plain[:40]) and not torch.equal(scaled[40:], plain[40:]), name
    down = mlp + "down_proj.weight"
    assert torch.allclose(after[5.0][down][:, 40:], start[down][:, 40:] + 5 * (after[1.0][down][:, 40:] -
                                                                              start[down][:, 40:]), atol=1e-7)
    assert torch.equal(after[5.0][down][:, :40], after[1.0][down][:, :40])
    others = [k for k in start if not k.startswith(mlp)]
    assert all(torch.equal(after[5.0][k], after[1.0][k]) for k in others)


def test_a_relative_rate_is_lr_times_the_weights_rms_and_a_resume_keeps_it(tmp_path):
    """optim.lr_relative: the rate is lr x the RMS of the starting model's trainable matrices; the run equals the run
    at that absolute rate step for step, and a resumed run goes on at the start's rate (its weights have moved, so an
    RMS read again would differ)."""
    import shutil

    from tlm_train.build import student_and_tokenizer
    from tlm_train.checkpoints import seed_everything

    relative = {"decay": "constant", "lr": 0.05, "min_lr": 0.05, "lr_relative": True}
    rel = recipe_from_dict(tiny_recipe(tmp_path, "rel", optim=relative))
    seed_everything(rel.seed)
    start, _ = student_and_tokenizer(rel)  # the model the run builds from the recipe's seed
    entries = torch.cat([p.detach().flatten() for p in start.parameters() if p.dim() >= 2])
    rate = 0.05 * entries.pow(2).mean().sqrt().item()
    full = train(rel)
    logged = [m["lr"] for m in metrics(rel.output_dir) if "lr" in m]
    assert logged[0] == pytest.approx(rate / 2, rel=1e-5) and logged[-1] == pytest.approx(rate, rel=1e-5)  # warmup 2
    absolute = recipe_from_dict(tiny_recipe(tmp_path, "abs", optim={"decay": "constant", "lr": logged[-1],
                                                                    "min_lr": logged[-1]}))
    assert train(absolute).losses == full.losses
    half = recipe_from_dict(tiny_recipe(tmp_path, "half", optim=relative))
    train(half)
    shutil.rmtree(Path(half.output_dir) / "checkpoint-6")
    shutil.rmtree(Path(half.output_dir) / "final")
    assert train(half, resume=True).losses == full.losses[3:]
    with pytest.raises(RecipeError, match="optim.lr_relative: not under train.parallel fsdp"):
        recipe_from_dict(tiny_recipe(tmp_path, optim={"lr_relative": True}, train={"parallel": "fsdp"}))


def test_a_heal_with_grown_lr_scale_runs_and_its_recipe_is_checked(tmp_path):
    teacher, student = _grown_pair()
    recipe = tiny_recipe(tmp_path, "grown", distill={"teacher": "in memory", "alpha": 1.0},
                         optim={"grown_lr_scale": 10.0, "warmup_steps": 0}, train={"max_steps": 2})
    del recipe["model"]
    recipe["init_from"] = "in memory"
    before = student.model.layers[0].mlp.down_proj.weight[:, 40:].norm().item()
    result = train(recipe_from_dict(recipe), student, teacher, tokenizer=byte_tokenizer())
    assert result.steps == 2 and all(math.isfinite(x) for x in result.losses)
    assert student.model.layers[0].mlp.down_proj.weight[:, 40:].norm().item() != before
    for change, words in [({"optim": {"grown_lr_scale": 0}}, "optim.grown_lr_scale: must be > 0"),
                          ({"optim": {"grown_lr_scale": 3}}, "add a distill: section"),
                          ({"optim": {"grown_lr_scale": 3}, "distill": {"teacher": "t"}, "train": {"parallel": "fsdp"}},
                           "not under train.parallel fsdp")]:
        with pytest.raises(RecipeError, match=words):
            recipe_from_dict(tiny_recipe(tmp_path, **change))


def test_train_compile_compiles_each_decoder_layer_and_takes_the_eager_steps(tmp_path, monkeypatch):
    """train.compile: every decoder layer of the tapered tiny model compiled in place (dynamo, with the eager backend
    here: no code generation), the same losses as the eager run, the same state_dict keys, and the returned model
    runs eagerly again."""
    from torch._dynamo.utils import counters

    import tlm_train.build as build_module

    compiled = []
    original = build_module.compile_layers

    def eager_backend(model):
        original(model, backend="eager")
        compiled.extend(layer._compiled_call_impl is not None for layer in model.model.layers)

    monkeypatch.setattr(build_module, "compile_layers", eager_backend)
    torch._dynamo.reset()
    counters.clear()
    plain = train(recipe_from_dict(tiny_recipe(tmp_path, "plain", train={"max_steps": 3})))
    fast = train(recipe_from_dict(tiny_recipe(tmp_path, "compiled", train={"max_steps": 3, "compile": True})))
    assert compiled == [True] * 3
    # training: the first width, then every other one as one dynamic size; the evaluation (eval mode) once more
    assert counters["stats"]["unique_graphs"] == 3
    widths = fast.model.config.intermediate_sizes
    assert widths[0] > widths[-1]  # three widths: the layers do not all share one shape
    assert fast.losses == pytest.approx(plain.losses, rel=1e-5)
    assert list(fast.model.state_dict()) == list(plain.model.state_dict())
    assert all(layer._compiled_call_impl is None for layer in fast.model.model.layers)
