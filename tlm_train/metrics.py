"""What a run reports: ``metrics.jsonl`` (one JSON line per logged step or evaluation), TensorBoard scalars when
``log.tensorboard`` is on, and ``run_summary.json`` (where the run stands, with the wall time of every invocation).
Rank 0 writes them; on the other ranks every call does nothing.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from tlm_io.errors import TrainError

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "run_summary.json"


class MetricsLog:
    """``output_dir/metrics.jsonl`` (and TensorBoard) of a run at ``step``: a resumed run first drops the lines
    logged after its checkpoint, so the file reads as one uninterrupted run."""

    def __init__(self, out: Path, step: int, main: bool, tensorboard: bool):
        self.path, self.main, self.tb = Path(out) / METRICS_FILE, main, None
        if main and self.path.exists():
            lines = [ln for ln in self.path.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
            kept = []
            for number, line in enumerate(lines, 1):
                try:
                    keep = json.loads(line).get("step", 0) <= step
                except (ValueError, AttributeError, TypeError):
                    raise TrainError(f"{self.path} line {number} is not a metrics record (JSON with a step); fix or "
                                     "delete that line, then resume") from None
                if keep:
                    kept.append(line)
            self.path.write_text("".join(ln + "\n" for ln in kept))
        if main and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(Path(out) / "tensorboard"))
            except ImportError:  # tensorboard is optional
                self.tb = None

    def log(self, record: dict) -> None:
        if not self.main:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, record["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def write_summary(out: Path, steps: int, tokens: int, eval_loss: float | None, finished: bool, precision: str,
                  seconds: float) -> None:
    """``output_dir/run_summary.json``; ``seconds`` (this invocation's) is added to those of the earlier ones."""
    path = Path(out) / SUMMARY_FILE
    try:
        previous = json.loads(path.read_text()).get("invocation_seconds", []) if path.exists() else []
        previous = [float(x) for x in previous]
    except (OSError, ValueError, TypeError, AttributeError):
        warnings.warn(f"{path} was damaged; its earlier invocation times are dropped", stacklevel=2)
        previous = []
    summary = {"steps": steps, "tokens": tokens, "eval_loss": eval_loss, "finished": finished,
               "precision": precision, "invocation_seconds": previous + [round(seconds, 3)]}
    summary["seconds"] = round(sum(summary["invocation_seconds"]), 3)
    path.write_text(json.dumps(summary, indent=1))


__all__ = ["MetricsLog", "write_summary", "METRICS_FILE", "SUMMARY_FILE"]
