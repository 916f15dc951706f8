"""``tlm compare``: converted vs from scratch, at equal parameters and equal total training tokens.

From one uniform from-scratch recipe (``base``) and a step split N + M, four runs:

  (a) ``uniform-scratch``   the base recipe for N + M steps
  (b) ``tapered-scratch``   the same with the taper (schedule / ratio) for N + M steps
  (c) ``converted-cpt``     the base for N steps (``uniform-pretrain``) -> tlm-convert to the taper -> M steps of
                            continued pretraining
  (d) ``uniform-continued`` the same N-step model continued for M steps without conversion (the control of (c))

(c) and (d) continue the data stream where the N-step run stopped (``data.skip_batches = N``), so all four see the
same N + M global batches; their M steps use ``cpt_optim`` (re-warm and decay) over the base optimizer settings.
A run whose folder already holds a finished model (``final/``) is collected instead of run again, and ``reuse``
maps a run name to an existing run folder, so comparisons can be assembled from earlier runs.

Writes ``compare.json`` (table and curves), ``loss_curves.png`` and ``compare.md`` into ``output_dir``.
"""

from __future__ import annotations

import copy
import json
import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from tlm_io.errors import RecipeError
from tlm_train.recipe import OptimSpec, apply_overrides, build_spec, recipe_from_dict
from tlm_train.trainer import list_checkpoints, train

from .convert import ConvertOptions, convert

logger = logging.getLogger(__name__)

RUN_NAMES = ("uniform-scratch", "tapered-scratch", "converted-cpt", "uniform-continued")


@dataclass
class CompareSpec:
    base: dict | str  # a from-scratch recipe (mapping, or a YAML path relative to the compare file) with a uniform model
    output_dir: str
    pretrain_steps: int  # N
    continue_steps: int  # M
    schedule: str = "cosine"
    ratio: str = "1.5/0.5"
    convert: dict = field(default_factory=dict)  # ConvertOptions fields (calibration_tokens, importance, grow_init, ...)
    cpt_optim: dict = field(default_factory=dict)  # optim overrides for the M continued steps of (c) and (d)
    reuse: dict = field(default_factory=dict)  # run name -> an existing run folder to collect instead of running


