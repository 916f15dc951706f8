"""``tlm compare``: does converting pay off? A multi-seed, multi-split, multi-mixer study at equal parameters and
equal training tokens.

From one uniform from-scratch recipe (``base``), for every mixer, seed and split N + M (steps), the arms:

  (a) ``uniform-scratch``   the uniform model trained N + M steps
  (b) ``tapered-scratch``   the same with the taper (``schedule`` / ``ratio``), N + M steps
  (c) ``converted-cpt``     the uniform model after N steps -> tlm-convert to the taper -> M more steps
  (d) ``uniform-continued`` the same N-step model, M more steps without conversion (the control of (c))
  ``<name>-scratch``        more from-scratch shapes (``shapes``: name -> schedule / ratio), like (b)

The learning-rate plan (:data:`LR_PLAN`): every arm follows one warmup-stable-decay schedule of N + M steps (the
base recipe's lr, min_lr and warmup_steps; ``optim.decay: wsd``, the last ``decay_fraction`` of the steps decaying).
Its first N steps do not depend on M, so the N-step runs are shared by every split of a seed: (a), (b) and the
shapes are the N-step run resumed (optimizer state and all) to N + M, which is the uninterrupted run. (c) and (d)
model a released checkpoint, which has no optimizer state: both start step N from the N-step weights with a fresh
AdamW, follow the same global schedule from step N (``optim.step_offset: N``; no restart of the decay) after a
linear re-warm of ``rewarm_steps`` steps to the schedule's rate, identical in (c) and (d), and continue the data
stream where step N stopped (``data.skip_batches: N``), so every arm sees the same N + M global batches.

Layout: ``output_dir/<mixer>/seed<k>/<run>``, one folder per run: ``uniform-N<n>``, ``tapered-N<n>``,
``<shape>-N<n>`` (the shared N-step runs), ``converted-N<n>`` (the conversion), ``<arm>-<n>+<m>``. A run whose
folder holds a finished model is collected, not rerun; an interrupted one resumes from its last checkpoint.
Writes ``compare.json`` (every run, with its curves, and the tables), ``compare.md`` (per mixer and split: each
arm's mean ± std over seeds and the paired differences per seed with their sign agreement) and one
``curves-compare-<mixer>-<n>+<m>.png`` per study (mean ± std bands over seeds) into ``output_dir`` (``report``
renames them: two studies sharing runs in one output_dir, say the conversion study and a shapes study).
"""

from __future__ import annotations

import copy
import json
import logging
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from tlm import SCHEDULES, parse_ratio
from tlm_io.errors import RecipeError
from tlm_train.prepare import prepare_data
from tlm_train.recipe import apply_overrides, build_spec, recipe_from_dict
from tlm_train.trainer import list_checkpoints, train, wsd_decay_start

from tlm_convert.convert import convert
from tlm_convert.options import KNOBS, USER_OPTIONS, options_from

logger = logging.getLogger(__name__)

ARMS = ("uniform-scratch", "tapered-scratch", "converted-cpt", "uniform-continued")
CONTINUED = ("converted-cpt", "uniform-continued")  # fresh optimizer from step N
LR_PLAN = ("one warmup-stable-decay schedule over N + M steps for every arm; (a), (b) and the shapes are the shared "
           "N-step run resumed to N + M (uninterrupted); (c) and (d) start step N from the N-step weights with fresh "
           "AdamW state and follow the same schedule from step N after a re-warm of {rewarm} steps, identical in both")


