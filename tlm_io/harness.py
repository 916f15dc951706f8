"""Zero-shot accuracy through lm-evaluation-harness (the ``lm-eval`` package, the ``eval`` extra), in-process and
offline: the model ``tlm_io.load.load_model`` loaded reaches lm-eval's own HF model class (``HFLM``, which takes a
PreTrainedModel instance and its tokenizer), and lm-eval does all of the scoring.

Task names (docs/evaluation.md, "Zero-shot accuracy"): the standard suite's names (:data:`LOCAL_TASKS`) are lm-eval's
own task configs pointed at a local file (``dataset_path: json``): by default the samples bundled in
``tlm_io/data/tasks/`` (``task_data=None``), or the files of the same names in a folder the user gives (full sets);
``task_data="hub"`` leaves every name to lm-eval's own configs, read from the ``datasets`` cache. The user's own
tasks come through ``include_path`` (a task YAML and its data files), any other lm-eval task by its name.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .errors import ConversionError, first_few
from .sizes import available_memory

TASK_DATA = Path(__file__).resolve().parent / "data" / "tasks"  # the bundled samples (tlm_io/data/README.md)
EXTRA = 'pip install -e ".[eval]"'  # or: pip install "lm-eval>=0.4.13"
HUB = "hub"  # task_data: lm-eval's own task configs, from the datasets cache
REQUEST_TOKENS = 512  # a long request of the bundled suite (a BoolQ passage, a HellaSwag context): the logits' size
BOOTSTRAP_ITERS = 1000  # bootstrap resamples for the stderr of non-mean metrics (lambada's perplexity)


@dataclass(frozen=True)
class LocalTask:
    """lm-eval's task config ``base`` (relative to lm_eval/tasks/) on the local file ``file`` holding its
    ``split``; ``changes``: config keys set beside the data (None removes one)."""

    base: str
    split: str
    file: str
    changes: dict = field(default_factory=dict)


LOCAL_TASKS = {
    "arc_easy": LocalTask("arc/arc_easy.yaml", "test", "arc_easy.jsonl"),
    "arc_challenge": LocalTask("arc/arc_challenge.yaml", "test", "arc_challenge.jsonl"),
    "hellaswag": LocalTask("hellaswag/hellaswag.yaml", "validation", "hellaswag.jsonl"),
    "piqa": LocalTask("piqa/piqa.yaml", "validation", "piqa.jsonl"),
    "winogrande": LocalTask("winogrande/default.yaml", "validation", "winogrande.jsonl"),
    "boolq": LocalTask("super_glue/boolq/default.yaml", "validation", "boolq.jsonl"),
    "openbookqa": LocalTask("openbookqa/openbookqa.yaml", "test", "openbookqa.jsonl"),
    "lambada_openai": LocalTask("lambada/lambada_openai.yaml", "test", "lambada_openai.jsonl"),
    # the bundled stand-ins where lm-eval's exact items could not be had (tlm_io/data/README.md)
    "hellaswag_text": LocalTask("hellaswag/hellaswag.yaml", "validation", "hellaswag_text.jsonl",
                                {"process_docs": None, "tag": None}),
    "boolq_notitle": LocalTask("super_glue/boolq/default.yaml", "validation", "boolq_notitle.jsonl",
                               {"tag": None}),
}
# the bundled suite (``--tasks bundled``): one task of each of the standard eight, in the papers' order
BUNDLED = ("arc_easy", "arc_challenge", "hellaswag_text", "piqa", "winogrande", "boolq_notitle", "openbookqa",
           "lambada_openai")
STANDARD = {"hellaswag": "hellaswag_text", "boolq": "boolq_notitle"}  # lm-eval's name -> the bundled stand-in
CHANCE = {"arc_easy": 0.25, "arc_challenge": 0.25, "hellaswag": 0.25, "hellaswag_text": 0.25, "piqa": 0.5,
          "winogrande": 0.5, "boolq": 0.5, "boolq_notitle": 0.5, "openbookqa": 0.25, "lambada_openai": 0.0}
SPLIT_KEYS = {"train": "training_split", "validation": "validation_split", "test": "test_split"}


def require_lm_eval():
    """The lm_eval package, or one ConversionError naming the extra that installs it."""
    try:
        import lm_eval
    except ImportError:
        raise ConversionError(f"zero-shot evaluation needs lm-evaluation-harness, which is not installed; "
                              f"install the eval extra: {EXTRA}") from None
    return lm_eval


def parse_tasks(tasks: str | list[str] | tuple[str, ...]) -> list[str]:
    """Task names from ``"a,b"`` or a list, ``bundled`` expanded to :data:`BUNDLED`, duplicates dropped."""
    names = [t.strip() for item in ([tasks] if isinstance(tasks, str) else tasks) for t in item.split(",")]
    if not names or any(not n for n in names):
        raise ConversionError(f"--tasks {tasks!r}: give task names separated by commas, e.g. arc_easy,piqa "
                              f"(or 'bundled' for the bundled suite)")
    out = []
    for name in names:
        for n in (BUNDLED if name == "bundled" else (name,)):
            if n not in out:
                out.append(n)
    return out


def check_limit(limit: float | None) -> float | int | None:
    """lm-eval's --limit: a number of documents per task (an integer >= 1) or a fraction in (0, 1)."""
    if limit is None:
        return None
    if not math.isfinite(limit) or limit <= 0 or (limit >= 1 and limit != int(limit)):
        raise ConversionError(f"--limit {limit:g}: give a number of documents per task (a whole number >= 1) or "
                              "a fraction of each task between 0 and 1")
    return int(limit) if limit >= 1 else float(limit)


