"""The benchmark suite: named benchmarks over the scripts in bench/, each writing one current result file.

    python -m bench list                     # the benchmarks, their topic and what they run
    python -m bench NAME [--quick] [ARGS]    # run one; ARGS go to its script; writes bench/results/NAME.json
    python -m bench report [--check]         # regenerate bench/RESULTS.md, bench/STUDIES.md and the docs' blocks

A result file is the script's own JSON object with the envelope keys of bench/README.md ("Result files") added:
``benchmark``, ``topic``, ``title``, ``command``, ``machine``, ``torch``, ``threads``, ``date``, ``quick`` and
``tables`` (what bench/RESULTS.md shows; a study's benchmark writes under bench/results/studies/STUDY/ and
shows on bench/STUDIES.md). ``--quick`` runs a benchmark on tiny shapes to check that it runs; its
figures are not measurements, so it writes under runs/bench-quick/ unless ``--results-dir`` says otherwise.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RESULTS = BENCH / "results"
STUDIES = RESULTS / "studies"  # a study's result files, one folder a study (bench/STUDIES.md)
QUICK_RESULTS = ROOT / "runs" / "bench-quick"

TOPICS = {  # the order of bench/RESULTS.md
    "quality": "Conversion quality",
    "heal": "Heal curve",
    "convert": "Conversion time and memory",
    "throughput": "Training throughput per mixer",
    "low-memory": "Low-memory conversion",
    "gguf": "GGUF parity with llama.cpp",
    "data-path": "Training data path",
    "evidence": "From-scratch evidence",
    "other": "Other measurements",
}


class SuiteError(ValueError):
    """A benchmark run that cannot start (names the problem and the fix)."""


def result_path(name: str, results_dir: Path | None = None) -> Path:
    """Where benchmark ``name`` writes: its name with ``-`` as ``_``, under ``results_dir`` (by default
    bench/results/, or its study's folder for a study's benchmark)."""
    study = BENCHMARKS[name].study if name in BENCHMARKS else None
    if results_dir is None:
        results_dir = STUDIES / study if study else RESULTS
    return results_dir / f"{name.replace('-', '_')}.json"


# ------------------------------------------------------------------------------------------------- tables


def table(title: str, columns: list[str], rows: list[list], notes: str = "") -> dict:
    return {"title": title, "columns": columns, "rows": rows, **({"notes": notes} if notes else {})}


def _r(value, digits: int = 3):
    return None if value is None else round(float(value), digits)


def _f(value, digits: int = 3) -> str | None:
    """A ratio or perplexity as text with ``digits`` decimals (tables keep 1.290, not 1.29)."""
    return None if value is None else f"{float(value):.{digits}f}"


def throughput_tables(raw: dict) -> list[dict]:
    models = raw["models"]
    ref = models.get("tlm_attention")
    rows = []
    for name, m in models.items():
        ratio = cpu = None
        if ref:
            ratio = _r(m["tokens_per_s"] / ref["tokens_per_s"], 2)
            cpu = _r(ref["median_cpu_s"] / m["median_cpu_s"], 2) if m.get("median_cpu_s") else None
        rows.append([name, _r(m["median_step_s"], 2), round(m["tokens_per_s"]), ratio, cpu])
    shapes = raw.get("shapes", {})
    return [table(f"tokens/s of one training step, batch {shapes.get('batch')} x seq {shapes.get('seq_len')}, "
                  f"{raw.get('dtype', 'float32')}, AdamW included",
                  ["model", "median step s", "tokens/s", "vs tlm_attention", "CPU-time ratio"], rows,
                  "On a shared machine the CPU-time ratio (process CPU seconds) is the figure to trust.")]


def convert_time_tables(raw: dict) -> list[dict]:
    forward = raw["plain_forward_seconds"]
    rows = [["plain forward (mean of two)", _r(sum(forward) / len(forward), 1), None]]
    rows += [[f"conversion: {k}", _r(v, 1), None] for k, v in raw["seconds_per_phase"].items() if v]
    rows += [["conversion total", _r(raw["conversion_wall_seconds"], 1), _r(raw.get("ratio_total"), 2)],
             ["calibrate + rank + resize", None, _r(raw.get("ratio_calibrate_rank_resize"), 2)]]
    if "ratio_total_cpu" in raw:
        rows.append(["conversion total, CPU seconds", _r(raw.get("conversion_cpu_seconds"), 1),
                     _r(raw["ratio_total_cpu"], 2)])
    return [table(f"{raw['calibration_tokens']:,} calibration tokens, {raw['threads']} threads: conversion against "
                  "plain forward passes over the same tokens", ["phase", "seconds", "ratio to plain forward"], rows)]


def convert_run_tables(raw: dict) -> list[dict]:
    report = raw["report"]
    healed = "perplexity_healed" in report
    columns = ["set", "source", "converted", "ratio"] + (["healed", "ratio"] if healed else [])
    rows = []
    for s in report.get("perplexity_sets", []):
        row = [s["data"] + (" (calibration domain)" if s["in_domain"] else ""), _f(s["before"]), _f(s["after"]),
               _f(s["ratio"])]
        if healed:
            row += [_f(s.get("healed")), _f(s.get("healed_ratio"))]
        rows.append(row)
    if "perplexity_ratio_ood_geomean" in report:
        rows.append(["**out-of-domain geometric mean**", None, None, "**x" + _f(report["perplexity_ratio_ood_geomean"]) + "**"]
                    + ([None, "**x" + _f(report.get("perplexity_ratio_ood_geomean_healed")) + "**"] if healed else []))
    phases = ", ".join(f"{k} {v:.0f} s" for k, v in report.get("seconds", {}).items() if v)
    minutes, seconds = divmod(round(raw["wall_s"]), 60)
    time_row = [[f"{minutes} min {seconds} s", _r(raw["peak_rss_mb"] / 1024, 1), phases]]
    tables = [table("wall time and peak memory", ["wall", "peak RSS GB", "phases"], time_row)]
    if rows:
        tables.insert(0, table("perplexity per set", columns, rows))
    return tables


def low_memory_tables(raw: dict) -> list[dict]:
    run, src, args = raw["run"], raw["source"], raw["args"]
    return [table(f"a generated {src['bytes_on_disk'] / 1e9:.2f} GB fp32 checkpoint (hidden {args['hidden']}, MLP "
                  f"{args['intermediate']}, {args['layers']} layers)",
                  ["mode", "params", "peak RSS MB", "wall s", "exit"],
                  [["in memory" if args.get("in_memory") else "--low-memory", f"{src['params']:,}",
                    round(run["peak_rss_mb"]), round(run["wall_s"]), run["returncode"]]])]


def data_path_tables(raw: dict) -> list[dict]:
    tok = [[r["num_proc"], r["tokens"], r["shards"], r["seconds"], r["tokens_per_s"]] for r in raw["tokenization"]]
    reads = [[f"{r['batch']} x {r['seq_len']}", r["workers"], r["tokens_per_s"]] for r in raw["data_path_before"]]
    return [table("tokenization into the sharded cache", ["processes", "tokens", "shards", "seconds", "tokens/s"], tok),
            table(f"reading micro-batches; the training step runs at {raw['training']['tokens_per_s']:,} tokens/s",
                  ["batch x seq", "workers", "tokens/s"], reads,
                  f"data path / training step: x{raw['ratio_data_path_vs_training']:,.0f} (target x{raw['target']}; "
                  f"met: {raw['meets_target']})")]


def gguf_tables(raw: dict) -> list[dict]:
    keys = ["weight_type", "tokens", "ctx", "max_abs_delta_logit", "top1_agreement", "perplexity_torch",
            "perplexity_llama_cpp", "greedy_identical", "greedy_tokens", "tokenization_identical"]
    return [table(f"torch against llama.cpp on the same tokens ({Path(str(raw['model'])).name})", ["figure", "value"],
                  [[k, _r(raw[k], 6) if isinstance(raw[k], float) else raw[k]] for k in keys if k in raw])]


def gguf_tokenizer_tables(raw: dict) -> list[dict]:
    rows = [[name, s["tokens_transformers"], s["tokens_llama_cpp"], s["identical"]] for name, s in raw["sets"].items()]
    return [table(f"tlm's tokenizer from the GGUF against llama.cpp's ({raw['model']})",
                  ["set", "tokens (transformers)", "tokens (llama.cpp)", "identical"], rows)]


def train_overhead_tables(raw: dict) -> list[dict]:
    return [table("tlm train against a bare PyTorch loop on the same model and data", ["figure", "value"],
                  [["median round ratio (wall)", _r(raw["median_round_ratio"])],
                   ["median round ratio (CPU)", _r(raw.get("median_cpu_round_ratio"))]])]


def heal_step_tables(raw: dict) -> list[dict]:
    tables = []
    shape = f"{raw.get('batch')} x {raw.get('seq_len')} tokens a step, micro-batch {raw.get('micro_batch', raw.get('batch'))}"
    for model, m in raw.get("models", {}).items():
        peaks = m.get("peak_rss", {})
        rows = []
        for variant, t in m.get("timing", {}).items():
            share = t.get("wall_share", {})
            rows.append([variant, _r(t.get("tokens_per_s"), 1), _r(t.get("vs_plain"), 3), _r(t.get("median_wall_s"), 2),
                         _r(t.get("median_cpu_s"), 2), peaks.get(variant, {}).get("peak_rss_mb"),
                         " / ".join(f"{round(100 * share.get(k, 0))}" for k in
                                    ("teacher_forward", "student_forward", "loss", "backward", "optimizer"))])
        if rows:
            tables.append(table(f"{model}: one heal step side by side ({shape}, trainable: {raw.get('trainable', 'all')})",
                                ["variant", "tokens/s", "vs plain", "median step wall s", "median step CPU s",
                                 "peak RSS MB", "wall % teacher fwd / student fwd / loss / backward / optimizer"],
                                rows))
        elif peaks:
            tables.append(table(f"{model}: peak RSS of the heal step ({shape})", ["variant", "status", "peak RSS MB"],
                                [[v, r.get("status"), r.get("peak_rss_mb")] for v, r in peaks.items()]))
    for extra in raw.get("extra_tables", []):
        tables.append(extra)
    if raw.get("sweep"):
        rows = [[f"{r['head']} {r['hidden']} x {r['vocab']:,}", r["chunk"], r["status"], _r(r.get("median_cpu_s"), 2),
                 _r(r.get("median_wall_s"), 1), r.get("peak_above_inputs_mb")] for r in raw["sweep"]]
        tables.append(table(f"tlm_train.losses.head_loss alone, forward + backward, {raw.get('batch')} x "
                            f"{raw.get('seq_len')} positions, per chunk",
                            ["head (hidden x vocab)", "chunk", "status", "CPU s", "wall s", "peak MB above inputs"],
                            rows))
    return tables


def markdown_tables(text: str) -> list[dict]:
    """The pipe tables of a markdown text, each titled by the paragraph before it."""
    tables, title, lines = [], "", text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and lines[i + 1].startswith("|---"):
            cells = lambda line: [c.strip() for c in line.strip().strip("|").split("|")]  # noqa: E731
            columns, rows = cells(lines[i]), []
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(cells(lines[i]))
                i += 1
            tables.append(table(title, columns, rows))
            title = ""
        else:
            title = lines[i].strip() or title
            i += 1
    return tables


def evidence_tables(raw: dict) -> list[dict]:
    return markdown_tables(raw["summary"])


def compare_tables(raw: dict) -> list[dict]:
    """The plain reading of every pair, then each arm's held-out loss (mean ± std over seeds); the per-seed tables
    are the result file's ``summary``."""
    reading = table("Plain reading (" + raw["rule"] + ")",
                    ["study", "mixer", "N+M", "pair", "reading", "mean ± std (nats/token)", "first lower in"],
                    raw["reading"])
    rows = [[r["study"], s["mixer"], s["split"], arm, f"{a['mean']:.4f} ± {a['std']:.4f}", a["n"],
             "n/a" if a["seconds"] is None else f"{a['seconds']:.0f}"]
            for r in raw["studies"] for s in r["studies"] for arm, a in s["arms"].items()]
    arms = table("Held-out loss of every arm (the per-seed tables: the result file's summary)",
                 ["study", "mixer", "N+M", "arm", "eval loss, mean ± std", "seeds",
                  "wall s a run, mean (N-step run included)"], rows)
    return [reading, arms]


