"""Zero-shot accuracy of several models on the bundled suite (``tlm eval MODEL --tasks bundled``), one process a model:
per task acc / acc_norm ± stderr, the mean acc ± its stderr, its retention against the source, and each run's wall
time, CPU seconds and peak memory. Each run logs its documents (``--log-samples``; kept in its file as a string of
0s and 1s a task), so two models' mean accuracies are compared paired, on the same documents; ``--ood`` ranks the
models by accuracy beside their out-of-domain perplexity.

    python bench/eval_suite.py --models source=smollm2-135m default=runs/q/default [...] \\
        --work runs/accuracy --out bench/results/accuracy.json [--source source] [--limit N] [--batch-size 8]

Each model's result is its own file, WORK/LABEL.json, written when its run ends: a killed run keeps the models it
finished, and a second run skips them (same path, tasks and limit). ``--out`` gets the result file of
bench/README.md ("Result files"): the envelope keys and the tables bench/report.py renders.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE_TITLES = {"smollm2-135m": "SmolLM2-135M and its conversions", "gemma3-270m": "Gemma 3 270M and its conversions"}
BENCHMARK_OF = {"gemma3-270m": "accuracy-gemma3"}  # a source's own result file (bench/suite.py); else "accuracy"
SMOKE_LIMIT = 100  # fewer documents a task than this: a check that it runs, not a measurement
sys.path.insert(0, str(ROOT))

from bench.suite import machine, table, torch_version  # noqa: E402
from bench.tables import point_ood, result_files  # noqa: E402
from tlm_io.harness import (BUNDLED, CHANCE, accuracy_summary, mean_accuracy, mean_accuracy_stderr,  # noqa: E402
                            sample_scores)


def run_model(label: str, path: str, args) -> dict:
    """``tlm eval PATH --tasks ...`` in a child process: lm-eval's results, the child's wall, CPU and peak RSS."""
    out_dir = args.work / f"{label}-lm-eval"
    cmd = [sys.executable, "-m", "tlm_cli", "eval", path, "--tasks", args.tasks, "--batch-size", str(args.batch_size),
           "--output-path", str(out_dir), "--log-samples"] + (["--limit", str(args.limit)] if args.limit else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    t0 = time.perf_counter()
    child = subprocess.Popen(cmd, cwd=ROOT, env=env)
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{label}: tlm eval failed (exit {os.waitstatus_to_exitcode(status)}): {' '.join(cmd)}")
    results = json.loads(max(out_dir.rglob("results_*.json"), key=lambda p: p.stat().st_mtime).read_text())
    summary = accuracy_summary(results)
    return {"label": label, "path": path, "tasks": args.tasks, "limit": args.limit, "wall_s": round(wall, 1),
            "cpu_s": round(usage.ru_utime + usage.ru_stime, 1), "peak_rss_mb": round(usage.ru_maxrss / 1024),
            "accuracy": summary, "mean_acc": mean_accuracy(summary), "items": item_scores(out_dir, summary),
            "command": " ".join(cmd[1:])}


def item_scores(out_dir: Path, summary: dict) -> dict[str, str]:
    """{task: each document's acc in doc_id order, as a string of 0s and 1s} from the run's samples files: what a
    paired comparison of two models on the same documents needs."""
    items = {}
    for task in (t for t in summary if "acc" in summary[t]):
        files = sorted(out_dir.rglob(f"samples_{task}_*.jsonl"), key=lambda p: p.stat().st_mtime)
        scores = sample_scores(files[-1]) if files else {}
        if scores and set(scores.values()) <= {0.0, 1.0}:
            items[task] = "".join(str(int(scores[d])) for d in sorted(scores))
    return items


def pair_stderr(a: dict, b: dict) -> tuple[float | None, bool]:
    """The stderr of mean_acc(a) - mean_acc(b), and whether it is paired: over the same documents (each task's
    per-document differences, their variance / n, summed over tasks, / k^2) where both runs logged every task's
    documents; else the two stderrs as independent."""
    tasks = [t for t in a["accuracy"] if "acc" in a["accuracy"][t]]
    ia, ib = a.get("items") or {}, b.get("items") or {}
    if tasks and all(t in ia and t in ib and len(ia[t]) == len(ib[t]) > 1 for t in tasks):
        var = 0.0
        for t in tasks:
            d = [int(x) - int(y) for x, y in zip(ia[t], ib[t])]
            mean = sum(d) / len(d)
            var += sum((v - mean) ** 2 for v in d) / (len(d) - 1) / len(d)
        return math.sqrt(var) / len(tasks), True
    ea, eb = mean_accuracy_stderr(a["accuracy"]), mean_accuracy_stderr(b["accuracy"])
    return (None if ea is None or eb is None else math.hypot(ea, eb)), False


def cell(task: dict | None, key: str) -> str | None:
    if not task or key not in task:
        return None
    err = task.get(f"{key}_stderr")
    return f"{task[key]:.3f}" + ("" if err is None else f" ± {err:.3f}")


def ood_ratios(pairs: list[str]) -> dict[str, float]:
    """LABEL -> the OOD perplexity ratio its ``STEM[@TOKENS]`` names (a conversion row, or a heal curve's point)."""
    files, found = result_files(), {}
    for pair in pairs:
        label, _, ref = pair.partition("=")
        stem, _, tokens = ref.partition("@")
        if stem not in files:
            raise SystemExit(f"--ood {pair}: no result file {stem}.json under bench/results/")
        data = files[stem][1]
        if tokens:
            point = next((p for p in data.get("points", []) if p["tokens"] == int(tokens)), None)
            if point is None:
                raise SystemExit(f"--ood {pair}: {stem} has no heal point at {tokens} tokens")
            found[label] = point_ood(data, point)
        else:
            found[label] = data["ood_geomean"]
    return found


def ranking(runs: list[dict], ood: dict[str, float]) -> dict:
    """The models with an OOD ratio, best first by mean accuracy and by perplexity, and their concordant pairs; the
    pairs whose mean accuracies differ by more than 2 stderr of the difference (``resolved``, better first), and how
    many of those the perplexity puts in the same order."""
    rated = [r for r in runs if r["label"] in ood and r["mean_acc"] is not None]
    pairs = [(a, b) for i, a in enumerate(rated) for b in rated[i + 1:]]
    agree = sum((a["mean_acc"] - b["mean_acc"]) * (ood[b["label"]] - ood[a["label"]]) > 0 for a, b in pairs)
    errs = [pair_stderr(a, b) for a, b in pairs]
    resolved = [(a, b) if a["mean_acc"] > b["mean_acc"] else (b, a) for (a, b), (err, _) in zip(pairs, errs)
                if err is not None and abs(a["mean_acc"] - b["mean_acc"]) > 2 * err]
    return {"by_accuracy": [r["label"] for r in sorted(rated, key=lambda r: -r["mean_acc"])],
            "by_perplexity": [r["label"] for r in sorted(rated, key=lambda r: ood[r["label"]])],
            "concordant_pairs": agree, "pairs": len(pairs), "paired": sum(p for _, p in errs),
            "resolved": [(a["label"], b["label"]) for a, b in resolved],
            "resolved_concordant": sum(ood[a["label"]] < ood[b["label"]] for a, b in resolved)}


def against(run: dict, base: dict | None) -> str | None:
    """``run``'s mean accuracy minus the source's ± the stderr of the difference (pair_stderr)."""
    if base is None or run is base or run["mean_acc"] is None or base["mean_acc"] is None:
        return None
    err, _ = pair_stderr(run, base)
    return f"{run['mean_acc'] - base['mean_acc']:+.3f}" + ("" if err is None else f" ± {err:.3f}")


def task_head(task: str, base: dict | None) -> str:
    """``task (chance)``, with ``above`` where the source's acc is more than 2 stderr above chance."""
    if task not in CHANCE:
        return task
    acc = (base or {}).get("accuracy", {}).get(task, {})
    above = "acc" in acc and acc["acc"] - CHANCE[task] > 2 * (acc.get("acc_stderr") or 0)
    return f"{task} ({CHANCE[task]:g}{', above' if above else ''})"


def mean_cell(summary: dict) -> str | None:
    mean, err = mean_accuracy(summary), mean_accuracy_stderr(summary)
    return None if mean is None else f"{mean:.3f}" + ("" if err is None else f" ± {err:.3f}")


def tables(runs: list[dict], source: str | None, ood: dict[str, float] | None = None) -> list[dict]:
    ood = ood or {}
    tasks = [t for t in runs[0]["accuracy"]]
    base = next((r for r in runs if r["label"] == source), None)
    rows = []
    for r in runs:
        retention = None if base is None or not base["mean_acc"] else f"{100 * r['mean_acc'] / base['mean_acc']:.1f}%"
        rows.append([r["label"]] + [cell(r["accuracy"].get(t), "acc") for t in tasks]
                    + [mean_cell(r["accuracy"]), retention, against(r, base)]
                    + ([f"x{ood[r['label']]:.3f}" if r["label"] in ood else None] if ood else [])
                    + [f"{r['wall_s']:.0f} / {r['cpu_s']:.0f}", f"{r['peak_rss_mb'] / 1024:.1f}"])
    out = [table("acc ± stderr per task (head: chance; 'above': the source beats it by > 2 stderr); mean ± stderr; "
                 "retention; vs source: the mean's difference ± its stderr" + ("; OOD perplexity ratio" if ood else "")
                 + "; the run's wall / CPU s and peak RSS",
                 ["model", *(task_head(t, base) for t in tasks), "mean acc", "retention", "vs source"]
                 + (["OOD"] if ood else []) + ["wall / CPU s", "peak GB"], rows)]
    if ood:
        rank = ranking(runs, ood)
        out.append(table("the models ranked, best first: by mean accuracy and by OOD perplexity ratio",
                         ["by", "ranking", "pairs in the same order"],
                         [["mean accuracy", ", ".join(rank["by_accuracy"]), None],
                          ["OOD perplexity", ", ".join(rank["by_perplexity"]),
                           f"{rank['concordant_pairs']} of {rank['pairs']}"],
                          ["mean accuracy, the pairs apart by > 2 stderr of their difference ("
                           + ("paired: the same documents" if rank["paired"] == rank["pairs"] else
                              "unpaired" if not rank["paired"] else f"paired in {rank['paired']} of them") + ")",
                           ", ".join(f"{a} > {b}" for a, b in rank["resolved"]) or "none",
                           f"{rank['resolved_concordant']} of {len(rank['resolved'])} in the perplexity's order"
                           if rank["resolved"] else None]]))
    normed = [t for t in tasks if any("acc_norm" in r["accuracy"].get(t, {}) for r in runs)]
    if normed:
        out.append(table("acc_norm ± stderr (length-normalized), where the task has it", ["model", *normed],
                         [[r["label"]] + [cell(r["accuracy"].get(t), "acc_norm") for t in normed] for r in runs]))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", required=True, metavar="LABEL=PATH")
    ap.add_argument("--work", type=Path, required=True, help="one LABEL.json a model (kept: finished models skip)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--source", default=None, help="the label retention is measured against [the first model]")
    ap.add_argument("--tasks", default=",".join(BUNDLED))
    ap.add_argument("--limit", type=int, default=None,
                    help="the first N documents of each task's sample (below SMOKE_LIMIT: a smoke run, which the "
                         "report refuses)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--ood", nargs="*", default=[], metavar="LABEL=STEM[@TOKENS]",
                    help="a model's out-of-domain perplexity ratio, from the result file STEM of bench/results (a "
                         "conversion row, or a heal curve's point at TOKENS): shown and ranked beside its accuracy")
    args = ap.parse_args(argv)
    pairs = [m.split("=", 1) for m in args.models]
    if any(len(p) != 2 or not p[0] or not p[1] for p in pairs):
        ap.error("--models takes LABEL=PATH pairs")
    args.work.mkdir(parents=True, exist_ok=True)
    runs = []
    for label, path in pairs:
        done = args.work / f"{label}.json"
        old = json.loads(done.read_text()) if done.is_file() else None
        if old and (old["path"], old["tasks"], old["limit"]) == (path, args.tasks, args.limit):
            runs.append(old)
            continue
        runs.append(run_model(label, path, args))
        done.write_text(json.dumps(runs[-1], indent=1) + "\n")
    source = args.source or pairs[0][0]
    source_path = next((r["path"] for r in runs if r["label"] == source), source)
    raw = {"benchmark": BENCHMARK_OF.get(source_path, "accuracy"), "topic": "quality",
           "title": f"Zero-shot accuracy on the bundled suite: {SOURCE_TITLES.get(source_path, source_path)}",
           "command": "python bench/eval_suite.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "machine": machine(), "torch": torch_version(), "threads": None,
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
           "quick": args.limit is not None and args.limit < SMOKE_LIMIT, "limit": args.limit,
           "source": source, "runs": runs, "tables": tables(runs, source, ood_ratios(args.ood)),
           "notes": [f"each task's first {args.limit} documents of its bundled sample (drawn at random)" if args.limit
                     else "each task's whole bundled sample",
                     "tasks and items: tlm_io/data/README.md (hellaswag_text and boolq_notitle stand in for lm-eval's "
                     "hellaswag and boolq); stderr is lm-eval's (binomial, over the sample's items)",
                     "the mean's stderr takes the tasks as independent; a difference's stderr is paired (the same "
                     "documents, each run's logged answers) where both runs logged them, else the two as independent; "
                     "retention is % of the source's mean; one process a model"]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(raw, indent=1) + "\n")
    print(json.dumps({"out": str(args.out), "models": [r["label"] for r in runs]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