def task_folder(names: list[str], task_data: str | None, folder: Path) -> list[str]:
    """Write into ``folder`` one task YAML per name of :data:`LOCAL_TASKS` in ``names`` (lm-eval's own config,
    included by its path, on the local file); return the names written. ConversionError, naming the task and the
    file, when a file is missing. ``task_data``: None (the bundled samples), a folder, or "hub" (none written)."""
    if task_data == HUB:
        return []
    lm_eval = require_lm_eval()
    configs = Path(lm_eval.__file__).resolve().parent / "tasks"
    data = TASK_DATA if task_data is None else Path(task_data).expanduser()
    if task_data is not None and not data.is_dir():
        raise ConversionError(f"--task-data {task_data}: not a folder; give a folder holding the task files "
                              f"({first_few(sorted({t.file for t in LOCAL_TASKS.values()}))}) or 'hub'")
    written = []
    for name in names:
        task = LOCAL_TASKS.get(name)
        if task is None:
            continue
        path = data / task.file
        if not path.is_file():
            where = "the bundled samples" if task_data is None else str(data)
            instead = f"; the bundled stand-in is {STANDARD[name]}" if name in STANDARD and task_data is None else ""
            raise ConversionError(f"task {name} needs {task.file}, which {where} do not hold ({path} is missing)"
                                  f"{instead}; give a folder holding {task.file} with --task-data DIR, or use "
                                  "--task-data hub")
        config = {"include": str(configs / task.base), "task": name, "dataset_path": "json", "dataset_name": None,
                  "dataset_kwargs": {"data_files": {task.split: str(path.resolve())}},
                  **{key: (task.split if split == task.split else None) for split, key in SPLIT_KEYS.items()},
                  **task.changes}
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
        written.append(name)
    return written


def task_manager(names: list[str], include_path: list[str], folder: Path):
    """lm-eval's TaskManager over ``folder`` and the user's ``include_path``; lm-eval's own task index (seconds to
    build) only when a name is in neither. ConversionError for a name found nowhere."""
    from lm_eval.tasks import TaskManager

    for path in include_path:
        if not Path(path).exists():
            raise ConversionError(f"--include-path {path}: no such file or folder; give a folder of task YAMLs")
    paths = [str(folder), *include_path]
    manager = TaskManager(include_path=paths, include_defaults=False)
    if any(n not in manager.all_tasks for n in names):
        manager = TaskManager(include_path=paths)
    unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        raise ConversionError(f"unknown task {first_few(unknown)}: not a bundled task ({', '.join(BUNDLED)}), a "
                              "task of --include-path, or one of lm-eval's (lm-eval ls tasks)")
    return manager


class _TaskYaml(yaml.SafeLoader):
    """A task YAML's keys without running its code: ``!function`` tags read as None."""


_TaskYaml.add_constructor("!function", lambda loader, node: None)


def read_task_yaml(path: Path) -> dict:
    """A task YAML's keys, its ``include`` files' keys under them (lm-eval's order: the including file wins)."""
    config = yaml.load(Path(path).read_text(encoding="utf-8"), Loader=_TaskYaml) or {}  # noqa: S506 - SafeLoader
    includes = config.pop("include", None) or []
    merged: dict = {}
    for inc in includes if isinstance(includes, list) else [includes]:
        merged.update(read_task_yaml(Path(path).parent / inc))
    return {**merged, **config}


