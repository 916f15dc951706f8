"""``tlm-convert --eval-tasks``: the zero-shot accuracy of the source, the converted and the healed model, through
lm-evaluation-harness (tlm_io.harness), in the report beside the perplexities.

``report["accuracy"]``: ``tasks`` (the names), and per model (``source``, ``converted``, ``healed``) each task's
``acc`` (and ``acc_norm`` where the task has it) with their standard errors and ``n`` documents, the ``mean`` of
the tasks' acc, and ``retention`` (the mean acc as a share of the source's).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from tlm_io.errors import ConversionError
from tlm_io.harness import (BUNDLED, accuracy_summary, evaluate_tasks, mean_accuracy, parse_tasks, require_lm_eval,
                            task_folder)

STAGES = ("source", "converted", "healed")


class TaskAccuracy:
    """The accuracy phase of one conversion: :meth:`score` each model as the conversion reaches it (a no-op when
    ``tasks`` is None) into :meth:`entries`, the report's ``accuracy``. Checked when made: lm-eval installed, the
    task names' data present (bundled ones), the model in memory."""

    def __init__(self, tasks: str | None, tokenizer, batch_size: int, timer, low_memory: bool = False):
        self.tasks, self.tokenizer, self.batch_size, self.timer = tasks, tokenizer, batch_size, timer
        self.entry: dict = {}
        if tasks is None:
            return
        if low_memory:
            raise ConversionError("--eval-tasks evaluates the whole model in memory; drop --low-memory, or run "
                                  "tlm eval OUTPUT --tasks ... afterwards")
        require_lm_eval()
        self.names = parse_tasks(tasks)
        with tempfile.TemporaryDirectory() as tmp:  # a missing data file fails now, not after the conversion
            task_folder(self.names, None, Path(tmp))
        self.entry.update(tasks=self.names, data="bundled samples" if set(self.names) <= set(BUNDLED)
                          else "bundled samples and lm-eval's tasks")

    def entries(self) -> dict:
        """The report's ``accuracy`` key (filled in by each :meth:`score`), or nothing without tasks."""
        return {"accuracy": self.entry} if self.tasks is not None else {}

    def score(self, stage: str, model=None, load=None) -> None:
        """Evaluate ``model`` (or ``load()``'s, loaded only when there are tasks) as ``stage`` of STAGES."""
        if self.tasks is None:
            return
        with self.timer("eval"):
            model = load() if model is None else model
            results = evaluate_tasks(model, self.tokenizer, self.names, batch_size=self.batch_size)
        summary = accuracy_summary(results)
        entry = self.entry
        entry[stage] = {"tasks": summary, "mean": mean_accuracy(summary)}
        source = entry.get("source", {}).get("mean")
        if stage != "source" and source:
            entry[stage]["retention"] = entry[stage]["mean"] / source


def accuracy_lines(report: dict) -> list[str]:
    """One line per task and one for the mean: acc ± stderr of the source, converted and healed models, the
    retention in % of the source's (CLI summary and report.md); [] without --eval-tasks."""
    entry = report.get("accuracy")
    if not entry:
        return []
    stages = [s for s in STAGES if s in entry]
    lines = []
    for task in entry["tasks"]:
        parts = []
        for stage in stages:
            t = entry[stage]["tasks"].get(task, {})
            if "acc" in t:
                err = "" if t.get("acc_stderr") is None else f" ± {t['acc_stderr']:.3f}"
                parts.append(f"{t['acc']:.3f}{err} {stage}")
        n = next((entry[s]["tasks"].get(task, {}).get("n") for s in stages), None)
        lines.append(f"{task} ({n} items): " + ", ".join(parts))
    means = [f"{entry[s]['mean']:.3f} {s}" + (f" ({100 * entry[s]['retention']:.1f}% of the source)"
                                               if "retention" in entry[s] else "") for s in stages
             if entry[s].get("mean") is not None]
    if means:
        lines.append("mean acc: " + ", ".join(means))
    return lines


__all__ = ["STAGES", "TaskAccuracy", "accuracy_lines"]