def load_compare(path: str | Path, overrides=()) -> CompareSpec:
    """Read and validate a compare YAML (every problem listed with its key path)."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"compare file '{path}' does not exist; pass a YAML file (see recipes/compare/)")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError:
        raise RecipeError(f"compare file '{path}' is not valid YAML; fix the syntax") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: expected a mapping at the top level")
    data = apply_overrides(data, overrides)
    errors: list[str] = []
    spec = build_spec(CompareSpec, data, "", errors)
    if spec is not None and isinstance(spec.base, str):
        base_path = (path.parent / spec.base) if not Path(spec.base).is_absolute() else Path(spec.base)
        if not base_path.is_file():
            errors.append(f"base: recipe '{base_path}' does not exist")
        else:
            spec.base = yaml.safe_load(base_path.read_text(encoding="utf-8"))
    if errors:
        raise RecipeError(f"{path}: {len(errors)} problem(s):\n" + "\n".join(f"  {e}" for e in errors))
    check_spec(spec)
    return spec


def check_spec(spec: CompareSpec) -> None:
    errors = []
    base = recipe_from_dict(spec.base, name="base")
    if base.model is None:
        errors.append("base: must be a from-scratch recipe (model:), not init_from")
    elif base.model.schedule != "uniform":
        errors.append(f"base.model.schedule: must be uniform (the taper is set by schedule/ratio), got "
                      f"{base.model.schedule}")
    for key in ("pretrain_steps", "continue_steps"):
        if getattr(spec, key) < 1:
            errors.append(f"{key}: must be >= 1, got {getattr(spec, key)}")
    for name in spec.reuse:
        if name not in RUN_NAMES + ("uniform-pretrain",):
            errors.append(f"reuse.{name}: unknown run (known: {', '.join(RUN_NAMES + ('uniform-pretrain',))})")

    known = set(ConvertOptions.__dataclass_fields__)
    for key in spec.convert:
        if key not in known:
            errors.append(f"convert.{key}: unknown ConvertOptions field")
    build_spec(OptimSpec, {**asdict(base.optim), **spec.cpt_optim}, "cpt_optim", errors)
    if errors:
        raise RecipeError("compare: " + str(len(errors)) + " problem(s):\n" + "\n".join(f"  {e}" for e in errors))


# ============================================================================================== recipes of the runs


def _with(base: dict, **changes) -> dict:
    """A deep copy of ``base`` with ``section__key=value`` changes applied."""
    r = copy.deepcopy(base)
    for dotted, value in changes.items():
        *parents, leaf = dotted.split("__")
        node = r
        for part in parents:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[leaf] = value
    return r


def run_recipes(spec: CompareSpec) -> dict[str, dict]:
    """The recipe (as a mapping) of every run, keyed by run name (``uniform-pretrain`` included)."""
    out, base, n, m = Path(spec.output_dir), spec.base, spec.pretrain_steps, spec.continue_steps
    total = n + m
    recipes = {
        "uniform-scratch": _with(base, output_dir=str(out / "uniform-scratch"), train__max_steps=total),
        "tapered-scratch": _with(base, output_dir=str(out / "tapered-scratch"), train__max_steps=total,
                                 model__schedule=spec.schedule, model__ratio=spec.ratio),
        "uniform-pretrain": _with(base, output_dir=str(out / "uniform-pretrain"), train__max_steps=n),
    }
    for name, source in (("converted-cpt", out / "converted"), ("uniform-continued", None)):
        r = _with(base, output_dir=str(out / name), train__max_steps=m, data__skip_batches=n,
                  init_from=str(source) if source else "", optim={**base.get("optim", {}), **spec.cpt_optim})
        r.pop("model", None)
        r.pop("tokenizer", None)
        recipes[name] = r
    recipes["uniform-continued"]["init_from"] = str(_run_dir(spec, "uniform-pretrain") / "final")
    for name in recipes:
        recipes[name]["output_dir"] = str(_run_dir(spec, name))
    return recipes


def _run_dir(spec: CompareSpec, name: str) -> Path:
    return Path(spec.reuse.get(name, Path(spec.output_dir) / name))


# ============================================================================================== running


def _finished(folder: Path) -> bool:
    return (folder / "final" / "config.json").is_file() and (folder / "metrics.jsonl").is_file()


def _train(recipe: dict, progress: bool) -> float | None:
    """Run (or collect) one recipe; returns its wall seconds from its run_summary.json (None when missing)."""
    folder = Path(recipe["output_dir"])
    if _finished(folder):
        logger.info("collected %s (already finished)", folder)
    else:
        resume = True if folder.exists() and list_checkpoints(folder) else None
        train(recipe_from_dict(recipe, name=folder.name), resume=resume, progress=progress)
    summary = folder / "run_summary.json"
    return json.loads(summary.read_text()).get("seconds") if summary.exists() else None


def _convert(spec: CompareSpec, recipes: dict) -> float | None:
    """Convert the N-step uniform model (unless done); returns the conversion's seconds from its report."""
    out = Path(spec.output_dir) / "converted"
    if not (out / "config.json").is_file():
        base = recipe_from_dict(spec.base)
        options = {"schedule": spec.schedule, "ratio": spec.ratio, "calibration_data": base.data.train,
                   "seq_len": base.data.seq_len, "seed": base.seed, "multiple_of": base.model.multiple_of,
                   **spec.convert}
        convert(str(_run_dir(spec, "uniform-pretrain") / "final"), str(out), ConvertOptions(**options))
    report = out / "conversion_report.json"
    return sum(json.loads(report.read_text())["seconds"].values()) if report.exists() else None