@dataclass
class CompareSpec:
    base: dict | str  # a from-scratch recipe (mapping, or a YAML path relative to the compare file), uniform model
    output_dir: str
    splits: list[str] = field(default_factory=lambda: ["90+60"])  # "N+M": N shared steps, M continued steps
    seeds: list[int] | None = None  # None: the base recipe's seed
    mixers: dict = field(default_factory=dict)  # mixer name -> model.config overrides; empty: the base's mixer
    schedule: str = "cosine"  # the taper of (b) and the conversion target of (c)
    ratio: str = "1.5/0.5"
    shapes: dict = field(default_factory=dict)  # name -> {schedule, ratio}: more from-scratch arms "<name>-scratch"
    arms: list[str] | None = None  # the arms to run; None: the four and every shape
    convert: dict = field(default_factory=dict)  # tlm-convert's options and method knobs (calibration_tokens, ...)
    decay_fraction: float = 0.2  # the wsd schedule's decaying share of N + M
    rewarm_steps: int = 5  # (c) and (d): the ramp to the schedule's rate on a fresh optimizer
    report: str = "compare"  # the report files' name in output_dir (<report>.json, .md, curves-<report>-*.png), so
    # studies that share runs (one output_dir) keep their own tables


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


# ============================================================================================== parsing


def parse_split(text) -> tuple[int, int]:
    """``"90+60"`` -> (90, 60); RecipeError otherwise."""
    parts = str(text).split("+")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise RecipeError(f"split {text!r}: expected N+M with positive step counts, e.g. 90+60")
    return int(parts[0]), int(parts[1])


def parse_seeds(text: str) -> list[int]:
    """``"0-4"`` -> [0, 1, 2, 3, 4]; ``"0,2,7"`` and ``"0-2,7"`` likewise; RecipeError otherwise."""
    seeds: list[int] = []
    for part in str(text).split(","):
        low, dash, high = part.strip().partition("-")
        if not low.isdigit() or (dash and not high.isdigit()) or (dash and int(high) < int(low)):
            raise RecipeError(f"--seeds {text!r}: expected seeds such as 0-4 or 0,2,7")
        seeds += list(range(int(low), int(high) + 1)) if dash else [int(low)]
    if len(set(seeds)) != len(seeds):
        raise RecipeError(f"--seeds {text!r} names a seed twice")
    return seeds


def select(spec: CompareSpec, seeds: str | None = None, splits: str | None = None,
           mixers: str | None = None) -> CompareSpec:
    """``spec`` with the command line's ``--seeds 0-4``, ``--split 90+60,90+270`` and ``--mixer a,b`` applied (a
    mixer the compare file does not list gets no config overrides)."""
    spec = copy.deepcopy(spec)
    if seeds:
        spec.seeds = parse_seeds(seeds)
    if splits:
        spec.splits = [s.strip() for s in splits.split(",")]
    if mixers:
        known = mixer_overrides(spec)
        spec.mixers = {name.strip(): known.get(name.strip(), {}) for name in mixers.split(",")}
    check_spec(spec)
    return spec


# ============================================================================================== checks


