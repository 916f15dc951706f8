"""One ``tlm-convert`` command end to end, as a user runs it: wall time, peak RSS and the report's figures.

    python bench/convert_run.py --readme --out bench/results/demo.json      # the README's first command
    python bench/convert_run.py --out bench/results/memory.json -- smollm2-135m   # the default conversion
    python bench/convert_run.py --tiny --out /tmp/c.json                    # a tiny random source: checks it runs

The command runs in a child process under ``/usr/bin/time -v`` where that exists (its "Maximum resident set size"
is the peak RSS; otherwise the report's ``peak_rss_mb``). The output folder is a temporary one unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the README's first command, less its ``-o`` and ``--overwrite`` (tests/test_bench.py checks it against README.md)
README_ARGS = ["smollm2-135m", "--calibration-tokens", "32768", "--eval-data", "all-eval", "--eval-tokens", "4096",
               "--heal-tokens", "8192"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--readme", action="store_true", help="run the README's first tlm-convert command")
    ap.add_argument("--tiny", action="store_true", help="convert a tiny random Llama (tests/tiny_sources.py)")
    ap.add_argument("--keep", default=None, help="write the converted model here and keep it")
    ap.add_argument("--out", default="bench/results/memory.json")
    ap.add_argument("args", nargs="*", help="tlm-convert's arguments (after --)")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        convert_args = list(args.args)
        if args.readme:
            convert_args = README_ARGS + convert_args
        if args.tiny:
            sys.path.insert(0, str(ROOT))
            from tests.tiny_sources import make_source

            source = make_source(Path(tmp) / "src")
            convert_args = [str(source), "--calibration-data", str(ROOT / "tests/data/shakespeare_slice.txt"),
                            "--calibration-tokens", "256", "--seq-len", "32", "--set", "multiple_of=1",
                            "--eval-data", str(ROOT / "tests/data/shakespeare_slice.txt"), "--eval-tokens", "128",
                            *convert_args]
        out_dir = Path(args.keep) if args.keep else Path(tmp) / "out"
        cmd = [sys.executable, "-m", "tlm_convert", *convert_args, "-o", str(out_dir), "--overwrite"]
        timer = ["/usr/bin/time", "-v"] if shutil.which("/usr/bin/time") else []
        start = time.perf_counter()
        proc = subprocess.run(timer + cmd, capture_output=True, text=True)
        wall = time.perf_counter() - start
        sys.stdout.write(proc.stdout)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr[-4000:])
            return proc.returncode
        report = json.loads((out_dir / "conversion_report.json").read_text())
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
    shown = ["tlm-convert", *(["<tiny random llama>"] + convert_args[1:] if args.tiny else convert_args),
             "-o", "OUT", "--overwrite"]
    result = {"tlm_convert": " ".join(shown), "wall_s": round(wall, 1),
              "peak_rss_mb": round(int(rss[1]) / 1024 if rss else report["peak_rss_mb"], 1),
              "rss_source": "/usr/bin/time -v" if rss else "conversion report", "report": report}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wall {wall:.0f} s, peak RSS {result['peak_rss_mb']:.0f} MB -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
