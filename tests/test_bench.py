"""The benchmark suite (``python -m bench``): RESULTS.md and the README table are what the result files give, every
benchmark's command line is one its script accepts, and the --quick paths run."""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench import report, suite
from bench.convert_run import README_ARGS
from bench.grown_neurons import summary as grown_summary
from tlm import taper_widths
from tlm_convert.convert import stage_ratio
from tlm_convert.options import Ratio

ROOT = Path(__file__).parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
ENVELOPE = {"benchmark", "topic", "title", "command", "machine", "torch", "threads", "date", "quick", "tables"}


def bench(*args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench", *args], capture_output=True, text=True, env=ENV, cwd=ROOT,
                          timeout=timeout)


def test_committed_results_md_and_readme_table_are_what_the_result_files_give():
    assert report.render() == (ROOT / "bench" / "RESULTS.md").read_text()
    assert report.readme_text() == (ROOT / "README.md").read_text(encoding="utf-8")
    assert bench("report", "--check").returncode == 0


def test_the_readme_shows_the_demo_result_files_figures_and_stays_short():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    raw = json.loads((ROOT / "bench" / "results" / "demo.json").read_text())
    rep = raw["report"]
    for s in rep["perplexity_sets"]:
        row = next(line for line in readme.splitlines() if line.startswith(f"| {s['data']} "))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert [float(c) for c in cells[1:4]] == [round(s[k], 3) for k in ("before", "after", "ratio")], row
        if "healed" in s:
            assert [float(c) for c in cells[4:6]] == [round(s[k], 3) for k in ("healed", "healed_ratio")], row
    assert f"**x{rep['perplexity_ratio_ood_geomean']:.3f}**" in readme
    assert f"wall: {raw['wall_s'] // 60:.0f} min {raw['wall_s'] % 60:.0f} s; peak RSS GB: {raw['peak_rss_mb'] / 1024:.1f}" in readme
    assert "](bench/results/heal_curve.png)" in readme and (ROOT / "bench" / "results" / "heal_curve.png").is_file()
    assert readme.count("\n") <= 200  # a five-minute read; method details go to docs/


def test_results_md_is_short_and_every_section_names_its_command_and_machine():
    text = (ROOT / "bench" / "RESULTS.md").read_text()
    assert text.count("\n") < 560  # a ten-minute read (issue 24 added the compare study and Gemma's measured taper;
    # 2026-12-04: the GPU section and the Fisher-draw study table, beyond the six superseded rows retired for them;
    # then the heal's schedule rows and the larger calibration; 2026-12-05: the taper ratio's rows and studies,
    # then 1.4/0.6's second conversion seed and its Gemma 3 270M rows, the owner's evidence for the default ratio,
    # then 1.4/0.6's second calibration draw and its heal in the seed-0 order)
    for section in re.split(r"\n### ", text)[1:]:
        assert "command: `" in section and "machine: " in section, section.splitlines()[0]


def test_every_file_under_bench_results_is_a_current_result_or_one_a_result_names():
    named = set()
    for path in sorted((ROOT / "bench" / "results").glob("*.json")):
        data = json.loads(path.read_text())
        assert ENVELOPE <= set(data), (path.name, sorted(ENVELOPE - set(data)))
        assert data["benchmark"] in suite.BENCHMARKS and data["topic"] in suite.TOPICS and not data["quick"]
        assert suite.result_path(data["benchmark"]) == path
        named |= set(re.findall(r"bench/results/[\w./-]+\.(?:png|jsonl)", json.dumps(data)))
    named.add("bench/results/heal_curve.png")  # drawn from the heal curves, shown by the heal section
    others = {p.relative_to(ROOT).as_posix() for p in (ROOT / "bench" / "results").rglob("*")
              if p.is_file() and p.suffix != ".json"}
    assert others <= named, sorted(others - named)


