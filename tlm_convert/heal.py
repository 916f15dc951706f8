"""``tlm-convert --heal-tokens N``: logit distillation from the source right after the conversion.

The converted model (student) learns to reproduce the source's next-token distribution (teacher: the input checkpoint)
on N tokens of the calibration data, through ``tlm train`` (tlm_train.trainer.train: metrics.jsonl, progress, signals)
with the recipe :data:`HEAL_RECIPE` (recipes/cpt/smollm2-135m-heal.yaml is the same recipe as a ``tlm train`` file,
generated from it). The learning rate is constant after a short warmup, so a heal of N tokens is the first N tokens of
any longer one (the heal curve reads one run); recipes/cpt/smollm2-135m-heal-long.yaml is a 400k-token heal as a recipe.

The student and the teacher stay in memory: the converted model is handed to the trainer (in fp32, the trainer's
master weights: :func:`fp32_student`) and comes back trained, then in the conversion's dtype; the source is loaded
once more as the teacher (the conversion resized its own copy in place). No model crosses the disk. What is
written goes inside the conversion's temporary folder (tlm_io.outputs.staged), so a failed or killed heal leaves
OUTPUT untouched::

    .OUT.tmp-XXXX/heal-work/heal-data.txt  the calibration sources' text in one file (when there are several, or
                                         ``self`` samples: calibration_samples.txt)
    .OUT.tmp-XXXX/heal-work/tokens/      the heal data's token cache
    .OUT.tmp-XXXX/heal-work/train/       the training run: recipe.yaml, metrics.jsonl, run_summary.json (no final/;
                                         checkpoints only every log.save_every steps, which the heal sets beyond
                                         any heal, or when a signal or STOP file stops it)

On success the work folder is removed and OUT/heal/ keeps the run's metrics.jsonl, recipe.yaml and
run_summary.json; the healed weights are what OUT gets, in the requested format.
"""

from __future__ import annotations

import copy
import math
import shutil
import time
from pathlib import Path

import torch

from tlm_io.errors import ConversionError, RecipeError, Stopped, TrainError
from tlm_io.load import load_model, load_tokenizer, materialize
from tlm_io.perplexity import perplexity
from tlm_io.text import load_text
from tlm_train.budget import Phase
from tlm_train.recipe import recipe_from_dict
from tlm_train.trainer import train

from .evalsets import geomean
from .options import HEAL_STEP, SELF, tokens_per_step

HEAL_DIR = "heal"  # in OUT: the heal's metrics.jsonl, recipe.yaml, run_summary.json
WORK_DIR = "heal-work"  # in the temporary folder; removed before OUT is published
KEPT_FILES = ("metrics.jsonl", "recipe.yaml", "run_summary.json")

# The heal's recipe less what each conversion fills in; its rate: bench/STUDIES.md, "The heal's recipe".
# The one source of the heal's recipe: recipes/generate.py writes recipes/cpt/smollm2-135m-heal.yaml from it.
HEAL_RECIPE = {
    "distill": {"alpha": 1.0, "temperature": 1.0},  # pure logit distillation (KL to the source), no LM term
    "data": {"eval_tokens": 512},  # the trainer's own held-out check: one block (the report evaluates the sets)
    # relative to the weights' RMS; constant, so a heal of N tokens is the first N tokens of any longer one
    "optim": {"lr": 5.2e-4, "min_lr": 5.2e-4, "lr_relative": True, "warmup_steps": 5, "decay": "constant",
              "weight_decay": 0.0, "grad_clip": 1.0},
    # 4 x seq_len tokens a step in two micro-batches; the embedding (and its tied head) stays the source's
    "train": {**HEAL_STEP, "trainable": ["model.layers.*", "model.norm.*"],
              "precision": "auto"},  # bf16 autocast where it is fast (AVX512-BF16/AMX CPUs, CUDA), else fp32
    "log": {"every": 5, "eval_every": 0, "save_every": 1_000_000, "keep_last": 1, "tensorboard": False},
}


def heal_recipe(student: str, teacher: str, data: str, tokens: int, output_dir: str, seq_len: int, seed: int = 0,
                device: str = "cpu", trust_remote_code: bool = False, progress: bool = False,
                overrides: tuple[str, ...] = (), cache_dir: str | None = None):
    """The tlm_train Recipe of a heal of ``tokens`` tokens (rounded up to whole steps) of ``data`` (one source:
    :func:`heal_data`) from ``student`` (init_from) to ``teacher`` (distill.teacher), in bf16 autocast where that is
    fast on ``device`` (``precision: auto``: faster steps at the same heal quality), else fp32.
    :func:`heal` passes the source as both: its student is the source's conversion, handed to the trainer in memory
    (init_from is then the record of where it came from).
    ``overrides``: ``key.path=value`` changes of the defaults (the sweeps of bench/heal_curve.py); ``cache_dir``:
    the token cache (None: tlm train's default)."""
    spec = copy.deepcopy(HEAL_RECIPE)
    spec.update(output_dir=output_dir, init_from=student, seed=seed, trust_remote_code=trust_remote_code)
    spec["distill"]["teacher"] = teacher
    spec["data"].update(train=data, seq_len=seq_len, eval_tokens=max(spec["data"]["eval_tokens"], seq_len),
                        cache_dir=cache_dir)
    spec["train"]["device"] = device
    spec["log"]["progress"] = progress
    try:
        recipe = recipe_from_dict(spec, overrides, name="heal recipe")
    except RecipeError as err:
        raise ConversionError(str(err).replace("\n", ";")) from None
    step = recipe.train.batch_size * recipe.train.grad_accum * seq_len  # tokens a step, overrides included
    recipe.train.max_steps = math.ceil(tokens / step)
    return recipe


