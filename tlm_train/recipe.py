"""Training recipes: YAML files validated into typed dataclasses.

A recipe is data: every key is checked against the dataclasses below, and *all* unknown, missing or ill-typed keys
are reported at once with their key paths (``optim.lr: expected a number, got 'fast'``). Command-line overrides
use dotted paths (``--set optim.lr=1e-3 --set train.max_steps=200``); their values are parsed as YAML scalars.
The resolved recipe (defaults filled in, overrides applied) is saved beside every checkpoint.

Two starting points, exactly one of them: ``init_from`` (a checkpoint: continued pretraining of a converted TLM or
any transformers / GGUF / TLM model) or ``model`` (a TLM config trained from scratch; uniform or tapered).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from tlm import TLMConfig
from tlm_io.errors import RecipeError

from .recipe_file import apply_overrides, build_spec, read_recipe_file

SEED_LIMIT = 1 << 32  # seeds are 0 .. 2**32 - 1: NumPy's range, and products of it stay within torch's 64 bits


@dataclass
class ModelSpec:
    """A TLM trained from scratch: ``config`` holds TLMConfig keyword arguments (``intermediate_size`` is the base
    width D); the MLP widths follow ``schedule``/``ratio`` at exactly the uniform model's parameter count."""

    config: dict = field(default_factory=dict)
    schedule: str = "uniform"  # cosine | linear | sigmoid | uniform | three-group
    ratio: str = "1.5/0.5"  # first/last width multipliers (0.5/1.5 is the reverse taper)
    multiple_of: int = 1


@dataclass
class DataSpec:
    train: str = "default"  # text file/folder (.txt/.jsonl/.parquet), a hub dataset name, or 'default' (bundled)
    eval: str | None = None  # held-out text; None: the last eval_tokens of the training tokens are held out
    eval_tokens: int = 65536
    seq_len: int = 256
    max_train_tokens: int | None = None  # cap on the tokenized training text (streamed datasets stop there)
    skip_batches: int = 0  # global batches of the data order skipped at the start (continue where a run stopped)
    cache_dir: str | None = None  # tokenized data cache; None: $TLM_CACHE or ~/.cache/tlm/tokens
    num_proc: int = 1  # processes that tokenize into the sharded cache (the first run; the same cache for any number)
    num_workers: int = 0  # DataLoader worker processes per rank reading batches from the cache (0: the training one)


@dataclass
class OptimSpec:
    lr: float = 4e-4  # peak learning rate (AdamW)
    min_lr: float = 4e-5  # end of the cosine decay
    warmup_steps: int = 100
    # after the warmup: cosine / linear decay to min_lr over the rest, constant, or wsd (warmup-stable-decay: the
    # rate stays at lr until the last decay_fraction of the schedule, then decays to min_lr, cosine-shaped; a run's
    # first steps then do not depend on its length, so runs of several lengths share them)
    decay: Literal["cosine", "linear", "constant", "wsd"] = "cosine"
    decay_fraction: float = 0.2  # wsd: the share of the schedule's steps that decays
    schedule_steps: int | None = None  # the schedule's length; None: step_offset + train.max_steps (a run may stop
    # before its schedule ends: the first N steps of a longer wsd schedule)
    step_offset: int = 0  # this run's step 0 is step step_offset of the schedule (a continuation with a fresh
    # optimizer that follows the schedule of a longer run; its warmup is over once step_offset >= warmup_steps)
    rewarm_steps: int = 0  # a linear ramp from 0 to the schedule's rate over the run's first steps (fresh AdamW state)
    weight_decay: float = 0.1  # on matrices only (not norms, biases or scalars)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    grad_clip: float | None = 1.0
    # the MLP neurons past distill.teacher's width in their layer (those a conversion grew: growth appends them) learn
    # at this multiple of the rate: noise-initialised, they barely move at lr in a short heal
    grown_lr_scale: float = 1.0
    # lr and min_lr are relative: the rate is lr x the RMS of the trainable matrices' entries at the run's start (one
    # number per model, logged), so models whose weights differ in scale take steps of the same relative size (Gemma
    # 3 270M's matrices have a fifth of SmolLM2-135M's RMS, and an absolute rate that heals one harms the other)
    lr_relative: bool = False


@dataclass
class TrainSpec:
    max_steps: int = 1000
    batch_size: int = 8  # sequences per device per micro-batch
    grad_accum: int = 1  # global batch = batch_size * grad_accum * world size sequences
    precision: Literal["fp32", "bf16", "auto"] = "fp32"  # bf16: autocast on CUDA or CPU (fp32 master weights);
    # auto: bf16 where it is fast on the device (trainer.bf16_is_fast), else fp32
    compile: bool = False  # torch.compile of each decoder layer (GPU; tlm_train.build.compile_layers)
    device: str = "auto"  # auto: cuda when available (one device per process under torchrun), else cpu
    parallel: Literal["ddp", "fsdp"] = "ddp"  # under torchrun; fsdp shards per decoder layer
    gradient_checkpointing: bool = False
    num_threads: int | None = None  # torch CPU threads per process
    trainable: list[str] | None = None  # parameter-name patterns (fnmatch, e.g. '*.mlp.*') that train; None: all