def test_every_benchmark_runs_a_script_that_accepts_its_options():
    for b in suite.BENCHMARKS.values():
        script = ROOT / b.argv[0]
        assert script.is_file(), b.name
        source = script.read_text()
        own = b.argv[1:b.argv.index("--")] if "--" in b.argv else b.argv[1:]  # after --: tlm-convert's options
        options = [a for a in [*own, *(b.quick or []), *([b.out_flag] if b.out_flag else [])] if a.startswith("--")]
        for option in options:
            assert f'"{option}"' in source, (b.name, option)


def test_the_demo_benchmark_runs_the_readmes_first_command():
    first = (ROOT / "README.md").read_text(encoding="utf-8").split("```bash\n", 1)[1].splitlines()[0]
    command = first.split("&& tlm-convert ", 1)[1].split()
    assert [a for a in command if a not in ("-o", "out/smollm2-tlm", "--overwrite")] == README_ARGS


def _finite_positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def check_throughput(data: dict) -> None:
    """Both quick models stepped: finite positive step times and tokens/s that are batch x seq / median step, a first
    loss near ln(vocab) (random weights), and one table row per model with those figures."""
    shapes = data["shapes"]
    assert set(data["models"]) == {"tlm_attention", "tlm_titans"} and shapes["tokens_per_step"] == 32
    for name, m in data["models"].items():
        assert len(m["step_s"]) == data["measurement"]["timed_rounds"] == 2, name
        assert all(_finite_positive(t) for t in [*m["step_s"], m["median_step_s"], m["tokens_per_s"],
                                                    m["median_cpu_s"]]), (name, m)
        assert m["tokens_per_s"] == pytest.approx(shapes["tokens_per_step"] / m["median_step_s"], rel=0.01), name
        assert abs(m["first_loss"] - math.log(shapes["vocab_size"])) < 1.5, (name, m["first_loss"])
        assert m["params"] > m["non_embedding_params"] > 0
    assert data["models"]["tlm_titans"]["mixer"].count("titans") == 3
    ratio = data["ratios"]["titans_vs_attention"]["ratio"]
    assert _finite_positive(ratio)
    [t] = data["tables"]
    rows = {r[0]: r for r in t["rows"]}
    assert set(rows) == set(data["models"]) and rows["tlm_attention"][3] == 1.0
    assert all(_finite_positive(c) for r in t["rows"] for c in r[1:4]), t["rows"]
    assert rows["tlm_titans"][2] == round(data["models"]["tlm_titans"]["tokens_per_s"])


def check_low_memory(data: dict) -> None:
    """The --low-memory conversion exited 0 with a measured peak RSS and wall time; the output has the source's
    parameter count and the cosine taper of the 128-wide MLP (wider first layer, narrower last)."""
    run, source, output = data["run"], data["source"], data["output"]
    assert run["returncode"] == 0 and "--low-memory" in run["command"]
    assert all(_finite_positive(v) for v in (run["peak_rss_mb"], run["wall_s"], source["params"],
                                             source["bytes_on_disk"], output["self_reported_peak_rss_mb"]))
    assert 50 < run["peak_rss_mb"] < 3072  # a Python process with torch, far below the policy's budget
    assert output["params_out"] == source["params"] > 0
    first, *_, last = output["widths_after"]
    assert len(output["widths_after"]) == 2 and first > 128 > last
    [t] = data["tables"]
    [row] = t["rows"]
    assert row[0] == "--low-memory" and row[1] == f"{source['params']:,}" and row[4] == 0
    assert row[2] == round(run["peak_rss_mb"]) > 0 and row[3] == round(run["wall_s"])


QUICK_CHECKS = {"throughput": check_throughput, "low-memory": check_low_memory}