# ------------------------------------------------------------------------------------------------- registry


@dataclass
class Benchmark:
    name: str
    topic: str
    title: str
    argv: list[str]                  # the script (relative to the root) and its arguments for the real run
    quick: list[str] | None = None   # the arguments that make it a smoke test; None: no quick mode
    tables: Callable[[dict], list[dict]] | None = None
    out_flag: str | None = "--out"  # how the script is told where to write; None: the suite reads ``reads``
    reads: str | None = None         # the file such a script writes (relative to the root)
    png: str | None = None           # a picture the benchmark draws (relative to the root)
    notes: list[str] = field(default_factory=list)
    study: str | None = None         # the study it belongs to (bench/STUDIES.md); None: bench/RESULTS.md


BENCHMARKS = {b.name: b for b in [
    Benchmark("quality", "quality", "SmolLM2-135M conversion quality: one row of the ablation",
              ["bench/quality_ablation.py"], tables=None, out_flag=None,
              notes=["`python -m bench quality NAME [quality_ablation.py options]`: writes "
                     "bench/results/quality/NAME.json (a row of the quality table)."]),
    Benchmark("heal-curve", "heal", "Heal curve: perplexity after N heal tokens",
              ["bench/heal_curve.py"], out_flag=None, png="bench/results/heal_curve.png",
              notes=["`python -m bench heal-curve CONVERTED --work DIR --points N ... --out "
                     "bench/results/quality/heal_NAME.json`; redraws bench/results/heal_curve.png."]),
    Benchmark("demo", "quality", "The README's first command", ["bench/convert_run.py", "--readme"],
              quick=["--tiny"], tables=convert_run_tables, png=None),
    Benchmark("convert-time", "convert", "Conversion time against plain forward passes",
              ["bench/convert_time.py", "--threads", "2"], tables=convert_time_tables),
    Benchmark("memory", "convert", "Peak memory of the default SmolLM2-135M conversion",
              ["bench/convert_run.py", "--", "smollm2-135m"], quick=["--tiny"], tables=convert_run_tables),
    Benchmark("throughput", "throughput", "Training throughput per mixer (1 thread)",
              ["bench/throughput.py", "--threads", "1", "--steps", "3", "--warmup", "1", "--max-seconds", "0",
               "--models", "tlm_attention,tlm_gated_attention,tlm_hope_attention,tlm_hope_local,tlm_titans,"
               "tlm_titans_mag"],
              quick=["--quick", "--threads", "1", "--models", "tlm_attention,tlm_titans", "--seq-len", "32", "--batch",
                     "1", "--steps", "2"],
              tables=throughput_tables),
    Benchmark("low-memory", "low-memory", "`--low-memory` on a checkpoint larger than its memory",
              ["bench/low_memory.py"], quick=["--hidden", "64", "--intermediate", "128", "--layers", "2", "--heads",
                                              "4", "--kv-heads", "2", "--vocab", "512", "--calibration-tokens", "64",
                                              "--seq-len", "32"],
              tables=low_memory_tables, out_flag="--json"),
    Benchmark("gguf", "gguf", "`--export gguf` read by llama.cpp: logits, perplexity, greedy text",
              ["bench/gguf_check.py", "smollm2-135m"], tables=gguf_tables),
    Benchmark("gguf-tokenizer", "gguf", "The tokenizer read from a GGUF against llama.cpp's",
              ["bench/gguf_tokenizer_check.py", "gemma3-270m"], tables=gguf_tokenizer_tables),
    Benchmark("data-path", "data-path", "Data path against the training step", ["bench/data_path.py"],
              quick=["--corpus-mb", "1", "--batches", "4", "--train-steps", "2", "--shard-mb", "1"],
              tables=data_path_tables),
    Benchmark("evidence", "evidence", "Tapered vs uniform vs reverse from scratch; converted vs scratch",
              ["bench/evidence.py", "--workers", "2"], tables=evidence_tables, out_flag=None,
              reads="bench/results/studies/evidence/evidence.jsonl", study="evidence"),
    Benchmark("compare", "evidence", "Converted-then-trained vs trained as it is, and the shapes from scratch",
              ["bench/compare_study.py", "--jobs", "2"], tables=compare_tables,
              notes=["The runs are `tlm compare recipes/compare/NAME.yaml --seeds 0-4 --jobs 2` (the studies' "
                     "headers give the model, data and cost); curves: the `pictures` of the result file."],
              study="compare"),
    Benchmark("train-overhead", "other", "Framework overhead of `tlm train` against a bare loop",
              ["bench/train_overhead.py", "--rounds", "6", "--steps", "30"],
              quick=["--rounds", "1", "--steps", "2", "--warmup", "1"], tables=train_overhead_tables,
              out_flag="--json"),
    Benchmark("heal-step", "other", "The heal step: plain, whole-logit KL, chunked KL", ["bench/heal_step.py", "--gemma"],
              quick=["--quick", "--threads", "1"], tables=heal_step_tables, study="heal-step"),
    Benchmark("heal-chunk-sweep", "other", "The chunk of the chunked distillation loss",
              ["bench/heal_step.py", "--sweep", "--rss-steps", "2"], quick=["--sweep", "--quick", "--threads", "1"],
              tables=heal_step_tables, study="heal-step"),
    Benchmark("gemma3", "quality", "Gemma 3 270M: the second family, converted and healed",
              ["bench/convert_run.py", "--", "gemma3-270m", "--eval-data", "all-eval", "--heal-tokens", "24576"],
              tables=convert_run_tables),
    Benchmark("gpu", "other", "GPU run: the heal past the plateau, converted against continued, the training step, "
              "conversion at size", ["bench/gpu_check.py"], quick=["--dry"]),  # its own tables (bench/gpu_check.py)
    # zero-shot accuracy (lm-evaluation-harness): the script writes its own tables; ARGS name the models
    Benchmark("accuracy", "quality", "Zero-shot accuracy on the bundled suite", ["bench/eval_suite.py"]),
    Benchmark("accuracy-gemma3", "quality", "Zero-shot accuracy on the bundled suite: Gemma 3 270M",
              ["bench/eval_suite.py"]),
    Benchmark("eval-speed", "other", "`tlm eval --tasks` against lm-eval's own HFLM on the same checkpoint",
              ["bench/eval_speed.py"]),
]}


