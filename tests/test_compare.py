"""tlm compare: seeds, splits and shapes in one study, every run in its own folder, finished runs collected, the
paired table from known numbers, the learning-rate plan ((c) and (d) see the same rates from step N, the N-step run
shared by every split), spec errors listed, one-line CLI errors."""

import json
import math
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

import tlm_study.compare as compare_module
from tlm_study.compare import (CompareSpec, format_tables, paired, parse_seeds, parse_split, prefix_schedule_steps,
                                 run_comparison, run_recipes, select, summarize)
from tlm_train.recipe import RecipeError, recipe_from_dict
from tlm_train.trainer import lr_factor

from test_train import metrics, tiny_recipe


def tiny_base(tmp_path) -> dict:
    """test_train's tiny recipe: a uniform model, checkpoints only at the end, an evaluation every 2 steps."""
    return tiny_recipe(tmp_path, "base", seed=0, model={"schedule": "uniform", "multiple_of": 1},
                       log={"eval_every": 2, "save_every": 100, "keep_last": 1})


# ---------------------------------------------------------------------------------------------- parsing


def test_seeds_and_splits_parse():
    assert parse_seeds("0-4") == [0, 1, 2, 3, 4]
    assert parse_seeds("0,2,7") == [0, 2, 7] and parse_seeds("0-2,7") == [0, 1, 2, 7]
    for bad in ("", "a", "3-1", "0,0", "1-"):
        with pytest.raises(RecipeError, match="--seeds"):
            parse_seeds(bad)
    assert parse_split("90+270") == (90, 270)
    for bad in ("90", "90+0", "a+b", "90+60+1"):
        with pytest.raises(RecipeError, match="expected N\\+M"):
            parse_split(bad)


def test_command_line_selection(tmp_path):
    spec = CompareSpec(base=tiny_base(tmp_path), output_dir=str(tmp_path / "c"), splits=["4+3"],
                       mixers={"titans": {"titans_num_heads": 2}}, rewarm_steps=1)
    chosen = select(spec, seeds="1-2", splits="4+3,4+9", mixers="titans,attention")
    assert chosen.seeds == [1, 2] and chosen.splits == ["4+3", "4+9"]
    assert chosen.mixers == {"titans": {"titans_num_heads": 2}, "attention": {}}  # the file's overrides kept
    assert spec.seeds is None  # the spec itself is unchanged


def test_spec_errors_are_listed(tmp_path):
    spec = CompareSpec(base=tiny_base(tmp_path), output_dir="x", splits=["1+5", "4+1", "nope"], arms=["best"],
                       shapes={"tapered": {"schedule": "x-shape"}, "y": {"schedule": "zigzag"}},
                       convert={"speed": 1}, decay_fraction=1.0)
    with pytest.raises(RecipeError) as err:
        compare_module.check_spec(spec)
    text = str(err.value)
    for needle in ("splits[0]: N=1 ends inside the warmup", "splits[1]: the decay of 4+1 would begin",
                   "splits[2]: split 'nope'", "arms: unknown arm 'best'", "shapes.tapered: use another name",
                   "shapes.y.schedule: unknown 'zigzag'", "convert.speed: neither a tlm-convert option nor a method knob",
                   "decay_fraction: must be in"):
        assert needle in text, text
    path = tmp_path / "c.yaml"
    path.write_text("base: missing.yaml\noutput_dir: x\nsplits: 90+60\nseeds: [a]\n")
    with pytest.raises(RecipeError) as err:
        compare_module.load_compare(path)
    assert "splits: expected a list" in str(err.value) and "seeds[0]: expected an integer" in str(err.value)


# ---------------------------------------------------------------------------------------------- the table


def _record(mixer, split, arm, seed, loss, seconds=10.0):
    return {"mixer": mixer, "split": split, "arm": arm, "seed": seed, "eval_loss": loss, "params": 1000,
            "tokens": 500, "seconds": seconds, "train": [], "eval": []}


