"""The benchmark suite (``python -m bench``): RESULTS.md, STUDIES.md and the docs' generated blocks are what the
result files give, RESULTS.md shows the defaults and each user choice once, every benchmark's command line is one its
script accepts, and the --quick paths run."""

import ast
import json
import math
import os
import re
import shlex
import subprocess
import sys
from graphlib import TopologicalSorter
from pathlib import Path

import click
import pytest

from bench import report, studies, suite, tables
from bench.convert_run import README_ARGS
from bench.grown_neurons import summary as grown_summary
from bench.study_log import LOGS
from tlm import taper_widths
from tlm_cli.convert import convert_main
from tlm_convert.convert import stage_ratio
from tlm_convert.options import Ratio

ROOT = Path(__file__).parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
ENVELOPE = {"benchmark", "topic", "title", "command", "machine", "torch", "threads", "date", "quick", "tables"}


def bench(*args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench", *args], capture_output=True, text=True, env=ENV, cwd=ROOT,
                          timeout=timeout)


def test_committed_pages_and_generated_blocks_are_what_the_result_files_give():
    generated = report.generated()
    assert {report.RESULTS_MD, studies.STUDIES_MD, report.README} <= set(generated)
    for path, text in generated.items():
        assert path.read_text(encoding="utf-8") == text, f"{path.name} is stale: run `python -m bench report`"
    assert bench("report", "--check").returncode == 0


def test_the_readme_shows_the_demo_result_files_figures_and_stays_a_short_read():
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
    # a five-minute read: the two commands, what you get, the three things people do, then links to the manual
    headings = re.findall(r"^## (.+)$", readme, re.M)
    assert headings == ["What you get", "Converting a checkpoint", "Healing and training", "Export and serve", "More"]


MAX_LINE = 300  # a table row of short cells; a longer line is a story that belongs in its result file
MAX_MAIN_FILES = 40


def _user_options() -> set[str]:
    params = convert_main.get_params(click.Context(convert_main))
    return {o for p in params if isinstance(p, click.Option) for o in (*p.opts, *getattr(p, "secondary_opts", ()))}


def test_results_md_shows_the_defaults_and_each_user_choice_once():
    """The main page's rule (it replaces a cap on its length): each quality row and heal curve on it is the default
    or one choice of tlm-convert's own options (no method knob: those are studies), once per source; its benchmarks
    are no study's; it reads at most MAX_MAIN_FILES result files; no line is longer than MAX_LINE (the per-row
    stories stay in the files); every section names its command and machine."""
    rows, curves = report.choice_files()
    options = _user_options() - {"--set", "--help"}
    for path, data in rows + curves:
        words = shlex.split(data["choice"])
        flags = [w.split("=", 1)[0] for w in words if w.startswith("-")]
        assert set(flags) <= options and len(flags) <= 1, (path.name, data["choice"])
    assert len(rows) == len({(report.source_of(d), d["choice"]) for _, d in rows})
    assert len(curves) == len({(report.source_of(d), d["choice"]) for _, d in curves})
    assert any(d["choice"] == "" for _, d in rows) and any(d["choice"] == "" for _, d in curves)
    main_files = [*suite.RESULTS.glob("*.json"), *tables.QUALITY.glob("*.json")]
    assert len(main_files) <= MAX_MAIN_FILES, len(main_files)
    for path in suite.RESULTS.glob("*.json"):
        assert suite.BENCHMARKS[json.loads(path.read_text())["benchmark"]].study is None, path.name
    text = report.RESULTS_MD.read_text()
    long = [line[:80] for line in text.splitlines() if len(line) > MAX_LINE]
    assert not long, long
    for section in re.split(r"\n### ", text)[1:]:
        titled = section.splitlines()[0]
        provenance = "command: `" in section and "machine: " in section
        columns = "| machine |" in section and "| command |" in section
        assert provenance or columns, titled