def check_task_files(manager, names: list[str]) -> None:
    """ConversionError naming the task and the file, for a task of the user's YAMLs whose local data file (a
    ``data_files`` entry of a file-based ``dataset_path``) is missing."""
    for name in names:
        entry = manager.task_index.get(name)
        if entry is None or getattr(entry, "yaml_path", None) is None:
            continue
        config = read_task_yaml(entry.yaml_path)
        files = (config.get("dataset_kwargs") or {}).get("data_files")
        if config.get("dataset_path") not in ("json", "csv", "parquet", "text", "arrow") or not files:
            continue
        for file in (files.values() if isinstance(files, dict) else [files]):
            for one in ([file] if isinstance(file, str) else file):
                if "*" not in one and "://" not in one and not Path(one).expanduser().is_file():
                    raise ConversionError(f"task {name}: its data file {one} is missing (data_files of "
                                          f"{entry.yaml_path}); put it there or fix the path")


@contextlib.contextmanager
def offline_datasets():
    """While inside: the ``datasets`` library reads its cache only, never the hub (nothing is downloaded)."""
    import datasets

    saved, env = datasets.config.HF_HUB_OFFLINE, os.environ.get("HF_DATASETS_OFFLINE")
    datasets.config.HF_HUB_OFFLINE = True
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE = saved
        if env is None:
            os.environ.pop("HF_DATASETS_OFFLINE", None)
        else:
            os.environ["HF_DATASETS_OFFLINE"] = env


def hf_model(model, tokenizer, batch_size: int = 8, max_length: int | None = None):
    """lm-eval's own HFLM around a loaded model instance (a TLMForCausalLM or any PreTrainedModel) and its
    tokenizer: no subclass, nothing of the scoring changed."""
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=batch_size,
                max_length=max_length)