def heal_data(sources: str | tuple[str, ...] | list[str], samples: Path | None, path: Path) -> str:
    """What a heal trains on: the calibration sources. One text source is used as it is; several, or text sampled
    from the source (``samples``, the conversion's calibration_samples.txt, standing for ``self``), are joined
    into the text file ``path`` (blank-line separated, in order) and that file is used."""
    sources = (sources,) if isinstance(sources, str) else tuple(sources)
    texts = [s for s in sources if s != SELF]
    if samples is None and len(texts) == 1:
        return texts[0]
    if SELF in sources and (samples is None or not samples.is_file()):
        raise ConversionError(f"the heal data needs the text sampled for --calibration-data self ({samples}); "
                              "it is missing")
    parts = [load_text(s).strip("\n") for s in texts] + ([samples.read_text(encoding="utf-8").strip("\n")]
                                                         if SELF in sources else [])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n\n".join(parts) + "\n", encoding="utf-8")
    return str(path)


def heal(model, teacher: str, src, tmp: Path, opts, evalb, report: dict, timer, samples: Path | None = None,
         limits=None, tokenizer=None):
    """Distil the converted ``model`` (a TLMForCausalLM) from the source ``teacher`` (its path or name) for
    ``opts.heal_tokens`` tokens inside ``tmp`` (the conversion's temporary folder); return the healed
    TLMForCausalLM (in ``opts.dtype`` on ``opts.device``; in fp32 it shares ``model``'s tensors). Adds
    ``report["heal"]`` and, with evaluation sets, each set's perplexity after healing. Stopped (a
    KeyboardInterrupt) when the run was stopped (SIGINT, SIGTERM or a STOP file): OUTPUT is then left as it was.
    ``samples``: the text of the ``self`` calibration source, when it is one; ``tokenizer``: the source's (read from
    ``src`` when None). ``limits``: a tlm_train.budget.Limits: the heal's time, measured on its first steps, is
    said aloud when long and refused above the limit (before the rest of the steps run)."""
    work = tmp / WORK_DIR
    with timer("heal"):
        data = heal_data(opts.calibration_data, samples, work / "heal-data.txt")
        recipe = heal_recipe(teacher, teacher, data, opts.heal_tokens, str(work / "train"),
                             opts.seq_len, opts.seed, opts.device, opts.trust_remote_code,
                             progress=timer.on_phase is not None, cache_dir=str(work / "tokens"))
        cpu0, wall0 = time.process_time(), time.perf_counter()
        try:
            source, _, _ = load_model(teacher, with_tokenizer=False, trust_remote_code=opts.trust_remote_code)
            tokenizer = load_tokenizer(src) if tokenizer is None else tokenizer
            result = train(recipe, fp32_student(model), source, tokenizer=tokenizer, limits=limits,
                           phase=Phase("heal", f"steps of {tokens_per_step(opts.seq_len):,} tokens",
                                       "lower --heal-tokens"))
        except (ConversionError, TrainError, RecipeError) as err:
            message = str(err)  # the heal's time budget names itself already
            raise ConversionError(message if message.startswith("heal:") else f"heal: {message}") from None
        del source
        if result.stopped:
            raise Stopped(result.stop_reason or "STOP", "the heal")
        healed = result.model.to(dtype=getattr(torch, opts.dtype))
        report["heal"] = {"tokens": result.tokens, "steps": result.steps, "seconds": time.perf_counter() - wall0,
                          "cpu_seconds": time.process_time() - cpu0, "first_loss": result.losses[0],
                          "last_loss": result.losses[-1], "lr": result.lr, "recipe": recipe.to_dict()}
        _keep_log(result.output_dir, tmp / HEAL_DIR)
        shutil.rmtree(work)
    if evalb is not None:
        with timer("eval"):
            healed_ppl = {name: perplexity(healed, blocks, opts.batch_size) for name, blocks in evalb.items()}
        report.update(healed_entries(report, healed_ppl))
    return healed


def fp32_student(model):
    """``model`` as the trainer starts from it, as if loaded from disk: fp32 weights (those of a ``--dtype`` bf16 /
    fp16 conversion upcast; fp32 ones are the same tensors, not copies) and the buffers computed afresh in fp32
    (the rotary tables of a bf16 model are rounded)."""
    return materialize(model.config, {k: v.float() for k, v in model.state_dict().items()}).to(model.device)


def healed_entries(report: dict, healed: dict[str, float]) -> dict:
    """The report's perplexity keys with each set's perplexity after healing added (``healed``, ``healed_ratio``
    to the source) and ``perplexity_ratio_ood_geomean_healed``."""
    sets = [{**s, "healed": healed[s["data"]], "healed_ratio": healed[s["data"]] / s["before"]}
            for s in report["perplexity_sets"]]
    out = {"perplexity_sets": sets, "perplexity_healed": sets[0]["healed"]}
    ood = [s["healed_ratio"] for s in sets if not s["in_domain"]]
    if ood:
        out["perplexity_ratio_ood_geomean_healed"] = geomean(ood)
    return out


def _keep_log(run: Path, dest: Path) -> None:
    dest.mkdir()
    for name in KEPT_FILES:
        if (run / name).is_file():
            shutil.copy2(run / name, dest / name)


__all__ = ["HEAL_RECIPE", "HEAL_DIR", "heal_data", "heal_recipe", "heal", "healed_entries"]