@dataclass
class LogSpec:
    every: int = 10  # steps between metrics.jsonl lines
    eval_every: int = 200  # steps between held-out evaluations (and at the end); 0: only at the end
    save_every: int = 500  # steps between checkpoints (and at the end)
    keep_last: int = 2  # checkpoints kept (older ones are deleted)
    tensorboard: bool = True  # also write TensorBoard events when tensorboard is installed
    progress: bool = True  # progress bar (rank 0)


@dataclass
class DistillSpec:
    """Knowledge distillation: loss = (1 - alpha) * LM loss + alpha * (T^2 * KL(teacher || student) at temperature T
    + hidden_weight * the residual streams' relative squared error, mean over layers and tokens)."""

    teacher: str  # checkpoint (e.g. the uniform source of a conversion); same vocabulary
    alpha: float = 0.5
    temperature: float = 1.0
    hidden_weight: float = 0.0  # > 0: also match the teacher's residual stream after every layer (same depth, width)
    # > 0: the KL over the teacher's top k next tokens plus the rest of its mass, the teacher's top k of each block
    # computed once and reused on later epochs (tlm_train.teacher_cache); 0: the whole-vocabulary KL every step
    teacher_topk: int = 0


@dataclass
class Recipe:
    output_dir: str
    model: ModelSpec | None = None
    init_from: str | None = None
    tokenizer: str | None = None  # 'byte' (UTF-8 bytes, vocab 256), a tokenizer folder, or None: init_from's
    seed: int = 0
    data: DataSpec = field(default_factory=DataSpec)
    optim: OptimSpec = field(default_factory=OptimSpec)
    train: TrainSpec = field(default_factory=TrainSpec)
    log: LogSpec = field(default_factory=LogSpec)
    distill: DistillSpec | None = None
    trust_remote_code: bool = False  # let tokenizers run their folder's own code (auto_map); trusted sources only

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_yaml(), encoding="utf-8")