def check_logits_memory(model, batch_size: int) -> None:
    """ConversionError when lm-eval's logits of one batch (batch x REQUEST_TOKENS x vocabulary, fp32, with their
    log-softmax) would not fit the memory left: the batch size that fits, named before any request runs."""
    vocab = getattr(model.config, "vocab_size", None) or 0
    per_row = REQUEST_TOKENS * vocab * 4 * 2
    free = available_memory()
    if per_row and batch_size * per_row > free:
        fits = max(1, free // per_row)
        raise ConversionError(f"--batch-size {batch_size}: lm-eval holds a batch's logits at once ({batch_size} x "
                              f"{REQUEST_TOKENS} tokens x {vocab:,} vocabulary entries, about "
                              f"{batch_size * per_row / 2**30:.1f} GiB with their log-softmax), more than the "
                              f"{free / 2**30:.1f} GiB free; use --batch-size {fits} or less")


def evaluate_tasks(model, tokenizer, tasks, *, limit: float | None = None, num_fewshot: int | None = None,
                   batch_size: int = 8, include_path: tuple[str, ...] | list[str] = (), task_data: str | None = None,
                   output_path: str | None = None, model_name: str = "model", max_length: int | None = None,
                   log_samples: bool = False) -> dict:
    """lm-eval's results dict (``results``, ``n-samples``, ``configs``, ...) of ``model`` on ``tasks`` (names or
    "a,b"; see the module doc), in-process and offline; also written as lm-eval's results JSON under
    ``output_path`` (``OUTPUT_PATH/MODEL_NAME/results_DATE.json``, as lm-eval's CLI writes it). ``log_samples``: each
    document's record too (``results["samples"]``, and lm-eval's ``samples_TASK_DATE.jsonl`` beside the results)."""
    require_lm_eval()
    names = parse_tasks(tasks)
    limit = check_limit(limit)
    if num_fewshot is not None and num_fewshot < 0:
        raise ConversionError(f"--num-fewshot {num_fewshot}: must be 0 or more")
    check_log_samples(log_samples, output_path)
    check_logits_memory(model, batch_size)
    from lm_eval import simple_evaluate
    from lm_eval.loggers import EvaluationTracker

    with tempfile.TemporaryDirectory(prefix="tlm-tasks-") as tmp, offline_datasets(), quiet_harness():
        task_folder(names, task_data, Path(tmp))
        manager = task_manager(names, [str(p) for p in include_path], Path(tmp))
        check_task_files(manager, names)
        tracker = EvaluationTracker(output_path=output_path) if output_path else None
        try:
            results = simple_evaluate(model=hf_model(model, tokenizer, batch_size, max_length), tasks=names,
                                      model_args={"pretrained": model_name}, task_manager=manager, limit=limit,
                                      num_fewshot=num_fewshot, bootstrap_iters=BOOTSTRAP_ITERS,
                                      log_samples=log_samples, evaluation_tracker=tracker)
        except (ConnectionError, FileNotFoundError) as err:  # a hub data set not in the cache
            raise ConversionError(f"tasks {', '.join(names)}: a data set is not available offline ({err}); use the "
                                  "bundled samples (no --task-data) or your own files (--task-data DIR)") from None
    samples = results.pop("samples", None)  # as lm-eval's CLI: the records go to their own files, not the results'
    if tracker is not None:
        tracker.save_results_aggregated(results=results, samples=samples)
        for task, records in (samples or {}).items():
            tracker.save_results_samples(task_name=task, samples=records)
    if samples is not None:
        results["samples"] = samples
    return results


def check_log_samples(log_samples: bool, output_path) -> None:
    if log_samples and not output_path:
        raise ConversionError("--log-samples writes each document's record under --output-path: give --output-path")


def sample_scores(samples_file: str | Path, metric: str = "acc") -> dict[int, float]:
    """{doc_id: the document's ``metric``} of one lm-eval ``samples_TASK_DATE.jsonl`` (``--log-samples``)."""
    scores = {}
    for line in Path(samples_file).read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        if metric in record:
            scores[int(record["doc_id"])] = float(record[metric])
    return scores


def accuracy_rows(results: dict) -> list[dict]:
    """One row per (task, metric) of lm-eval's results: task, metric, value, stderr (None where lm-eval gives
    none), n (documents scored)."""
    rows = []
    for task, metrics in results["results"].items():
        n = (results.get("n-samples", {}).get(task) or {}).get("effective")
        for key, value in metrics.items():
            metric, _, filt = key.partition(",")
            if not filt or metric.endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            stderr = metrics.get(f"{metric}_stderr,{filt}")
            rows.append({"task": task, "metric": metric, "value": float(value),
                         "stderr": float(stderr) if isinstance(stderr, (int, float)) else None, "n": n})
    return rows


def accuracy_summary(results: dict) -> dict[str, dict]:
    """{task: {"acc", "acc_stderr", "acc_norm"?, "acc_norm_stderr"?, "n"}} of lm-eval's results (the report's
    form); ``mean_acc``: the mean of the tasks' acc."""
    out: dict[str, dict] = {}
    for row in accuracy_rows(results):
        if row["metric"] in ("acc", "acc_norm"):
            entry = out.setdefault(row["task"], {"n": row["n"]})
            entry[row["metric"]] = row["value"]
            entry[row["metric"] + "_stderr"] = row["stderr"]
    return out


def accuracy_table(rows: list[dict]) -> str:
    """The rows of :func:`accuracy_rows` as one aligned text table: task, metric, value, stderr, n."""
    cells = [("task", "metric", "value", "stderr", "n")]
    cells += [(r["task"], r["metric"], f"{r['value']:.4f}", "" if r["stderr"] is None else f"{r['stderr']:.4f}",
               "" if r["n"] is None else str(r["n"])) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(5)]
    return "\n".join("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
                     .rstrip() for row in cells)


@contextlib.contextmanager
def quiet_harness():
    """While inside: lm-eval's notices (a model passed as an instance, ...) and the data sets' split bars off,
    lm-eval's prints sent to stderr (stdout stays the caller's); errors stay."""
    import datasets

    logger = logging.getLogger("lm_eval")
    level, bars = logger.level, datasets.is_progress_bar_enabled()
    logger.setLevel(logging.ERROR)
    datasets.disable_progress_bars()
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        logger.setLevel(level)
        if bars:
            datasets.enable_progress_bars()


def mean_accuracy(summary: dict[str, dict]) -> float | None:
    accs = [t["acc"] for t in summary.values() if "acc" in t]
    return sum(accs) / len(accs) if accs else None


def mean_accuracy_stderr(summary: dict[str, dict]) -> float | None:
    """The stderr of :func:`mean_accuracy`: the tasks' stderrs as independent, sqrt(sum s_i^2) / k; None where a
    task with an acc has no stderr."""
    errs = [t.get("acc_stderr") for t in summary.values() if "acc" in t]
    return None if not errs or None in errs else math.sqrt(sum(e * e for e in errs)) / len(errs)


__all__ = ["BOOTSTRAP_ITERS", "BUNDLED", "CHANCE", "REQUEST_TOKENS", "check_logits_memory", "EXTRA", "HUB", "LOCAL_TASKS", "LocalTask", "STANDARD", "TASK_DATA",
           "accuracy_rows", "accuracy_summary", "accuracy_table", "quiet_harness", "read_task_yaml", "sample_scores", "check_limit", "check_log_samples", "evaluate_tasks", "hf_model", "mean_accuracy", "mean_accuracy_stderr",
           "offline_datasets", "parse_tasks", "require_lm_eval", "task_folder", "task_manager"]