def test_paired_differences_and_sign_agreement_from_known_numbers(tmp_path):
    spec = CompareSpec(base=tiny_base(tmp_path), output_dir="x", splits=["4+3"], seeds=[0, 1, 2], rewarm_steps=1)
    conv, cont = [2.0, 2.5, 3.0], [2.1, 2.4, 3.2]  # differences -0.1, +0.1, -0.2
    uni, tap = [1.0, 1.0, 1.0], [0.9, 0.8, 0.7]  # differences -0.1, -0.2, -0.3
    runs = [_record("attention", "4+3", arm, s, v[s]) for arm, v in
            (("converted-cpt", conv), ("uniform-continued", cont), ("uniform-scratch", uni),
             ("tapered-scratch", tap)) for s in range(3)]
    runs.append(_record("attention", "4+3", "uniform-scratch", 7, 9.0))  # a seed the other arm lacks: not paired
    [study] = summarize(spec, runs)
    arms = study["arms"]
    assert arms["converted-cpt"]["mean"] == pytest.approx(2.5) and arms["converted-cpt"]["std"] == pytest.approx(0.5)
    assert arms["uniform-scratch"]["n"] == 4  # the extra seed counts for the arm itself
    pair = {(p["first"], p["second"]): p for p in study["pairs"]}
    cpt = pair["converted-cpt", "uniform-continued"]
    assert cpt["seeds"] == [0, 1, 2] and cpt["diffs"] == pytest.approx([-0.1, 0.1, -0.2])
    assert cpt["mean"] == pytest.approx(-0.2 / 3) and cpt["std"] == pytest.approx(math.sqrt(0.0233333333), rel=1e-6)
    assert (cpt["negative"], cpt["positive"]) == (2, 1)
    taper = pair["tapered-scratch", "uniform-scratch"]
    assert taper["diffs"] == pytest.approx([-0.1, -0.2, -0.3]) and taper["negative"] == 3
    assert taper["mean"] == pytest.approx(-0.2) and taper["std"] == pytest.approx(0.1)
    table = format_tables([study], spec)
    assert "| converted-cpt − uniform-continued | -0.0667 ± 0.1528 | s0: -0.1000, s1: +0.1000, s2: -0.2000 | " \
           "2/3 seeds |" in table
    assert "| tapered-scratch − uniform-scratch | -0.2000 ± 0.1000 |" in table and "3/3 seeds" in table
    assert "| converted-cpt | 1,000 | 500 | 2.5000 ± 0.5000 | 3 | 10 |" in table
    assert "warmup-stable-decay" in table.splitlines()[0]  # the plan heads the file
    assert paired({0: 1.0}, {1: 2.0})["seeds"] == []


# ---------------------------------------------------------------------------------------------- the LR plan


def test_lr_plan_shares_the_prefix_and_gives_c_and_d_the_rates_of_a_from_step_n(tmp_path):
    spec = CompareSpec(base=tiny_base(tmp_path), output_dir=str(tmp_path / "c"), splits=["4+3", "4+12"],
                       rewarm_steps=2, decay_fraction=0.25)
    recipes = {name: recipe_from_dict(r) for name, r in run_recipes(spec, "attention", 0).items()}
    assert sorted(recipes) == sorted(["uniform-N4", "tapered-N4"] + [f"{arm}-{split}" for split in spec.splits
                                                                        for arm in compare_module.ARMS])
    lr = lambda name, steps: [lr_factor(s, recipes[name]) for s in steps]  # noqa: E731
    for n, m in ((4, 3), (4, 12)):
        a, c, d = (recipes[f"{arm}-{n}+{m}"] for arm in ("uniform-scratch", "converted-cpt", "uniform-continued"))
        assert a.optim.decay == c.optim.decay == "wsd" and a.train.max_steps == n + m and c.train.max_steps == m
        full = lr(f"uniform-scratch-{n}+{m}", range(n + m))
        assert lr("uniform-N4", range(n)) == full[:n]  # the shared N-step run is the first N steps of either split
        assert lr("tapered-N4", range(n)) == full[:n]
        cont = lr(f"converted-cpt-{n}+{m}", range(m))
        assert cont == lr(f"uniform-continued-{n}+{m}", range(m))  # (c) and (d): the same rates
        assert cont[2:] == full[n + 2:]  # after the re-warm, the schedule of (a) from step N on
        assert cont[:2] == [full[n] / 2, full[n + 1]]  # the re-warm ramps to the schedule's rate
        assert full[-1] < full[n]  # the decay happens after N
        assert (c.data.skip_batches, d.data.skip_batches, c.optim.step_offset) == (n, n, n)
        assert c.init_from.endswith("converted-N4") and d.init_from.endswith("uniform-N4/final")
    assert recipes["uniform-N4"].optim.schedule_steps == prefix_schedule_steps(4, recipes["uniform-N4"].optim) == 5


# ---------------------------------------------------------------------------------------------- the study


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """2 seeds x 2 splits x (4 arms + the x-shape), run by 2 worker processes."""
    tmp = tmp_path_factory.mktemp("compare")
    spec = CompareSpec(base=tiny_base(tmp), output_dir=str(tmp / "cmp"), splits=["3+2", "3+4"], seeds=[0, 1],
                       shapes={"x-shape": {"schedule": "x-shape"}}, rewarm_steps=2,
                       convert={"calibration_tokens": 330, "batch_size": 4})
    studies = run_comparison(spec, progress=False, jobs=2)
    return spec, studies