def check_spec(spec: CompareSpec) -> None:
    """Every problem of ``spec`` at once (RecipeError)."""
    errors: list[str] = []
    base = recipe_from_dict(spec.base, name="base")
    if base.model is None:
        errors.append("base: must be a from-scratch recipe (model:), not init_from")
    elif base.model.schedule != "uniform":
        errors.append(f"base.model.schedule: must be uniform (the taper is set by schedule/ratio), got "
                      f"{base.model.schedule}")
    for i, text in enumerate(spec.splits or []):
        try:
            n, m = parse_split(text)
        except RecipeError as err:
            errors.append(f"splits[{i}]: {err}")
            continue
        errors += _split_problems(spec, base, n, m, i)
    if not spec.splits:
        errors.append("splits: give at least one N+M split")
    if spec.seeds is not None and (not spec.seeds or len(set(spec.seeds)) != len(spec.seeds)):
        errors.append(f"seeds: expected distinct seeds, got {spec.seeds}")
    for name, extra in spec.shapes.items():
        if name in ("uniform", "tapered", "converted") or not str(name).replace("-", "").replace("_", "").isalnum():
            errors.append(f"shapes.{name}: use another name (letters, digits, - and _; not uniform, tapered or "
                          "converted)")
        elif not isinstance(extra, dict) or set(extra) - {"schedule", "ratio"} or "schedule" not in extra:
            errors.append(f"shapes.{name}: expected {{schedule: NAME, ratio: A/B}} (ratio optional)")
        elif str(extra["schedule"]) not in SCHEDULES:
            errors.append(f"shapes.{name}.schedule: unknown {extra['schedule']!r} (known: {', '.join(SCHEDULES)})")
    known = all_arms(spec)
    for arm in spec.arms or []:
        if arm not in known:
            errors.append(f"arms: unknown arm {arm!r} (known: {', '.join(known)})")
    for name, extra in spec.mixers.items():
        if not isinstance(extra, dict):
            errors.append(f"mixers.{name}: expected a mapping of model.config overrides (or {{}})")
    for key in spec.convert:
        if key not in USER_OPTIONS + KNOBS:
            errors.append(f"convert.{key}: neither a tlm-convert option nor a method knob (docs/knobs.md)")
    if not 0 <= spec.decay_fraction < 1:
        errors.append(f"decay_fraction: must be in [0, 1), got {spec.decay_fraction}")
    if not spec.report or not spec.report.replace("-", "").replace("_", "").isalnum():
        errors.append(f"report: {spec.report!r} is not a file name (letters, digits, - and _)")
    if spec.rewarm_steps < 0:
        errors.append(f"rewarm_steps: must be >= 0, got {spec.rewarm_steps}")
    try:
        parse_ratio(spec.ratio)
    except ValueError as err:
        errors.append(f"ratio: {err}")
    if errors:
        raise RecipeError("compare: " + str(len(errors)) + " problem(s):\n" + "\n".join(f"  {e}" for e in errors))


def _split_problems(spec: CompareSpec, base, n: int, m: int, i: int) -> list[str]:
    optim = _plan_optim(spec, base.optim)
    problems = []
    if base.optim.warmup_steps > n:
        problems.append(f"splits[{i}]: N={n} ends inside the warmup ({base.optim.warmup_steps} steps); raise N or "
                        "lower optim.warmup_steps")
    if wsd_decay_start(n + m, optim) < n:
        problems.append(f"splits[{i}]: the decay of {n}+{m} would begin at step {wsd_decay_start(n + m, optim)}, "
                        f"before N={n}, so the N-step run could not be shared; raise M or lower decay_fraction")
    if m < spec.rewarm_steps:
        problems.append(f"splits[{i}]: M={m} is shorter than rewarm_steps {spec.rewarm_steps}")
    return problems


def all_arms(spec: CompareSpec) -> tuple[str, ...]:
    return ARMS + tuple(f"{name}-scratch" for name in spec.shapes)


def chosen_arms(spec: CompareSpec) -> tuple[str, ...]:
    return tuple(spec.arms) if spec.arms else all_arms(spec)


def mixer_overrides(spec: CompareSpec) -> dict[str, dict]:
    """mixer name -> model.config overrides (the base's own mixer alone when ``mixers`` is empty)."""
    if spec.mixers:
        return {name: dict(extra or {}) for name, extra in spec.mixers.items()}
    config = spec.base.get("model", {}).get("config", {})
    mixer = config.get("mixer", "attention")
    return {mixer if isinstance(mixer, str) else "mixed": {}}


def seeds_of(spec: CompareSpec) -> list[int]:
    return list(spec.seeds) if spec.seeds is not None else [int(spec.base.get("seed", 0))]


def splits_of(spec: CompareSpec) -> list[tuple[int, int]]:
    return [parse_split(s) for s in spec.splits]


# ============================================================================================== recipes


def _plan_optim(spec: CompareSpec, optim):
    """The base's OptimSpec on the plan's wsd schedule."""
    o = copy.deepcopy(optim)
    o.decay, o.decay_fraction = "wsd", spec.decay_fraction
    return o