@pytest.mark.parametrize("name", ["demo", "throughput", "low-memory"])
def test_quick_run_writes_one_result_file_the_report_refuses(name, tmp_path):
    # demo ~30 s on a quiet 2-core machine; throughput and low-memory ~15-20 s each (mostly importing torch)
    proc = bench(name, "--quick", "--results-dir", str(tmp_path), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = list(tmp_path.iterdir())
    assert files == [suite.result_path(name, tmp_path)]
    data = json.loads(files[0].read_text())
    assert ENVELOPE <= set(data) and data["quick"] is True and data["benchmark"] == name
    assert data["command"] == f"python -m bench {name} --quick"
    assert data["tables"] and all(t["rows"] and len(r) == len(t["columns"]) for t in data["tables"] for r in t["rows"])
    QUICK_CHECKS.get(name, lambda data: None)(data)
    with pytest.raises(report.ReportError, match="--quick smoke test"):
        report.load(files[0])


def test_a_benchmark_without_a_quick_mode_says_so_in_one_line():
    for args in (["convert-time", "--quick"], ["quality", "--quick"], ["heal-curve", "runs/x", "--work", "w"]):
        proc = bench(*args, timeout=60)
        assert proc.returncode == 2 and proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, args


def test_the_report_picks_up_a_new_quality_row_and_heal_curve(tmp_path, monkeypatch):
    quality = tmp_path / "quality"
    quality.mkdir()
    ratios = {"default-eval": 1.5, "eval-fiction": 1.2, "eval-code": 1.25}
    row = {"name": "new_row", "label": "a new row", "command": "python bench/quality_ablation.py new_row",
           "machine": "test", "sets": {k: {"before": 10.0, "after": 10 * v, "ratio": v, "in_domain": k == "default-eval"}
                                      for k, v in ratios.items()}, "ood_geomean": (1.2 * 1.25) ** 0.5}
    curve = {"converted": "runs/q/new_row", "source_perplexity": {k: 10.0 for k in ratios}, "machine": "test",
             "points": [{"tokens": 0, "ratio": ratios}, {"tokens": 4096, "ratio": {**ratios, "eval-code": 1.1},
                                                         "cpu_seconds": 12.0, "wall_seconds": 13.0},
                        {"tokens": 8192, "ratio": {**ratios, "eval-code": 1.05}}]}
    rows = [{"grown": 40, "grown_down_norm_before": 0.01, "grown_down_norm_after": 0.03, "source_down_norm_before": 4.0,
             "source_down_norm_after": 4.5, "grown_gate_proj_moved": 0.2, "source_gate_proj_moved": 0.1,
             "grown_up_proj_moved": 0.3, "source_up_proj_moved": 0.1} for _ in range(2)]
    rows[1]["grown_down_norm_after"] = 0.05
    curve["grown_neurons"] = {"heal_tokens": 4096, **grown_summary(rows)}  # what --curve records
    (quality / "new_row.json").write_text(json.dumps(row))
    (quality / "heal_new_row.json").write_text(json.dumps(curve))
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    monkeypatch.setattr(report, "QUALITY", quality)
    monkeypatch.setattr(report, "HEAL_PNG", tmp_path / "none.png")
    text = report.render()
    assert "| a new row | 1.500 | 1.200 | 1.250 | **x1.225** |" in text
    assert "| new_row | 4,096 | 1.500 | 1.200 | 1.100 | **x1.149** | 12 | 13 |" in text
    assert "command: `python bench/quality_ablation.py new_row`" in text
    assert "| new_row | 4,096 | 80 in 2 layers | 0.0100 | 0.0400 | 4.500 | 0.2000 / 0.3000 | 0.1000 / 0.1000 |" in text
    assert text.count("| new_row | 0 |") == 1
    (quality / "heal_new_row_again.json").write_text(json.dumps({**curve, "label": "again"}))  # the same conversion
    text = report.render()
    assert text.count("| new_row | 0 |") == 1 and "| again | 0 |" not in text and "| again | 4,096 |" in text
    one = {**curve, "converted": "runs/q/one_point", "label": "one point", "points": curve["points"][:2]}
    (quality / "heal_one_point.json").write_text(json.dumps(one))  # its start is its conversion's row
    text = report.render()
    assert "| one point | 0 |" not in text and "| one point | 4,096 |" in text
    gemma = {**row, "name": "gemma_row", "label": "a Gemma row", "source": "gemma3-270m",
             "sets": {k: {**v, "before": 20.0} for k, v in row["sets"].items()}}
    (quality / "gemma_row.json").write_text(json.dumps(gemma))
    (quality / "source_gemma3-270m.json").write_text(json.dumps({k: 20.0 for k in ratios}))  # the cache: no row
    text = report.render()
    smol, gem = text.index("### SmolLM2-135M right after conversion"), text.index("### Gemma 3 270M right after")
    assert smol < text.index("| a new row |") < gem < text.index("| a Gemma row |")  # a table per source
    assert "Source perplexities (each row's `before`): default-eval (cal. domain) 20.000," in text[gem:]
    (quality / "stray.json").write_text("{}")
    with pytest.raises(report.ReportError, match="stray.json: neither a quality row"):
        report.render()


def test_a_study_gathers_its_rows_with_their_heals_and_means_per_setting(tmp_path, monkeypatch):
    """Rows with a ``study`` form one table (each with its heal at 24,576 tokens, a geometric mean over the last key
    per setting of the others); outside it only the default row and a row marked ``in_main_tables`` stay in their
    source's table and the heal table."""
    quality = tmp_path / "quality"
    quality.mkdir()
    study = {"name": "draws", "title": "the draw study", "command": "quality_ablation.py NAME",
             "heal_command": "heal_curve.py runs/q/NAME", "machine": "two lanes"}

    def row(name, ood, draws, seed, default=False, mask="sequence", main=False):
        sets = {"default-eval": {"before": 10.0, "after": 15.0, "ratio": 1.5, "in_domain": True},
                "eval-code": {"before": 10.0, "after": 10 * ood, "ratio": ood, "in_domain": False}}
        data = {"name": name, "label": name, "sets": sets, "ood_geomean": ood, "command": "c", "machine": "m",
                "study": {**study, **({"in_main_tables": True} if main else {}), "mask": mask, "fisher_draws": draws,
                          "seed": seed}}
        (quality / f"{name}.json").write_text(json.dumps({**data, "default": True} if default else data))
        curve = {"converted": f"runs/q/{name}", "label": f"healed {name}", "source_perplexity": {"default-eval": 10.0,
                 "eval-code": 10.0}, "command": "h", "machine": "m", "study": data["study"],
                 "points": [{"tokens": 0, "ratio": {"default-eval": 1.5, "eval-code": ood}},
                            {"tokens": 24_576, "ratio": {"default-eval": 1.4, "eval-code": ood - 0.1}}]}
        (quality / f"heal_{name}.json").write_text(json.dumps({**curve, "default": True} if default else curve))

    row("d1s0", 1.44, 1, 0, default=True)
    row("d1s1", 1.21, 1, 1)
    row("d2s0", 1.30, 2, 0)
    row("t1s0", 1.25, 1, 0, mask="token")
    row("t1s1", 1.16, 1, 1, mask="token", main=True)
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    monkeypatch.setattr(report, "QUALITY", quality)
    monkeypatch.setattr(report, "HEAL_PNG", tmp_path / "none.png")
    text = report.render()
    table = text[text.index("### the draw study"):]
    assert "| sequence | 1 | 0 | 1.500 | 1.440 | x1.440 | x1.340 |" in table
    assert "| sequence | 2 | 0 | 1.500 | 1.300 | x1.300 | x1.200 |" in table
    # sqrt(1.44 * 1.21), sqrt(1.34 * 1.11); sqrt(1.25 * 1.16), sqrt(1.15 * 1.06)
    assert "| sequence | 1 | mean of 2 |  |  | **x1.320** | **x1.220** |" in table
    assert "| token | 1 | mean of 2 |  |  | **x1.204** | **x1.104** |" in table
    assert "mean of 1" not in table and "mean of 4" not in table
    assert "*command: `quality_ablation.py NAME`, its heal `heal_curve.py runs/q/NAME`; machine: two lanes" in table
    main = text[:text.index("### the draw study")]
    assert "| d1s0 |" in main and "| d1s1 |" not in main and "| d2s0 |" not in main and "| t1s0 |" not in main
    assert "| t1s1 |" in main  # in_main_tables: in the study (its mean above) and in the main tables
    heal = text[text.index("## 2."):]
    assert "| healed d1s0 | 24,576 |" in heal and "healed d1s1" not in heal and "healed d2s0" not in heal
    assert "| healed t1s1 | 24,576 |" in heal


def test_the_compare_reading_follows_its_rule():
    """bench/compare_study.py reads a paired difference as wins / loses / within the noise by the rule it states."""
    from bench.compare_study import RULE, reading, verdict

    def pair(diffs):
        mean = sum(diffs) / len(diffs)
        std = (sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1)) ** 0.5 if len(diffs) > 1 else 0.0
        return {"first": "converted-cpt", "second": "uniform-continued", "seeds": list(range(len(diffs))),
                "diffs": diffs, "mean": mean, "std": std, "negative": sum(d < 0 for d in diffs),
                "positive": sum(d > 0 for d in diffs)}

    assert verdict(pair([-0.02, -0.03, -0.025, -0.02, 0.001])) == "wins"  # 4/5 lower, mean beyond one std
    assert verdict(pair([0.02, 0.03, 0.025, 0.02, 0.021])) == "loses"
    assert verdict(pair([-0.02, 0.03, -0.025, 0.02, -0.01])) == "within the noise"  # signs disagree
    assert verdict(pair([-0.001, -0.09, -0.002, -0.001, -0.001])) == "within the noise"  # mean inside its std
    assert verdict(pair([-0.5])) == "too few seeds"
    studies = [{"mixer": "attention", "split": "90+270", "pairs": [pair([-0.02, -0.03, -0.025, -0.02, 0.001])],
                "arms": {"converted-cpt": {"mean": 2.1, "std": 0.05, "n": 5, "seconds": 160.4}}}]
    rows = reading("cpu-attention", studies)
    assert rows == [["cpu-attention", "attention", "90+270", "converted-cpt − uniform-continued", "wins",
                     "-0.0188 ± 0.0118", "4/5"]]
    tables = suite.compare_tables({"rule": RULE, "reading": rows,
                                   "studies": [{"study": "cpu-attention", "studies": studies}]})
    assert tables[0]["rows"] == rows
    assert tables[1]["rows"] == [["cpu-attention", "attention", "90+270", "converted-cpt", "2.1000 ± 0.0500", 5, "160"]]


@pytest.mark.parametrize("stages", [1, 2, 3, 5, 7])
def test_every_taper_stage_is_a_ratio_the_conversion_accepts(stages):
    ratios = [stage_ratio(Ratio.parse("1.5/0.5"), k, stages) for k in range(1, stages + 1)]
    widths = [taper_widths(30, 1536, "cosine", r.values) for r in ratios]
    assert all(sum(w) == 30 * 1536 for w in widths)  # every stage keeps the parameter budget
    assert widths[-1] == taper_widths(30, 1536, "cosine", "1.5/0.5")  # and the last is the one-shot target
    assert [w[0] for w in widths] == sorted(w[0] for w in widths)  # the first layer widens stage by stage


def test_self_samples_refuses_an_existing_output_in_one_line(tmp_path):
    out = tmp_path / "samples.txt"
    out.write_text("kept\n")
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "self_samples.py"), "2", "--out", str(out)],
                         capture_output=True, text=True, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert run.returncode != 0 and "exists" in run.stderr and len(run.stderr.strip().splitlines()) == 1
    assert out.read_text() == "kept\n"