def _metrics(folder: Path) -> list[dict]:
    path = folder / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def run_comparison(spec: CompareSpec, progress: bool = True) -> list[dict]:
    """Run (or collect) the four runs; write compare.json / compare.md / loss_curves.png; return the table rows."""
    check_spec(spec)
    out = Path(spec.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    recipes = run_recipes(spec)
    seconds = {}
    for name in ("uniform-scratch", "tapered-scratch", "uniform-pretrain"):
        seconds[name] = _train(recipes[name], progress)
    seconds["convert"] = _convert(spec, recipes)
    for name in ("converted-cpt", "uniform-continued"):
        seconds[name] = _train(recipes[name], progress)
    rows, curves = _collect(spec, recipes, seconds)
    (out / "compare.json").write_text(json.dumps({"spec": asdict(spec), "rows": rows, "curves": curves}, indent=1))
    (out / "compare.md").write_text(format_table(rows) + "\n")
    plot_curves(curves, out / "loss_curves.png")
    return rows


def _collect(spec: CompareSpec, recipes: dict, seconds: dict) -> tuple[list[dict], dict]:
    pre = _metrics(_run_dir(spec, "uniform-pretrain"))
    offset = max((m["tokens"] for m in pre), default=0)  # the N-step run's tokens
    rows, curves = [], {}
    for name in RUN_NAMES:
        folder = _run_dir(spec, name)
        lines = _metrics(folder)
        shift = offset if name in ("converted-cpt", "uniform-continued") else 0
        train_curve = [(m["tokens"] + shift, m["loss"]) for m in lines if "loss" in m]
        eval_curve = [(m["tokens"] + shift, m["eval_loss"]) for m in lines if "eval_loss" in m]
        if shift:  # the shared N-step prefix belongs to both curves
            train_curve = [(m["tokens"], m["loss"]) for m in pre if "loss" in m] + train_curve
            eval_curve = [(m["tokens"], m["eval_loss"]) for m in pre if "eval_loss" in m] + eval_curve
        curves[name] = {"train": train_curve, "eval": eval_curve}
        final_eval = eval_curve[-1][1] if eval_curve else float("nan")
        parts = [seconds.get(name)] + ([seconds.get("uniform-pretrain")] if shift else []) + \
            ([seconds.get("convert")] if name == "converted-cpt" else [])
        wall = None if None in parts else sum(parts)  # None: a collected run without its wall time
        rows.append({"run": name, "params": _params(folder / "final"), "tokens": train_curve[-1][0] if train_curve else 0,
                     "eval_loss": final_eval, "perplexity": math.exp(min(final_eval, 50.0)), "seconds": wall})
    return rows, curves


def _params(folder: Path) -> int:
    from safetensors import safe_open

    total = 0
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for k in f.keys():
                total += math.prod(f.get_slice(k).get_shape())
    return total


def format_table(rows: list[dict]) -> str:
    lines = ["| run | params | tokens | eval loss | perplexity | wall s (incl. shared prefix) |", "|---|---|---|---|---|---|"]
    for r in rows:
        wall = "n/a" if r["seconds"] is None else f"{r['seconds']:.0f}"
        lines.append(f"| {r['run']} | {r['params']:,} | {r['tokens']:,} | {r['eval_loss']:.4f} | "
                     f"{r['perplexity']:.3f} | {wall} |")
    return "\n".join(lines)


def plot_curves(curves: dict, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.5))
    FigureCanvasAgg(fig)
    ax_train, ax_eval = fig.subplots(1, 2)
    for name, c in curves.items():
        if c["train"]:
            ax_train.plot(*zip(*c["train"]), label=name, linewidth=1)
        if c["eval"]:
            ax_eval.plot(*zip(*c["eval"]), marker="o", label=name, linewidth=1)
    for ax, title in ((ax_train, "training loss"), (ax_eval, "held-out loss")):
        ax.set_xlabel("training tokens")
        ax.set_ylabel("loss (nats/token)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    ax_eval.legend(fontsize=8)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    tmp.replace(path)


__all__ = ["CompareSpec", "load_compare", "run_comparison", "run_recipes", "format_table", "RUN_NAMES"]