def prefix_schedule_steps(n: int, optim) -> int:
    """The shortest wsd schedule whose decay starts at or after step ``n``: an N-step run of it is the first N
    steps of every longer one (the schedule is flat from the warmup to its decay)."""
    total = n
    while wsd_decay_start(total, optim) < n:
        total += 1
    return total


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


def seed_dir(spec: CompareSpec, mixer: str, seed: int) -> Path:
    return Path(spec.output_dir) / mixer / f"seed{seed}"


def _taper_of(spec: CompareSpec, kind: str) -> dict:
    """model.schedule / ratio of a prefix kind: uniform, tapered or a shape name."""
    if kind == "uniform":
        return {"schedule": "uniform"}
    if kind == "tapered":
        return {"schedule": spec.schedule, "ratio": spec.ratio}
    return {"ratio": spec.ratio, **spec.shapes[kind]}


def _kind(arm: str) -> str:
    """The N-step run an arm starts from: uniform, tapered or a shape name."""
    if arm in ("uniform-scratch",) + CONTINUED:
        return "uniform"
    return "tapered" if arm == "tapered-scratch" else arm[: -len("-scratch")]


def run_recipes(spec: CompareSpec, mixer: str, seed: int) -> dict[str, dict]:
    """Every run of one mixer and seed as a recipe mapping, keyed by its folder name (the N-step runs
    ``<kind>-N<n>`` and the arms ``<arm>-<n>+<m>``)."""
    folder = seed_dir(spec, mixer, seed)
    base = recipe_from_dict(spec.base, name="base")
    optim = asdict(_plan_optim(spec, base.optim))
    config = {**spec.base["model"].get("config", {}), "mixer": mixer, **mixer_overrides(spec)[mixer]}
    start = _with(spec.base, seed=seed, optim=optim, model__config=config)
    arms = chosen_arms(spec)
    recipes: dict[str, dict] = {}
    for n, m in splits_of(spec):
        for arm in arms:
            kind = _kind(arm)
            prefix = f"{kind}-N{n}"
            if prefix not in recipes:
                recipes[prefix] = _with(start, output_dir=str(folder / prefix), train__max_steps=n,
                                        optim__schedule_steps=prefix_schedule_steps(n, _plan_optim(spec, base.optim)),
                                        model={**start["model"], **_taper_of(spec, kind)})
            name = f"{arm}-{n}+{m}"
            if arm in CONTINUED:
                r = _with(start, output_dir=str(folder / name), train__max_steps=m, data__skip_batches=n,
                          optim={**optim, "step_offset": n, "rewarm_steps": spec.rewarm_steps},
                          init_from=str(folder / (f"converted-N{n}" if arm == "converted-cpt" else f"{prefix}/final")))
                r.pop("model", None)
                r.pop("tokenizer", None)
            else:  # the N-step run resumed to N + M: its schedule is now the N + M one
                r = _with(recipes[prefix], output_dir=str(folder / name), train__max_steps=n + m,
                          optim__schedule_steps=None)
            recipes[name] = r
    return recipes


# ============================================================================================== running


def _finished(folder: Path) -> bool:
    return (folder / "final" / "config.json").is_file() and (folder / "metrics.jsonl").is_file()


def _train(recipe: dict, progress: bool, resume_from: Path | None = None) -> None:
    """Run ``recipe`` unless its folder holds a finished model; an interrupted run resumes from its own last
    checkpoint, a new one from ``resume_from`` (the shared N-step run's checkpoint) when given."""
    folder = Path(recipe["output_dir"])
    if _finished(folder):
        logger.info("collected %s (already finished)", folder)
        return
    resume = True if folder.exists() and list_checkpoints(folder) else (str(resume_from) if resume_from else None)
    train(recipe_from_dict(recipe, name=folder.name), resume=resume, progress=progress)


