"""``python -m bench``: list, run one benchmark, or regenerate bench/RESULTS.md, bench/STUDIES.md and the docs'
generated blocks (bench/suite.py runs, bench/report.py renders; neither imports the other)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from bench import report, suite


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(suite.__doc__)
        return 0
    if argv[0] == "list":
        for b in suite.BENCHMARKS.values():
            quick = "--quick" if b.quick is not None else "       "
            print(f"{b.name:17} {b.topic:11} {quick}  {' '.join(b.argv)}")
        return 0
    if argv[0] == "report":
        return report.main(argv[1:])
    ap = argparse.ArgumentParser(prog="python -m bench", description="run one benchmark")
    ap.add_argument("name", choices=sorted(suite.BENCHMARKS))
    ap.add_argument("--quick", action="store_true", help="tiny shapes: checks that it runs (not a measurement)")
    ap.add_argument("--results-dir", type=Path, default=None,
                    help="where the result file goes [bench/results; with --quick: runs/bench-quick]")
    args, extra = ap.parse_known_args(argv)
    try:
        if args.name in ("quality", "heal-curve"):
            if args.quick:
                print(f"error: {args.name} has no --quick mode (it measures a real model)", file=sys.stderr)
                return 2
            path = suite.run_wrapped(args.name, extra)
            if args.name == "heal-curve":
                report.draw_heal_curve()
        else:
            path = suite.run(args.name, args.quick, extra, args.results_dir)
    except suite.SuiteError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except subprocess.CalledProcessError as err:
        print(f"error: {args.name}: its script exited with {err.returncode}", file=sys.stderr)
        return err.returncode or 1
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
