"""Does converting pay off at CPU scale? The studies of recipes/compare/ run (or collected) and read (issue 24).

    python bench/compare_study.py --out FILE [--studies cpu-attention,cpu-titans,cpu-shapes,cpu-measured,cpu-ratio150,
        cpu-ratio140,cpu-ratio125] [--seeds 0-4] [--jobs 2]

For each study file ``recipes/compare/NAME.yaml`` this is ``tlm compare recipes/compare/NAME.yaml --seeds S --jobs
J`` (tlm_study.compare.run_comparison: finished runs are collected, not rerun, so an interrupted benchmark
continues where it stopped), then its compare.md tables go into one result file with:

- a plain reading per mixer, split and pair, by one rule stated in the file: a pair's first arm **wins** when its
  mean paired difference is below zero by more than the difference's standard deviation over seeds and at least
  all but one seed agree in sign; **loses** by the same rule reversed; otherwise it is **within the noise**;
- every run's held-out loss and wall seconds (``runs``), and the curves drawn by tlm compare, copied to
  ``--png-dir`` as ``<study>_<mixer>_<split>.png`` (e.g. cpu_attention_attention_90_270.png).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tlm_study.compare import load_compare, run_comparison, select  # noqa: E402

STUDIES = ("cpu-attention", "cpu-titans", "cpu-shapes", "cpu-measured", "cpu-ratio150", "cpu-ratio140", "cpu-ratio125")
RULE = ("wins: mean paired difference < 0 by more than its std over seeds, and at least n-1 of n seeds lower; "
        "loses: the same reversed; else within the noise")


def verdict(pair: dict) -> str:
    """The plain reading of one paired difference (see RULE)."""
    n = len(pair["seeds"])
    if n < 2:
        return "too few seeds"
    if pair["mean"] < -pair["std"] and pair["negative"] >= n - 1:
        return "wins"
    if pair["mean"] > pair["std"] and pair["positive"] >= n - 1:
        return "loses"
    return "within the noise"


def reading(name: str, studies: list[dict]) -> list[list]:
    """One row per mixer, split and pair of study ``name``: [name, mixer, split, pair, verdict, mean ± std, seeds
    where the first is lower]."""
    return [[name, study["mixer"], study["split"], f"{p['first']} − {p['second']}", verdict(p),
             f"{p['mean']:+.4f} ± {p['std']:.4f}", f"{p['negative']}/{len(p['seeds'])}"]
            for study in studies for p in study["pairs"] if p["seeds"]]


def run_study(name: str, seeds: str | None, jobs: int, png_dir: Path) -> dict:
    spec = select(load_compare(ROOT / "recipes" / "compare" / f"{name}.yaml"), seeds)
    start = time.perf_counter()
    studies = run_comparison(spec, progress=False, jobs=jobs)
    out = Path(spec.output_dir)
    pngs = []
    for study in studies:
        src = out / f"curves-{spec.report}-{study['mixer']}-{study['split']}.png"
        if src.exists():
            dest = png_dir / f"{name.replace('-', '_')}_{study['mixer']}_{study['split'].replace('+', '_')}.png"
            shutil.copyfile(src, dest)
            pngs.append(dest.relative_to(ROOT).as_posix() if dest.is_relative_to(ROOT) else str(dest))
    runs = json.loads((out / f"{spec.report}.json").read_text())["runs"]
    return {"study": name, "command": f"tlm compare recipes/compare/{name}.yaml --seeds {seeds or 'the file'} "
                                      f"--jobs {jobs}",
            "collect_seconds": round(time.perf_counter() - start, 1),
            "markdown": (out / f"{spec.report}.md").read_text(), "reading": reading(name, studies), "studies": studies,
            "runs": [{k: r[k] for k in ("mixer", "seed", "split", "arm", "eval_loss", "params", "tokens", "seconds")}
                     for r in runs], "pictures": pngs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--studies", default=",".join(STUDIES))
    parser.add_argument("--seeds", default="0-4")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--png-dir", default=str(ROOT / "bench" / "results" / "studies" / "compare"))
    args = parser.parse_args()
    png_dir = Path(args.png_dir)
    png_dir.mkdir(parents=True, exist_ok=True)
    results = [run_study(name, args.seeds, args.jobs, png_dir) for name in args.studies.split(",")]
    summary = "\n\n".join(f"#### {r['study']} (`{r['command']}`)\n\n{r['markdown']}" for r in results)
    Path(args.out).write_text(json.dumps({"rule": RULE, "summary": summary, "studies": results,
                                          "reading": [line for r in results for line in r["reading"]],
                                          "pictures": [p for r in results for p in r["pictures"]]}, indent=1))


if __name__ == "__main__":
    main()