def _convert(spec: CompareSpec, recipes: dict, mixer: str, seed: int, n: int) -> None:
    """tlm-convert the uniform N-step model of this mixer and seed (unless done)."""
    folder = seed_dir(spec, mixer, seed)
    out = folder / f"converted-N{n}"
    if (out / "config.json").is_file():
        return
    base = recipe_from_dict(recipes[f"uniform-N{n}"])
    options = {"schedule": spec.schedule, "ratio": spec.ratio, "calibration_data": base.data.train,
               "seq_len": base.data.seq_len, "seed": seed, "multiple_of": base.model.multiple_of, **spec.convert}
    convert(str(folder / f"uniform-N{n}" / "final"), str(out), options_from(**options))


def run_seed(spec: CompareSpec, mixer: str, seed: int, progress: bool = False) -> None:
    """Every run of one mixer and seed, in order: the N-step runs, the conversions, then each split's arms."""
    recipes = run_recipes(spec, mixer, seed)
    folder = seed_dir(spec, mixer, seed)
    for name, recipe in recipes.items():  # the N-step runs come before the arms that need them
        if "+" not in name:
            _train(recipe, progress)
    arms = chosen_arms(spec)
    for n in sorted({n for n, _ in splits_of(spec)}):
        if "converted-cpt" in arms:
            _convert(spec, recipes, mixer, seed, n)
    for n, m in splits_of(spec):
        for arm in arms:
            resume = None if arm in CONTINUED else folder / f"{_kind(arm)}-N{n}" / f"checkpoint-{n}"
            _train(recipes[f"{arm}-{n}+{m}"], progress, resume)


def _run_seed_job(job: tuple) -> None:
    spec, mixer, seed = job
    logging.basicConfig(level=logging.WARNING)
    run_seed(spec, mixer, seed, progress=False)