# ------------------------------------------------------------------------------------------------- running


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        names = re.findall(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
        cpu = names[0].strip() if names else cpu
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} CPUs"


def torch_version() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    return torch.__version__


def envelope(bench: Benchmark, raw: dict, command: str, quick: bool) -> dict:
    """``raw`` with the envelope keys of a result file (the script's own keys are kept)."""
    threads = raw.get("threads")
    out = {"benchmark": bench.name, "topic": bench.topic, "title": bench.title, "command": command,
           "machine": raw.get("machine") if isinstance(raw.get("machine"), str) else machine(),
           "torch": torch_version(), "threads": threads if isinstance(threads, int) else None,
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"), "quick": quick}
    if bench.png:
        out["png"] = bench.png
    if bench.notes:
        out["notes"] = bench.notes
    out.update({k: v for k, v in raw.items() if k not in out})
    out["tables"] = bench.tables(raw) if bench.tables else raw.get("tables", [])
    return out


def script_command(bench: Benchmark, quick: bool, extra: list[str]) -> list[str]:
    script, *args = bench.argv
    if quick:
        if bench.quick is None:
            raise SuiteError(f"{bench.name} has no --quick mode (it measures a real model); run it without --quick")
        # the quick arguments replace the real run's options (a script's positionals, before any option, stay)
        positional = [a for a in args[:next((i for i, a in enumerate(args) if a.startswith("-")), len(args))]]
        args = positional + bench.quick
    return [sys.executable, str(ROOT / script), *args, *extra]


def with_out(cmd: list[str], flag: str, path: Path) -> list[str]:
    """``cmd`` with ``flag path`` right after the script (before any ``--`` that ends its options)."""
    return [*cmd[:2], flag, str(path), *cmd[2:]]


def run(name: str, quick: bool = False, extra: list[str] | None = None, results_dir: Path | None = None) -> Path:
    """Run benchmark ``name`` and write its result file; returns its path."""
    bench = BENCHMARKS[name]
    extra = list(extra or [])
    target = result_path(name, results_dir or (QUICK_RESULTS if quick else None))
    target.parent.mkdir(parents=True, exist_ok=True)
    cmd = script_command(bench, quick, extra)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryDirectory() as tmp:
        raw_file = Path(tmp) / "raw.json"
        if bench.out_flag:
            cmd = with_out(cmd, bench.out_flag, raw_file)
        subprocess.run(cmd, check=True, cwd=ROOT, env=env)
        if bench.out_flag:
            raw = json.loads(raw_file.read_text())
        elif name == "evidence":
            sys.path.insert(0, str(BENCH))
            import evidence

            raw = {"summary": evidence.summary()}
        else:
            raw = {}
    shown = ["python", "-m", "bench", name, *(["--quick"] if quick else []), *extra]
    result = envelope(bench, raw, " ".join(shown), quick)
    target.write_text(json.dumps(result, indent=1) + "\n")
    return target


def stamp(path: Path, name: str, extra: list[str]) -> None:
    """Add the envelope keys to a file a wrapped script wrote itself (quality rows, heal curves)."""
    raw = json.loads(path.read_text())
    result = envelope(BENCHMARKS[name], raw, " ".join(["python", "-m", "bench", name, *extra]), False)
    result.pop("tables")
    path.write_text(json.dumps(result, indent=1) + "\n")


def run_wrapped(name: str, extra: list[str]) -> Path:
    """``quality`` and ``heal-curve``: the script writes its own file (under bench/results/quality/, or a study's
    folder under bench/results/studies/); the suite stamps the envelope on it."""
    if name == "quality" and (not extra or extra[0].startswith("-")):
        raise SuiteError("quality needs the row's NAME first: python -m bench quality NAME [quality_ablation options]")
    out = extra[extra.index("--out") + 1] if "--out" in extra and extra.index("--out") + 1 < len(extra) else ""
    if name == "heal-curve" and not out.startswith(("bench/results/quality/", "bench/results/studies/")):
        raise SuiteError("heal-curve needs --out bench/results/quality/heal_NAME.json (a choice's heal) or "
                         "bench/results/studies/STUDY/heal_NAME.json (a study's); the report reads heal curves there")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    subprocess.run(script_command(BENCHMARKS[name], False, extra), check=True, cwd=ROOT, env=env)
    if name == "quality":
        study = extra[extra.index("--study") + 1] if "--study" in extra else None
        path = (STUDIES / study if study else RESULTS / "quality") / f"{extra[0]}.json"
    else:
        path = ROOT / out
    stamp(path, name, extra)
    return path