def test_the_studies_page_shows_every_study_file_and_types_no_figure():
    """Every file under bench/results/studies/ is named on STUDIES.md, in the folder of a study of bench/studies.py;
    the studies' logs carry figures only as placeholders the report fills from a file."""
    page = studies.STUDIES_MD.read_text(encoding="utf-8")
    for path in sorted(suite.STUDIES.rglob("*")):
        if path.is_file():
            assert path.parent.name in studies.STUDIES_BY_NAME, path
            assert path.suffix != ".json" or path.name in page, path.name
    for name, log in LOGS.items():
        assert name in studies.STUDIES_BY_NAME, name
        for day, text in log:
            assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", day), (name, day)
            typed = re.findall(r"x\d\.\d{2,}|\b1\.\d{3}\b", studies.PLACEHOLDER.sub("", text))
            assert not typed, (name, day, typed)


def test_a_placeholder_names_a_file_and_a_figure_it_holds():
    files = tables.result_files()
    assert studies.fill("{ood:fisher_token}", files) == f"x{files['fisher_token'][1]['ood_geomean']:.3f}"
    point = next(p for p in files["heal_fisher_token"][1]["points"] if p["tokens"] == 24576)
    assert studies.fill("{ood:heal_fisher_token@24576}", files) == f"x{point['ood_geomean']:.3f}"
    assert studies.fill("{set:heal_fisher_token@24576:eval-code}", files) == f"{point['ratio']['eval-code']:.3f}"
    for bad, message in (("{ood:no_such_file}", "no result file"), ("{ood:heal_fisher_token@7}", "no heal point"),
                         ("{set:fisher_token:no-set}", "no such figure")):
        with pytest.raises(tables.ReportError, match=message):
            studies.fill(bad, files)