def run_comparison(spec: CompareSpec, progress: bool = True, jobs: int = 1) -> list[dict]:
    """Run (or collect) every run of the study, ``jobs`` (mixer, seed) units at a time in their own processes;
    write compare.json, compare.md and the curves; return the studies (per mixer and split: arms and pairs)."""
    check_spec(spec)
    out = Path(spec.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    units = [(spec, mixer, seed) for mixer in mixer_overrides(spec) for seed in seeds_of(spec)]
    if jobs <= 1:
        for unit in units:
            run_seed(*unit, progress=progress)
    else:
        import multiprocessing as mp

        prepare_data(recipe_from_dict(_with(spec.base, output_dir=str(out))))  # one process fills the token cache
        with mp.get_context("spawn").Pool(jobs, maxtasksperchild=1) as pool:
            list(pool.imap_unordered(_run_seed_job, units))
    runs = collect(spec)
    studies = summarize(spec, runs)
    plan = LR_PLAN.format(rewarm=spec.rewarm_steps)
    (out / f"{spec.report}.json").write_text(json.dumps({"plan": plan, "spec": asdict(spec), "studies": studies,
                                                         "runs": runs}, indent=1))
    (out / f"{spec.report}.md").write_text(format_tables(studies, spec) + "\n")
    for study in studies:
        plot_study(study, [r for r in runs if (r["mixer"], r["split"]) == (study["mixer"], study["split"])],
                   out / f"curves-{spec.report}-{study['mixer']}-{study['split']}.png")
    return studies


# ============================================================================================== collecting


def _metrics(folder: Path) -> list[dict]:
    path = folder / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _seconds(folder: Path) -> float | None:
    summary = folder / "run_summary.json"
    return json.loads(summary.read_text()).get("seconds") if summary.exists() else None


def _conversion_seconds(folder: Path) -> float | None:
    report = folder / "conversion_report.json"
    return sum(json.loads(report.read_text())["seconds"].values()) if report.exists() else None


def collect(spec: CompareSpec) -> list[dict]:
    """One record per finished arm run: eval loss, parameters, tokens, wall seconds (the shared N-step run and the
    conversion included) and its curves from step 0 (the N-step run's part first)."""
    runs = []
    for mixer in mixer_overrides(spec):
        for seed in seeds_of(spec):
            folder = seed_dir(spec, mixer, seed)
            for n, m in splits_of(spec):
                for arm in chosen_arms(spec):
                    record = _collect_run(folder, arm, n, m)
                    if record is not None:
                        runs.append({"mixer": mixer, "seed": seed, **record})
    return runs


def _collect_run(folder: Path, arm: str, n: int, m: int) -> dict | None:
    run, prefix = folder / f"{arm}-{n}+{m}", folder / f"{_kind(arm)}-N{n}"
    if not _finished(run):
        return None
    pre, lines = _metrics(prefix), _metrics(run)
    shift = max((x["tokens"] for x in pre), default=0) if arm in CONTINUED else 0  # (c), (d) count from step N
    cut = max((x["step"] for x in pre), default=0)

    def curve(key):
        head = [(x["tokens"], x[key]) for x in pre if key in x and x["step"] <= cut]
        return head + [(x["tokens"] + shift, x[key]) for x in lines if key in x and not (shift == 0 and x["step"] <= cut)]

    evals = curve("eval_loss")
    parts = [_seconds(run), _seconds(prefix)] + ([_conversion_seconds(folder / f"converted-N{n}")]
                                                  if arm == "converted-cpt" else [])
    final_eval = evals[-1][1] if evals else float("nan")
    train_curve = curve("loss")
    return {"split": f"{n}+{m}", "arm": arm, "folder": str(run), "eval_loss": final_eval,
            "params": _params(run / "final"), "tokens": train_curve[-1][0] if train_curve else 0,
            "seconds": None if None in parts else round(sum(parts), 1), "train": train_curve, "eval": evals}


def _params(folder: Path) -> int:
    from safetensors import safe_open

    total = 0
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for k in f.keys():
                total += math.prod(f.get_slice(k).get_shape())
    return total


# ============================================================================================== tables


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def paired(first: dict[int, float], second: dict[int, float]) -> dict:
    """Per seed ``first - second`` over the seeds both have: the differences, their mean ± std and how many are
    negative (first lower, i.e. better) and positive."""
    seeds = sorted(set(first) & set(second))
    diffs = [first[s] - second[s] for s in seeds]
    mean, std = mean_std(diffs) if diffs else (float("nan"), float("nan"))
    return {"seeds": seeds, "diffs": diffs, "mean": mean, "std": std, "negative": sum(d < 0 for d in diffs),
            "positive": sum(d > 0 for d in diffs)}


def pairs_of(spec: CompareSpec) -> list[tuple[str, str]]:
    arms = chosen_arms(spec)
    wanted = [("converted-cpt", "uniform-continued"), ("tapered-scratch", "uniform-scratch")]
    wanted += [(f"{name}-scratch", "uniform-scratch") for name in spec.shapes]
    return [(a, b) for a, b in wanted if a in arms and b in arms]


def summarize(spec: CompareSpec, runs: list[dict]) -> list[dict]:
    """Per mixer and split: each arm's eval loss over seeds (mean, std, n, mean wall seconds) and the pairs."""
    studies = []
    for mixer in mixer_overrides(spec):
        for n, m in splits_of(spec):
            split = f"{n}+{m}"
            mine = [r for r in runs if r["mixer"] == mixer and r["split"] == split]
            by_arm = {arm: {r["seed"]: r for r in mine if r["arm"] == arm} for arm in chosen_arms(spec)}
            arms = {}
            for arm, got in by_arm.items():
                if got:
                    mean, std = mean_std([r["eval_loss"] for r in got.values()])
                    secs = [r["seconds"] for r in got.values() if r["seconds"] is not None]
                    first = next(iter(got.values()))
                    arms[arm] = {"mean": mean, "std": std, "n": len(got), "params": first["params"],
                                 "tokens": first["tokens"], "seconds": statistics.mean(secs) if secs else None}
            pairs = [{"first": a, "second": b, **paired({s: r["eval_loss"] for s, r in by_arm[a].items()},
                                                        {s: r["eval_loss"] for s, r in by_arm[b].items()})}
                     for a, b in pairs_of(spec)]
            studies.append({"mixer": mixer, "split": split, "arms": arms, "pairs": pairs})
    return studies


def format_tables(studies: list[dict], spec: CompareSpec) -> str:
    """compare.md: the plan, then per study the arms (mean ± std over seeds) and the paired differences."""
    lines = [f"Learning-rate plan: {LR_PLAN.format(rewarm=spec.rewarm_steps)} (peak lr and warmup of the base "
             f"recipe, the last {spec.decay_fraction:g} of N + M decaying to min_lr). Eval loss: held-out, nats per "
             "token, at the end of each run; a difference < 0 means the first arm ends lower."]
    for study in studies:
        lines += ["", f"### {study['mixer']}, N+M = {study['split']} steps", "",
                  "| arm | params | tokens | eval loss, mean ± std | seeds | wall s, mean (N-step run included) |",
                  "|---|---|---|---|---|---|"]
        for arm, a in study["arms"].items():
            wall = "n/a" if a["seconds"] is None else f"{a['seconds']:.0f}"
            lines.append(f"| {arm} | {a['params']:,} | {a['tokens']:,} | {a['mean']:.4f} ± {a['std']:.4f} | "
                         f"{a['n']} | {wall} |")
        if study["pairs"]:
            lines += ["", "| paired difference (same seed) | mean ± std | per seed | first lower in |",
                      "|---|---|---|---|"]
            for p in study["pairs"]:
                if not p["seeds"]:
                    continue
                per_seed = ", ".join(f"s{s}: {d:+.4f}" for s, d in zip(p["seeds"], p["diffs"]))
                lines.append(f"| {p['first']} − {p['second']} | {p['mean']:+.4f} ± {p['std']:.4f} | {per_seed} | "
                             f"{p['negative']}/{len(p['seeds'])} seeds |")
    return "\n".join(lines)


# ============================================================================================== plot


def band(curves: list[list[tuple[float, float]]]) -> tuple[list[float], list[float], list[float]]:
    """x, mean and std over ``curves`` at the x values every curve has."""
    shared = sorted(set.intersection(*(set(x for x, _ in c) for c in curves))) if curves else []
    values = [{x: y for x, y in c} for c in curves]
    stats = [mean_std([v[x] for v in values]) for x in shared]
    return shared, [s[0] for s in stats], [s[1] for s in stats]


def plot_study(study: dict, runs: list[dict], path: Path) -> None:
    """Training and held-out loss of each arm against tokens: the mean over seeds, a band of ± one std."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.5))
    FigureCanvasAgg(fig)
    ax_train, ax_eval = fig.subplots(1, 2)
    for arm in study["arms"]:
        for ax, key in ((ax_train, "train"), (ax_eval, "eval")):
            x, mean, std = band([r[key] for r in runs if r["arm"] == arm and r[key]])
            if not x:
                continue
            line, = ax.plot(x, mean, label=arm, linewidth=1, marker="o" if key == "eval" else None, ms=3)
            ax.fill_between(x, [a - b for a, b in zip(mean, std)], [a + b for a, b in zip(mean, std)],
                            color=line.get_color(), alpha=0.2)
    n_seeds = max((a["n"] for a in study["arms"].values()), default=0)
    for ax, title in ((ax_train, "training loss"), (ax_eval, "held-out loss")):
        ax.set_xlabel("training tokens")
        ax.set_ylabel("loss (nats/token)")
        ax.set_title(f"{study['mixer']} {study['split']}: {title}, mean ± std over {n_seeds} seeds")
        ax.grid(alpha=0.3)
    ax_eval.legend(fontsize=8)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    tmp.replace(path)


__all__ = ["CompareSpec", "load_compare", "run_comparison", "run_seed", "run_recipes", "collect", "summarize",
           "paired", "mean_std", "band", "format_tables", "parse_split", "parse_seeds", "select", "check_spec",
           "prefix_schedule_steps", "ARMS", "LR_PLAN"]