def test_study_runs_every_seed_split_and_arm_in_its_own_folder(study):
    spec, studies = study
    out = Path(spec.output_dir)
    saved = json.loads((out / "compare.json").read_text())
    runs = saved["runs"]
    assert len(runs) == 2 * 2 * 5 and len({r["folder"] for r in runs}) == 20
    assert {(r["seed"], r["split"]) for r in runs} == {(s, p) for s in (0, 1) for p in ("3+2", "3+4")}
    assert len({r["params"] for r in runs}) == 1  # equal parameter counts
    for r in runs:
        n, m = map(int, r["split"].split("+"))
        assert r["tokens"] == (n + m) * 4 * 33 and math.isfinite(r["eval_loss"])  # equal tokens
        assert [x for x, _ in r["train"]] == [k * 4 * 33 for k in range(1, n + m + 1)]  # from step 1, N-step run first
    seed0 = out / "attention" / "seed0"
    assert sorted(p.name for p in seed0.iterdir()) == sorted(
        ["uniform-N3", "tapered-N3", "x-shape-N3", "converted-N3"]
        + [f"{arm}-{split}" for split in ("3+2", "3+4") for arm in compare_module.ARMS + ("x-shape-scratch",)])
    widths = lambda run: json.loads((seed0 / run / "final" / "config.json").read_text())["intermediate_sizes"]  # noqa
    assert widths("tapered-scratch-3+4")[0] > widths("tapered-scratch-3+4")[-1]
    assert widths("x-shape-scratch-3+4")[1] < min(widths("x-shape-scratch-3+4")[0], widths("x-shape-scratch-3+4")[2])
    assert widths("converted-cpt-3+4") == widths("tapered-scratch-3+4")  # converted to the same taper
    assert [s["split"] for s in studies] == ["3+2", "3+4"]
    for s in studies:
        assert {(p["first"], p["second"]) for p in s["pairs"]} == {
            ("converted-cpt", "uniform-continued"), ("tapered-scratch", "uniform-scratch"),
            ("x-shape-scratch", "uniform-scratch")}
        assert all(p["seeds"] == [0, 1] for p in s["pairs"])
        assert (out / f"curves-compare-attention-{s['split']}.png").stat().st_size > 5000
    table = (out / "compare.md").read_text()
    assert table.count("### attention") == 2 and table.count("/2 seeds |") == 6


def test_c_and_d_train_at_the_same_rates_as_a_from_step_n(study):
    spec, _ = study
    seed1 = Path(spec.output_dir) / "attention" / "seed1"
    lrs = lambda run: [x["lr"] for x in metrics(seed1 / run) if "lr" in x]  # noqa: E731 - the rate of each step
    c, d, a = lrs("converted-cpt-3+4"), lrs("uniform-continued-3+4"), lrs("uniform-scratch-3+4")
    assert c == d and len(c) == 4 and len(a) == 4  # (a): the 4 steps after the shared N-step run
    assert c[2:] == pytest.approx(a[2:]) and c[0] == pytest.approx(a[0] / 2)  # the re-warm, then the same schedule
    # (a) resumed from the shared run continues it exactly: its first loss is that of (d), whose weights are the same
    first = lambda run: metrics(seed1 / run)[0]["loss"]  # noqa: E731
    assert first("uniform-scratch-3+4") == first("uniform-continued-3+4") == first("uniform-scratch-3+2")


def test_finished_runs_are_collected_not_rerun(study, monkeypatch):
    spec, studies = study

    def refuse(*args, **kwargs):
        raise AssertionError("a finished run was run again")

    monkeypatch.setattr(compare_module, "train", refuse)
    monkeypatch.setattr(compare_module, "convert", refuse)
    again = run_comparison(spec, progress=False)
    assert again == studies
    res = CliRunner().invoke(_tlm(), ["compare", _write(spec), "--seeds", "1", "--split", "3+4", "--no-progress"])
    assert res.exit_code == 0, res.output
    assert "### attention, N+M = 3+4 steps" in res.output and "3+2" not in res.output.split("###")[1]
    assert res.output.count("/1 seeds |") == 3  # the three pairs, over the one seed asked for
    from tlm_io.outputs import read_marker  # the report files (written above without it) are marked as ours now

    assert {"compare.json", "compare.md"} <= set(read_marker(spec.output_dir)["files"])


def _tlm():
    from tlm_cli.main import tlm_main

    return tlm_main


def _write(spec: CompareSpec) -> str:
    path = Path(spec.output_dir).parent / "compare.yaml"
    path.write_text(yaml.safe_dump({k: v for k, v in vars(spec).items()}))
    return str(path)


def test_cli_errors_are_one_line(tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_text("base: nope.yaml\noutput_dir: x\nsplits: ['9+9']\n")
    for args in ([str(bad)], [str(bad), "--seeds", "x"]):
        res = CliRunner().invoke(_tlm(), ["compare", *args, "--no-progress"])
        lines = res.output.strip().splitlines()
        assert res.exit_code != 0 and len(lines) == 1 and lines[0].startswith("error:"), res.output
    good = tmp_path / "g.yaml"
    good.write_text(yaml.safe_dump({"base": tiny_base(tmp_path), "output_dir": str(tmp_path / "o"),
                                    "splits": ["4+3"], "rewarm_steps": 1}))
    res = CliRunner().invoke(_tlm(), ["compare", str(good), "--seeds", "3-1", "--no-progress"])
    assert res.exit_code != 0 and res.output.count("\n") == 1 and "--seeds '3-1'" in res.output, res.output