def test_the_bench_modules_import_no_cycle():
    """bench/report.py renders and bench/suite.py runs: neither imports the other's floor back."""
    graph = {}
    for path in sorted((ROOT / "bench").glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "bench":
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("bench."):
                deps.add(node.module.split(".", 1)[1])
        graph[path.stem] = deps
    list(TopologicalSorter(graph).static_order())  # raises CycleError on a cycle
    assert "report" not in graph["suite"] and "suite" in graph["report"]


def test_every_file_under_bench_results_is_a_current_result_or_one_a_result_names():
    named = {b.reads for b in suite.BENCHMARKS.values() if b.reads}
    for path in sorted(suite.RESULTS.rglob("*.json")):
        data = json.loads(path.read_text())
        if "benchmark" not in data:
            assert path.parent == tables.QUALITY or path.is_relative_to(suite.STUDIES), path
            continue
        assert ENVELOPE <= set(data), (path.name, sorted(ENVELOPE - set(data)))
        assert data["benchmark"] in suite.BENCHMARKS and data["topic"] in suite.TOPICS and not data["quick"]
        assert suite.result_path(data["benchmark"]) == path
        named |= set(re.findall(r"bench/results/[\w./-]+\.(?:png|jsonl)", json.dumps(data)))
    named.add("bench/results/heal_curve.png")  # drawn from the heal curves, shown by the heal section
    others = {p.relative_to(ROOT).as_posix() for p in suite.RESULTS.rglob("*") if p.is_file() and p.suffix != ".json"}
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


def _row(name, ratios, **extra):
    return {"name": name, "command": f"python bench/quality_ablation.py {name} --save runs/q/{name}",
            "machine": "test box; beside a long story that stays in the file", "date": "2026-12-06",
            "sets": {k: {"before": 10.0, "after": 10 * v, "ratio": v, "in_domain": k == "default-eval"}
                     for k, v in ratios.items()},
            "ood_geomean": math.exp(sum(math.log(v) for k, v in ratios.items() if k != "default-eval")
                                    / (len(ratios) - 1)), **extra}


def _curve(name, ratios, **extra):
    return {"converted": f"runs/q/{name}", "source_perplexity": {k: 10.0 for k in ratios}, "machine": "test box",
            "date": "2026-12-06",
            "command": f"python bench/heal_curve.py runs/q/{name} --work runs/q/h --out x.json",
            "points": [{"tokens": 0, "ratio": ratios}, {"tokens": 4096, "ratio": {**ratios, "eval-code": 1.1},
                                                        "cpu_seconds": 12.0, "wall_seconds": 13.0},
                       {"tokens": 8192, "ratio": {**ratios, "eval-code": 1.05}, "cpu_seconds": 30.0}], **extra}


def test_the_report_shows_each_choice_once_with_its_heal(tmp_path, monkeypatch):
    quality = tmp_path / "quality"
    quality.mkdir()
    ratios = {"default-eval": 1.5, "eval-fiction": 1.2, "eval-code": 1.25}
    (quality / "new_row.json").write_text(json.dumps(_row("new_row", ratios, choice="", widths=[30, 20, 10])))
    (quality / "heal_new_row.json").write_text(json.dumps(_curve("new_row", ratios, choice="")))
    (quality / "ratio.json").write_text(json.dumps(_row("ratio", ratios, choice="--ratio 1.4/0.6")))
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    monkeypatch.setattr(report, "QUALITY", quality)
    monkeypatch.setattr(report, "HEAL_PNG", tmp_path / "none.png")
    text = report.render()
    assert ("| the default | 30 .. 10 | 1.500 | 1.200 | 1.250 | **x1.225** |  | test box | 2026-12-06 | "
            "`quality_ablation.py new_row` |") in text  # the machine's first clause, the command without its paths
    assert "| `--ratio 1.4/0.6` |  | 1.500 |" in text
    assert "| the default | x1.225 | x1.149 | x1.122 | 30 | test box | 2026-12-06 | `heal_curve.py runs/q/new_row` |" in text
    assert "long story" not in text
    smol = text.index("### SmolLM2-135M right after conversion")
    assert smol < text.index("| the default | 30 .. 10 |") < text.index("| `--ratio 1.4/0.6` |")  # the default first
    gemma = _row("gemma_row", {k: v + 0.1 for k, v in ratios.items()}, choice="", source="gemma3-270m")
    (quality / "gemma_row.json").write_text(json.dumps(gemma))
    (quality / "source_gemma3-270m.json").write_text(json.dumps({k: 20.0 for k in ratios}))  # the cache: no row
    text = report.render()
    assert text.index("### SmolLM2-135M right after") < text.index("### Gemma 3 270M right after") < text.index("1.600")
    assert "| the default | 30 .. 10 | **x1.225** | x1.149 | x1.122 | " in "\n".join(report.choices_block("smollm2-135m"))
    (quality / "again.json").write_text(json.dumps(_row("again", ratios, choice="--ratio 1.4/0.6")))
    with pytest.raises(report.ReportError, match=r"ratio.json: row of choice '--ratio 1.4/0.6' on smollm2-135m again \(again.json\)"):
        report.render()
    (quality / "again.json").unlink()
    (quality / "knob.json").write_text(json.dumps(_row("knob", ratios)))  # no choice: a study's file
    with pytest.raises(report.ReportError, match="knob.json: a file under bench/results/quality/ is a conversion row"):
        report.render()
    (quality / "knob.json").write_text("{}")
    with pytest.raises(report.ReportError, match="knob.json: neither a benchmark's result"):
        report.render()


def test_a_study_gathers_its_rows_heals_and_log(tmp_path, monkeypatch):
    """A study's rows with ``study`` keys form one table (each with its heal at 24,576 tokens, a geometric mean over
    the last key per setting of the others); other rows and loose heal curves get tables of their own; its log's
    placeholders are filled from the files."""
    folder = tmp_path / "draws"
    folder.mkdir()
    keys = {"name": "draws", "command": "quality_ablation.py NAME", "heal_command": "heal_curve.py runs/q/NAME"}
    files = {}

    def put(name, data):
        (folder / f"{name}.json").write_text(json.dumps(data))
        files[name] = (folder / f"{name}.json", data)

    for name, ood, draws, seed, mask in (("d1s0", 1.44, 1, 0, "sequence"), ("d1s1", 1.21, 1, 1, "sequence"),
                                         ("d2s0", 1.30, 2, 0, "sequence"), ("t1s0", 1.25, 1, 0, "token"),
                                         ("t1s1", 1.16, 1, 1, "token")):
        ratios = {"default-eval": 1.5, "eval-code": ood}
        put(name, _row(name, ratios, study={**keys, "mask": mask, "fisher_draws": draws, "seed": seed}))
        curve = _curve(name, ratios)
        curve["points"][1] = {"tokens": 24_576, "ratio": {"default-eval": 1.4, "eval-code": ood - 0.1}}
        put(f"heal_{name}", curve)
    put("other", _row("other", {"default-eval": 1.5, "eval-code": 1.3}, label="another row"))
    grown = [{"grown": 40, "grown_down_norm_before": 0.01, "grown_down_norm_after": 0.03, "source_down_norm_before": 4.0,
              "source_down_norm_after": 4.5, "grown_gate_proj_moved": 0.2, "source_gate_proj_moved": 0.1,
              "grown_up_proj_moved": 0.3, "source_up_proj_moved": 0.1} for _ in range(2)]
    grown[1]["grown_down_norm_after"] = 0.05
    put("heal_loose", {**_curve("elsewhere", {"default-eval": 1.5, "eval-code": 1.3}), "label": "a loose heal",
                       "grown_neurons": {"heal_tokens": 4096, **grown_summary(grown)}})  # what --curve records
    monkeypatch.setattr(studies, "STUDIES", tmp_path)
    monkeypatch.setitem(studies.LOGS, "draws", [("2026-12-06", "seed 0 {ood:d1s0}, healed {ood:heal_d1s0@24576}; "
                                                               "mean {gmean:d1s0,d1s1}")])
    study = studies.Study("draws", "the draw study", "Does the draw matter?", varied="draws", grown=True)
    text = "\n".join(studies.section(study, files))
    assert text.startswith("## the draw study\n\n*2026-12-06; files: ")
    assert "- **2026-12-06**: seed 0 x1.440, healed x1.340; mean x1.320" in text
    assert "| sequence | 1 | 0 | 1.500 | 1.440 | x1.440 | x1.340 |" in text
    assert "| d1s0.json, heal_d1s0.json |" in text
    # sqrt(1.44 * 1.21), sqrt(1.34 * 1.11); sqrt(1.25 * 1.16), sqrt(1.15 * 1.06)
    assert "| sequence | 1 | mean of 2 |  |  | **x1.320** | **x1.220** |" in text
    assert "| token | 1 | mean of 2 |  |  | **x1.204** | **x1.104** |" in text
    assert "mean of 1" not in text and "*command: `quality_ablation.py NAME`, its heal `heal_curve.py runs/q/NAME`." in text
    assert "| another row | SmolLM2-135M | 1.500 | 1.300 | **x1.300** |" in text
    assert "| a loose heal | SmolLM2-135M | 0 | 1.500 | 1.300 | **x1.300** |" in text  # its start: no row shows it
    assert "| a loose heal | 4,096 | 80 in 2 layers | 0.0100 | 0.0400 | 4.500 | 0.2000 / 0.3000 | 0.1000 / 0.1000 |" in text


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


def test_the_accuracy_table_ranks_models_by_accuracy_and_by_the_perplexity_its_result_files_give():
    from bench.eval_suite import ood_ratios, ranking

    heal = json.loads((tables.QUALITY / "heal_fisher_token.json").read_text())
    at = next(p for p in heal["points"] if p["tokens"] == 24576)
    ood = ood_ratios(["converted=fisher_token", "healed=heal_fisher_token@24576"])
    assert ood == {"converted": json.loads((tables.QUALITY / "fisher_token.json").read_text())["ood_geomean"],
                   "healed": tables.point_ood(heal, at)}
    runs = [{"label": name, "mean_acc": acc, "accuracy": {"t": {"acc": acc, "acc_stderr": 0.01}}}
            for name, acc in (("source", 0.5), ("a", 0.45), ("b", 0.40), ("c", 0.42))]
    rank = ranking(runs, {"a": 1.1, "b": 1.2, "c": 1.05})  # c: better perplexity than a, worse accuracy
    assert rank["by_accuracy"] == ["a", "c", "b"] and rank["by_perplexity"] == ["c", "a", "b"]
    assert (rank["concordant_pairs"], rank["pairs"]) == (2, 3)
    # apart by > 2 * hypot(0.01, 0.01) = 0.028: a-b (0.05) and a-c (0.03), not c-b (0.02); perplexity agrees on a-b
    assert rank["resolved"] == [("a", "b"), ("a", "c")] and rank["resolved_concordant"] == 1
    with pytest.raises(SystemExit, match="no heal point at 7 tokens"):
        ood_ratios(["x=heal_fisher_token@7"])


def test_a_pair_logged_on_the_same_documents_is_compared_paired():
    from bench.eval_suite import pair_stderr

    def run(x: str, y: str) -> dict:
        acc = {t: {"acc": v.count("1") / len(v), "acc_stderr": 0.1} for t, v in (("x", x), ("y", y))}
        return {"accuracy": acc, "items": {"x": x, "y": y}}

    a, b = run("1101", "0011"), run("1001", "0111")
    # differences: x (0, 1, 0, 0): mean 1/4, sample variance 1/4, / n -> 1/16; y (0, -1, 0, 0): the same
    err, paired = pair_stderr(a, b)
    assert paired and err == pytest.approx(math.sqrt(1 / 16 + 1 / 16) / 2)
    b.pop("items")  # one run without its documents: the two stderrs as independent
    assert pair_stderr(a, b) == (pytest.approx(math.hypot(0.1 * math.sqrt(2) / 2, 0.1 * math.sqrt(2) / 2)), False)


def test_the_accuracy_table_shows_each_models_difference_from_the_source_paired():
    from bench.eval_suite import tables

    def run(label: str, x: str, y: str) -> dict:
        acc = {t: {"acc": v.count("1") / len(v), "acc_stderr": 0.1, "n": len(v)} for t, v in (("x", x), ("y", y))}
        return {"label": label, "accuracy": acc, "items": {"x": x, "y": y}, "mean_acc": (x + y).count("1") / 8,
                "wall_s": 1.0, "cpu_s": 1.0, "peak_rss_mb": 1}

    first = tables([run("source", "1001", "0111"), run("c", "1101", "0011")], "source")[0]
    at = first["columns"].index("vs source")
    assert first["columns"][at - 1] == "retention" and first["columns"][-2:] == ["wall / CPU s", "peak GB"]
    assert first["rows"][0][at] is None  # the source itself
    assert first["rows"][1][at] == f"+0.000 ± {math.sqrt(1 / 8) / 2:.3f}"  # +1/4 on x, -1/4 on y


def test_a_task_head_names_its_chance_and_whether_the_source_beats_it():
    from bench.eval_suite import task_head

    base = {"accuracy": {"piqa": {"acc": 0.61, "acc_stderr": 0.049}, "boolq_notitle": {"acc": 0.58, "acc_stderr": 0.05}}}
    assert task_head("piqa", base) == "piqa (0.5, above)"  # 0.11 > 2 x 0.049
    assert task_head("boolq_notitle", base) == "boolq_notitle (0.5)"  # 0.08 < 2 x 0.05
    assert task_head("mytask", base) == "mytask"  # no chance level known


def test_the_mean_accuracy_stderr_takes_the_tasks_as_independent():
    from tlm_io.harness import mean_accuracy, mean_accuracy_stderr

    summary = {"x": {"acc": 0.5, "acc_stderr": 0.03}, "y": {"acc": 0.3, "acc_stderr": 0.04}, "z": {"acc_norm": 0.9}}
    assert mean_accuracy(summary) == pytest.approx(0.4)
    assert mean_accuracy_stderr(summary) == pytest.approx(0.025)  # sqrt(0.03^2 + 0.04^2) / 2
    assert mean_accuracy_stderr({"x": {"acc": 0.5, "acc_stderr": None}}) is None


def test_the_short_command_drops_paths_and_the_values_its_table_lists():
    data = {"command": "python bench/eval_suite.py --models source=smollm2-135m default=runs/q/a --work runs/acc "
                       "--limit 100 --ood default=a healed=h@24576 --out bench/results/accuracy.json"}
    assert tables.short_command(data) == "eval_suite.py --models LABEL=PATH ... --limit 100 --ood LABEL=STEM ..."
    assert tables.short_command({"command": "OMP_NUM_THREADS=1 python -m bench demo"}) == "python -m bench demo"
    row = {"command": 'python bench/heal_curve.py runs/q/m --points 24576 --choice "--schedule measured-taper" --out x'}
    assert tables.short_command(row) == "heal_curve.py runs/q/m --points 24576"
