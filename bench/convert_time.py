"""Conversion time against plain forward passes over the same calibration tokens (issue 3, item 9).

Side by side in one process, so that a slow phase of a shared machine hits both alike:

    A  plain forward passes: ``model(batch, use_cache=False)`` (logits included) over the calibration blocks,
       batch ``--batch-size``, no grad, the source model in fp32
    B  ``tlm_convert.convert`` end to end with the given options and no evaluation (load, calibrate, rank,
       resize, save), into a temporary folder
    A  again

and the ratio B / mean(A), for the total and for the calibrate + rank + resize phases alone, in wall seconds and in
the process's CPU seconds (user + sys of all its threads: on a shared machine the steadier of the two), with each
phase's CPU seconds (from the phase's start to the next one's) and the load average before and after. Run it from
the repository root:

    OMP_NUM_THREADS=1 python bench/convert_time.py --threads 1 --out bench/results/convert_time.json
    python bench/convert_time.py --set refit_target=local   # a method knob, as tlm-convert --set (docs/knobs.md)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as tlm_cli sets it, before torch loads OpenMP

import torch  # noqa: E402

from tlm_io.errors import ConversionError  # noqa: E402
from tlm_io.locate import resolve_builtin  # noqa: E402
from tlm_convert.convert import convert  # noqa: E402
from tlm_convert.options import SELF, ConvertOptions, calibration_sources, method_from  # noqa: E402
from tlm_io.load import load_model  # noqa: E402
from tlm_convert.samples import calibration_blocks  # noqa: E402


def plain_forward_seconds(source: str, opts: ConvertOptions) -> tuple[float, float]:
    """(wall, CPU) seconds of the plain forward passes over as many calibration blocks as ``convert`` uses (text
    sources only: the sampled ``self`` share is replaced by text, the same shapes)."""
    model, tokenizer, _ = load_model(source, opts.device)
    texts = tuple(s for s in calibration_sources(opts.calibration_data, opts.low_memory) if s != SELF) or ("default",)
    blocks, _ = calibration_blocks(tokenizer, texts, opts.seq_len, opts.calibration_tokens)
    start, cpu = time.perf_counter(), time.process_time()
    with torch.no_grad():
        for i in range(0, len(blocks), opts.batch_size):
            model(blocks[i : i + opts.batch_size], use_cache=False)
    return time.perf_counter() - start, time.process_time() - cpu


class PhaseCPU:
    """An ``on_phase`` callback: the process's CPU seconds per phase, each from its start to the next phase's."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._phase, self._start = None, 0.0

    def __call__(self, phase: str | None) -> None:
        now = time.process_time()
        if self._phase is not None:
            self.seconds[self._phase] = self.seconds.get(self._phase, 0.0) + now - self._start
        self._phase, self._start = phase, now


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--set", action="append", default=[], metavar="KNOB=VALUE",
                        help="a method knob, as tlm-convert --set, e.g. refit_target=local (docs/knobs.md)")
    parser.add_argument("--out", default="bench/results/convert_time.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    try:
        opts = ConvertOptions(method=method_from(args.set))
    except ConversionError as err:
        raise SystemExit(f"error: {err}") from None
    source = resolve_builtin(args.source)

    load_before = os.getloadavg()
    forward = [plain_forward_seconds(source, opts)]
    print(f"plain forward: {forward[0][0]:.1f} s (CPU {forward[0][1]:.1f} s)", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        start, cpu = time.perf_counter(), time.process_time()
        phase_cpu = PhaseCPU()
        report = convert(source, str(Path(tmp) / "out"), opts, on_phase=phase_cpu)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        phase_cpu(None)
    print(f"conversion: {wall:.1f} s (CPU {cpu:.1f} s)", flush=True)
    forward.append(plain_forward_seconds(source, opts))
    print(f"plain forward: {forward[1][0]:.1f} s (CPU {forward[1][1]:.1f} s)", flush=True)

    base = statistics.mean(f[0] for f in forward)
    phases = report["seconds"]
    core = phases["calibrate"] + phases["rank"] + phases["resize"]
    result = {
        "machine": platform.machine(), "threads": args.threads, "torch": torch.__version__,
        "options": opts.record(), "calibration_tokens": report["calibration_tokens"],
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "load_average_before_after": [list(load_before), list(os.getloadavg())],
        "plain_forward_seconds": [f[0] for f in forward], "plain_forward_cpu_seconds": [f[1] for f in forward],
        "conversion_wall_seconds": wall, "conversion_cpu_seconds": cpu, "seconds_per_phase": phases,
        "cpu_seconds_per_phase": phase_cpu.seconds,
        "ratio_total": wall / base, "ratio_calibrate_rank_resize": core / base,
        "ratio_total_without_sample": (wall - phases["sample"]) / base,
        "ratio_total_cpu": cpu / statistics.mean(f[1] for f in forward),
        "ratio_cpu_per_phase": {k: v / statistics.mean(f[1] for f in forward) for k, v in phase_cpu.seconds.items()},
        "params_before": report["params_before"], "params_after": report["params_after"],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"conversion / plain forward: total {result['ratio_total']:.2f}x (CPU {result['ratio_total_cpu']:.2f}x), "
          f"calibrate+rank+resize {result['ratio_calibrate_rank_resize']:.2f}x")


if __name__ == "__main__":
    main()