# ============================================================================================ loading and checks


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read a YAML recipe, apply ``key.path=value`` overrides and validate it (RecipeError lists every problem)."""
    path = Path(path)
    data = read_recipe_file(path)
    recipe = recipe_from_dict(data if data is not None else {}, overrides, name=str(path))
    recipe.source = str(path)  # not a recipe key: lets a run refuse an output_dir that is the recipe's own folder
    return recipe


def recipe_from_dict(data: Any, overrides: list[str] | tuple[str, ...] = (), name: str = "recipe") -> Recipe:
    if not isinstance(data, dict):
        raise RecipeError(f"{name}: expected a mapping of keys at the top level, got {type(data).__name__}")
    data = apply_overrides(data, overrides)
    errors: list[str] = []
    recipe = build_spec(Recipe, data, "", errors)
    if not errors:
        errors += _check_semantics(recipe)
    if errors:
        raise RecipeError(f"{name}: {len(errors)} problem(s):\n" + "\n".join(f"  {e}" for e in errors))
    return recipe


_SET_BY_MODEL = {"schedule": "model.schedule", "taper_ratio": "model.ratio", "multiple_of": "model.multiple_of"}


def _model_config_problems(config: dict) -> list[str]:
    """``model.config`` keys that TLMConfig does not take (a typo would otherwise land in config.json unused)."""
    import difflib
    import inspect

    from transformers import PretrainedConfig

    known = {name for cls in (TLMConfig, PretrainedConfig)
             for name, p in inspect.signature(cls.__init__).parameters.items()
             if name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    errors = []
    for key in config:
        if key in _SET_BY_MODEL:
            errors.append(f"model.config.{key}: set {_SET_BY_MODEL[key]} instead")
        elif key not in known:
            close = difflib.get_close_matches(str(key), sorted(known), n=1)
            hint = f" (did you mean {close[0]}?)" if close else " (not a TLMConfig field)"
            errors.append(f"model.config.{key}: unknown key{hint}")
    return errors


def _check_semantics(r: Recipe) -> list[str]:
    """Value checks beyond types (ranges, exclusive options)."""
    errors = []
    if (r.model is None) == (r.init_from is None):
        errors.append("model / init_from: give exactly one (model: a TLM config trained from scratch; init_from: a "
                      "checkpoint to continue)")
    if r.model is not None and r.tokenizer is None:
        errors.append("tokenizer: required with model (from scratch): 'byte' or a tokenizer folder")
    if r.model is not None:
        errors += _model_config_problems(r.model.config)
    if not 0 <= r.seed < SEED_LIMIT:
        errors.append(f"seed: must be in 0..{SEED_LIMIT - 1} (the seeds of Python, NumPy and torch), got {r.seed}")
    positive = {"data.seq_len": r.data.seq_len, "data.eval_tokens": r.data.eval_tokens,
                "train.max_steps": r.train.max_steps, "train.batch_size": r.train.batch_size,
                "train.grad_accum": r.train.grad_accum, "log.every": r.log.every, "log.save_every": r.log.save_every,
                "log.keep_last": r.log.keep_last}
    for key, value in positive.items():
        if value < 1:
            errors.append(f"{key}: must be >= 1, got {value}")
    for key, value in {"optim.lr": r.optim.lr, "optim.min_lr": r.optim.min_lr, "optim.eps": r.optim.eps,
                       "optim.weight_decay": r.optim.weight_decay, "optim.warmup_steps": r.optim.warmup_steps,
                       "log.eval_every": r.log.eval_every}.items():
        if value < 0:
            errors.append(f"{key}: must be >= 0, got {value}")
    for key, value in {"optim.step_offset": r.optim.step_offset, "optim.rewarm_steps": r.optim.rewarm_steps}.items():
        if value < 0:
            errors.append(f"{key}: must be >= 0, got {value}")
    if not 0 <= r.optim.decay_fraction <= 1:
        errors.append(f"optim.decay_fraction: must be in [0, 1], got {r.optim.decay_fraction}")
    if r.optim.schedule_steps is not None and r.optim.schedule_steps < r.optim.step_offset + r.train.max_steps:
        errors.append(f"optim.schedule_steps: {r.optim.schedule_steps} is shorter than the run (optim.step_offset "
                      f"{r.optim.step_offset} + train.max_steps {r.train.max_steps}); raise it or leave it out")
    if r.optim.min_lr > r.optim.lr:
        errors.append(f"optim.min_lr: {r.optim.min_lr} is above optim.lr {r.optim.lr}")
    if len(r.optim.betas) != 2 or not all(0 <= b < 1 for b in r.optim.betas):
        errors.append(f"optim.betas: expected two numbers in [0, 1), got {r.optim.betas}")
    if r.optim.grown_lr_scale <= 0:
        errors.append(f"optim.grown_lr_scale: must be > 0, got {r.optim.grown_lr_scale}")
    elif r.optim.grown_lr_scale != 1 and r.distill is None:
        errors.append("optim.grown_lr_scale: the grown neurons are those past distill.teacher's widths; add a "
                      "distill: section or leave it at 1")
    elif r.optim.grown_lr_scale != 1 and r.train.parallel == "fsdp":
        errors.append("optim.grown_lr_scale: not under train.parallel fsdp (a rank holds a shard of each matrix); use "
                      "ddp or leave it at 1")
    if r.optim.lr_relative and r.train.parallel == "fsdp":
        errors.append("optim.lr_relative: not under train.parallel fsdp (a rank holds a shard of each matrix, not "
                      "the model's weight scale); use ddp or an absolute lr")
    if r.optim.grad_clip is not None and r.optim.grad_clip <= 0:
        errors.append(f"optim.grad_clip: must be > 0 or null, got {r.optim.grad_clip}")
    if r.data.num_proc < 1:
        errors.append(f"data.num_proc: must be >= 1, got {r.data.num_proc}")
    if r.data.num_workers < 0:
        errors.append(f"data.num_workers: must be >= 0, got {r.data.num_workers}")
    if r.data.skip_batches < 0:
        errors.append(f"data.skip_batches: must be >= 0, got {r.data.skip_batches}")
    if r.data.seq_len < 2:
        errors.append(f"data.seq_len: must be >= 2, got {r.data.seq_len}")
    if r.distill is not None:
        if not 0 <= r.distill.alpha <= 1:
            errors.append(f"distill.alpha: must be in [0, 1], got {r.distill.alpha}")
        if r.distill.temperature <= 0:
            errors.append(f"distill.temperature: must be > 0, got {r.distill.temperature}")
        if r.distill.hidden_weight < 0:
            errors.append(f"distill.hidden_weight: must be >= 0, got {r.distill.hidden_weight}")
        if r.distill.teacher_topk < 0:
            errors.append(f"distill.teacher_topk: must be >= 0 (0: the whole-vocabulary KL), got "
                          f"{r.distill.teacher_topk}")
        if r.distill.teacher_topk > 0 and r.distill.hidden_weight > 0:
            errors.append("distill.teacher_topk caches the teacher's logits only, distill.hidden_weight needs its "
                          "residual streams every step: set one of them to 0")
    if r.train.trainable is not None and (not r.train.trainable or not all(r.train.trainable)):
        errors.append(f"train.trainable: expected a non-empty list of parameter-name patterns or null (all train), "
                      f"got {r.train.trainable}")
    if r.train.num_threads is not None and r.train.num_threads < 1:
        errors.append(f"train.num_threads: must be >= 1, got {r.train.num_threads}")
    return errors


__all__ = ["Recipe", "ModelSpec", "DataSpec", "OptimSpec", "TrainSpec", "LogSpec", "DistillSpec", "RecipeError",
           "load_recipe", "recipe_from_dict", "apply_overrides", "build_spec"]
