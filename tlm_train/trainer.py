"""``tlm train``: a plain PyTorch training loop for TLMs, on one process or under ``torchrun`` (DDP or FSDP).

One step = ``grad_accum`` micro-batches per process -> gradient clipping -> AdamW -> LR schedule (linear warmup,
then cosine / linear decay to ``min_lr``, or constant). The loss is the next-token cross entropy, optionally mixed
with a KL term towards a frozen teacher (distillation). Under torchrun the processes split every global batch
(see tlm_train.data.BatchOrder), DDP averages the gradients, so N processes with batch B follow the same
trajectory as one process with batch N*B up to floating-point summation order.

Output folder::

    output_dir/
      recipe.yaml                 the resolved recipe of the latest (re)start
      metrics.jsonl               one JSON line per logged step / evaluation (rank 0)
      checkpoint-<step>/          model (safetensors, loads like any TLM) + optimizer, scheduler and
                                  rng_state_<rank> (.json + .safetensors, no pickle: tlm_train.state_io),
                                  trainer_state.json, recipe.yaml, manifest.json (sizes, SHA-256); written
                                  atomically
      final/                      the trained model (TLM, remote code included) and its tokenizer
      run_summary.json            steps, tokens, final held-out loss, precision, wall seconds of every invocation

Resuming (``resume=True``: the latest checkpoint, or a path) restores model, optimizer, scheduler, every rank's
RNG and the data position, so the loss curve continues exactly as an uninterrupted run's. A checkpoint from a
different model or batch layout is refused; ``resume=True`` skips, with a warning, checkpoints that do not match
their manifest (a kill or full disk while saving) and takes the newest complete one. SIGINT / SIGTERM, or a file
named ``STOP`` in output_dir, end the run at the next step boundary with a checkpoint. output_dir is locked for
the run (tlm_io.outputs.OutputLock): a second run into it is refused.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import signal
import time
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
import torch.nn.functional as F

from tlm import TLMConfig, TLMForCausalLM
from tlm.slow import SlowLevels
from tlm_io.errors import ConversionError, RecipeError, StateError, TrainError, first_few
from tlm_io.export import export_model
from tlm_io.load import load_model, load_tokenizer
from tlm_io.outputs import (OutputLock, check_run_folder, check_writable_parent, clean_stale_in, mark_run_folder,
                            publish, save_errors)
from tlm_io.perplexity import nll_sum
from tlm_io.sizes import check_model_size
from tlm_io.text import to_blocks

from . import state_io
from .data import BatchOrder, TokenBlocks, micro_batch_loader, recipe_tokens
from .losses import head_loss, teacher_topk
from .recipe import Recipe, recipe_from_dict
from .teacher_cache import TeacherTopCache

logger = logging.getLogger(__name__)

CHECKPOINT_PREFIX = "checkpoint-"
STOP_FILE = "STOP"
# what a run writes into output_dir (its clean-up touches only the temporary / set-aside forms of _OUTPUTS)
_OUTPUTS = rf"{CHECKPOINT_PREFIX}\d+|final"
_OWNED = (rf"{_OUTPUTS}|\.(?:{_OUTPUTS})\.(?:tmp-train|old-\d+)|recipe\.yaml|metrics\.jsonl|run_summary\.json|"
          rf"tensorboard|{STOP_FILE}")


@dataclass
class TrainResult:
    output_dir: Path
    final_dir: Path | None
    steps: int  # optimizer steps completed (including those before a resume)
    tokens: int  # training tokens seen
    seconds: float  # wall time of this invocation
    eval_loss: float | None  # held-out loss at the end (None when stopped early)
    losses: list[float] = field(default_factory=list)  # training loss of each step run by this invocation
    stopped: bool = False  # ended by a signal or the STOP file (a checkpoint was written)
    stop_reason: str | None = None  # "SIGINT", "SIGTERM" or "STOP" (the file) when stopped


# ============================================================================================== setup


@dataclass
class _Dist:
    world: int
    rank: int
    local_rank: int
    device: torch.device

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def all_mean(self, value: float) -> float:
        if self.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return float(t) / self.world

    def any(self, flag: bool) -> bool:
        if self.world == 1:
            return flag
        t = torch.tensor([int(flag)], device=self.device)
        dist.all_reduce(t)
        return bool(t.item())


def _setup_distributed(device_pref: str) -> _Dist:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if device_pref == "auto":
        device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(device_pref)
        if device.type == "cuda" and device.index is None:
            device = torch.device(f"cuda:{local_rank}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise TrainError(f"train.device {device_pref!r}: CUDA is not available here; use auto or cpu")
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return _Dist(world, rank, local_rank, device)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass


def build_model_and_tokenizer(recipe: Recipe):
    """(TLMForCausalLM, tokenizer): from scratch (``model``) or from ``init_from`` (any supported checkpoint)."""
    if recipe.model is not None:
        tokenizer = load_tokenizer(recipe.tokenizer, recipe.trust_remote_code)
        kwargs = dict(recipe.model.config)
        kwargs.setdefault("vocab_size", len(tokenizer))
        if kwargs["vocab_size"] < len(tokenizer):
            raise RecipeError(f"model.config.vocab_size {kwargs['vocab_size']} is below the tokenizer's "
                              f"{len(tokenizer)} tokens; raise it or leave it out")
        if tokenizer.eos_token_id is not None:
            kwargs.setdefault("eos_token_id", tokenizer.eos_token_id)
        try:
            check_model_size(kwargs, "recipe", prefix="model.config.")  # before a module is built
        except ConversionError as err:
            raise RecipeError(str(err)) from None
        try:
            config = TLMConfig(schedule=recipe.model.schedule, taper_ratio=recipe.model.ratio,
                               multiple_of=recipe.model.multiple_of, **kwargs)
        except (TypeError, ValueError) as err:
            raise RecipeError(f"model.config: {err}") from None
        torch.manual_seed(recipe.seed)
        return TLMForCausalLM(config), tokenizer
    return load_pretrained(recipe.init_from, recipe.tokenizer, trust_remote_code=recipe.trust_remote_code)


def load_pretrained(path: str, tokenizer_name: str | None = None, with_tokenizer: bool = True,
                    trust_remote_code: bool = False):
    """A TLMForCausalLM from any checkpoint tlm-convert reads (TLM, transformers folder, GGUF), and its tokenizer
    (``tokenizer_name`` when given, else the checkpoint's; None when ``with_tokenizer`` is false). The tokenizer
    runs the folder's own code only with ``trust_remote_code``."""
    try:
        model, _, src = load_model(path, with_tokenizer=False, trust_remote_code=trust_remote_code)
    except ConversionError as err:
        raise TrainError(str(err)) from None
    if not with_tokenizer:
        return model, None
    if tokenizer_name is not None:
        return model, load_tokenizer(tokenizer_name, trust_remote_code)
    if src.tokenizer_kwargs() is None:
        raise TrainError(f"'{path}' has no tokenizer files; set tokenizer: (a tokenizer folder, or 'byte')")
    return model, load_tokenizer(src)


def select_trainable(model, patterns: list[str]) -> int:
    """Freeze every parameter whose name matches none of ``patterns`` (fnmatch, e.g. ``*.mlp.*``); returns the
    number of trainable parameters. RecipeError when no parameter matches."""
    from fnmatch import fnmatchcase

    count = 0
    for name, p in model.named_parameters():
        p.requires_grad_(any(fnmatchcase(name, pat) for pat in patterns))
        count += p.numel() if p.requires_grad else 0
    if count == 0:
        raise RecipeError(f"train.trainable {patterns}: no parameter name matches (names look like "
                          f"{next(iter(dict(model.named_parameters())))!r})")
    return count


def _param_groups(model, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def bf16_is_fast(device: str | torch.device) -> bool:
    """Whether bf16 autocast speeds up training on ``device``: a CUDA device with bf16, or a CPU with bf16 matrix
    instructions (AVX512-BF16 or AMX in /proc/cpuinfo; False where that cannot be read). Elsewhere bf16 products
    are emulated and slower than fp32."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if dev.type != "cpu":
        return False
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def lr_factor(step: int, recipe: Recipe) -> float:
    """Multiplier of optim.lr at ``step`` (0-based): linear warmup to 1, then decay to min_lr / lr at max_steps."""
    o, total = recipe.optim, recipe.train.max_steps
    if o.warmup_steps and step < o.warmup_steps:
        return (step + 1) / o.warmup_steps
    floor = o.min_lr / o.lr if o.lr > 0 else 0.0
    if o.decay == "constant":
        return 1.0
    span = max(1, total - o.warmup_steps)
    t = min(1.0, (step - o.warmup_steps) / span)
    shape = 0.5 * (1 + math.cos(math.pi * t)) if o.decay == "cosine" else 1 - t
    return floor + (1 - floor) * shape


# ============================================================================================== loss


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy; logits (B, S, V), ids (B, S) -> scalar (fp32)."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def distill_loss(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """T^2 * mean over positions of KL(softmax(teacher/T) || softmax(student/T)); logits (B, S, V)."""
    t = temperature
    s_logp = F.log_softmax(student[:, :-1].float() / t, dim=-1).flatten(0, 1)
    t_logp = F.log_softmax(teacher[:, :-1].float() / t, dim=-1).flatten(0, 1)
    return F.kl_div(s_logp, t_logp, log_target=True, reduction="batchmean") * t * t


def hidden_loss(student: tuple[torch.Tensor, ...], teacher: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Mean over layers and tokens of ||h_s - h_t||^2 / ||h_t||^2: the residual stream after every layer (the
    embeddings, index 0, are skipped), each (B, S, d); relative per token, so the few tokens with very large
    residual norms (the first position's) weigh as much as any other."""
    if len(student) != len(teacher):
        raise TrainError(f"distill.hidden_weight needs a teacher of the student's depth: {len(teacher) - 1} "
                         f"layers against {len(student) - 1}")
    losses = []
    for s, t in zip(student[1:], teacher[1:]):
        t = t.float()
        losses.append(((s.float() - t).square().sum(-1) / t.square().sum(-1).clamp_min(1e-12)).mean())
    return torch.stack(losses).mean()


# ============================================================================================== checkpoints


def list_checkpoints(output_dir: Path) -> list[Path]:
    """checkpoint-<step> folders, oldest first (temporary folders of unfinished writes are ignored)."""
    found = []
    for p in Path(output_dir).glob(f"{CHECKPOINT_PREFIX}*"):
        suffix = p.name[len(CHECKPOINT_PREFIX):]
        if p.is_dir() and suffix.isdigit() and (p / "trainer_state.json").is_file():
            found.append((int(suffix), p))
    return [p for _, p in sorted(found)]


def _fingerprint(model, recipe: Recipe, world: int) -> dict:
    """What a checkpoint must share with the run that resumes it."""
    core = _unwrap(model)
    return {"parameters": {k: list(v.shape) for k, v in core.state_dict().items()},
            "global_batch": recipe.train.batch_size * recipe.train.grad_accum * world,
            "seq_len": recipe.data.seq_len, "train_data": recipe.data.train, "seed": recipe.seed,
            "skip_batches": recipe.data.skip_batches}


# recipe keys a resume may change (the rest must equal the checkpoint's recipe.yaml)
_RESUMABLE = ("output_dir", "log", "train.max_steps", "train.num_threads", "train.device", "train.compile",
              "train.gradient_checkpointing", "data.cache_dir", "data.num_proc", "data.num_workers", "trust_remote_code")


def _flat(tree, prefix: str = "") -> dict:
    """{'a.b': value} of a nested mapping."""
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_flat(value, name + "."))
        else:
            out[name] = value
    return out


def _unwrap(model):
    return getattr(model, "module", model)


def _full_state_dict(model, parallel: str) -> dict:
    if parallel == "fsdp" and dist.is_initialized():
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return _unwrap(model).state_dict()


def _optim_state(model, optimizer, parallel: str) -> dict:
    if parallel == "fsdp" and dist.is_initialized():
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(model, optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return optimizer.state_dict()


def _rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ============================================================================================== the run


class _Run:
    def __init__(self, recipe: Recipe, resume: bool | str | None, progress: bool | None):
        self.recipe = recipe
        self.out = Path(recipe.output_dir)
        self.d = _setup_distributed(recipe.train.device)
        precision = recipe.train.precision
        self.bf16 = precision == "bf16" or (precision == "auto" and bf16_is_fast(self.d.device))
        self.lock = self._lock_output()
        try:
            self.show_progress = recipe.log.progress if progress is None else progress
            self.stop_requested = False
            self.resume_from = self._resume_path(resume)
        except BaseException:
            self.release()
            raise

    def _lock_output(self) -> OutputLock | None:
        """Rank 0 locks output_dir for the run (a second run into it is refused) and, holding the lock, removes
        the temporary folders of killed runs; every rank learns whether that worked (no rank waits forever)."""
        lock, problem = None, None
        if self.d.main:
            try:
                check_writable_parent(self.out.absolute(), option="output_dir")
                lock = OutputLock(self.out, option="output_dir").acquire()
                check_run_folder(self.out, _OWNED, "output_dir", not_inside=getattr(self.recipe, "source", None))
                mark_run_folder(self.out)
                clean_stale_in(self.out, _OUTPUTS)
            except (ConversionError, OSError) as err:
                problem = str(err)
        if self.d.any(problem is not None):
            if lock is not None:
                lock.release()
            raise TrainError(problem or "rank 0 could not lock output_dir (see its error)")
        return lock

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    # ---------------------------------------------------------------------------------------------- set-up

    def _resume_path(self, resume) -> Path | None:
        existing = list_checkpoints(self.out) if self.out.exists() else []
        if resume is None or resume is False:
            if existing:
                raise TrainError(f"{self.out} already has checkpoints (latest {existing[-1].name}); pass --resume to "
                                 "continue that run, or choose a new output_dir")
            return None
        if resume is True:
            if not existing:
                raise TrainError(f"--resume: no checkpoint-<step> folder in {self.out}; run without --resume to start")
            return _newest_complete(existing)
        path = Path(resume)
        if not (path / "trainer_state.json").is_file():
            raise TrainError(f"--resume {path}: not a checkpoint folder (no trainer_state.json); pass a "
                             f"{CHECKPOINT_PREFIX}<step> folder or --resume alone for the latest")
        problem = checkpoint_problem(path)
        if problem is not None:
            raise TrainError(f"--resume {path}: the checkpoint is incomplete or damaged ({problem}); resume from an "
                             f"earlier {CHECKPOINT_PREFIX}<step> folder, or --resume alone for the newest complete one")
        return path

    def setup(self) -> None:
        r, d = self.recipe, self.d
        if r.train.num_threads:
            torch.set_num_threads(r.train.num_threads)
        _seed_everything(r.seed)
        model, self.tokenizer = build_model_and_tokenizer(r)
        self.model_config = model.config
        model.to(d.device)
        if r.train.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        model.config.use_cache = False
        model.train()
        if r.train.trainable is not None:
            select_trainable(model, r.train.trainable)
        self.teacher = None
        if r.distill is not None:
            teacher, _ = load_pretrained(r.distill.teacher, with_tokenizer=False)
            if teacher.config.vocab_size != model.config.vocab_size:
                raise TrainError(f"distill.teacher has {teacher.config.vocab_size} vocabulary entries, the student "
                                 f"{model.config.vocab_size}; distillation needs the same tokenizer")
            shape = lambda c: (c.num_hidden_layers, c.hidden_size)  # noqa: E731
            if r.distill.hidden_weight > 0 and shape(teacher.config) != shape(model.config):
                raise TrainError(f"distill.hidden_weight needs a teacher of the student's depth and width: "
                                 f"{shape(teacher.config)} layers x hidden against {shape(model.config)}; "
                                 "set distill.hidden_weight: 0")
            if r.distill.teacher_topk > model.config.vocab_size:
                raise TrainError(f"distill.teacher_topk {r.distill.teacher_topk} is more than the vocabulary "
                                 f"({model.config.vocab_size}); lower it")
            self.teacher = teacher.to(d.device).eval().requires_grad_(False)
        self.teacher_cache = TeacherTopCache() if r.distill is not None and r.distill.teacher_topk else None
        self._load_data()
        self.fingerprint = _fingerprint(model, r, d.world)
        self.model = self._wrap(model)
        o = r.optim
        fused = {"fused": True} if d.device.type == "cuda" else {}
        self.optimizer = torch.optim.AdamW(_param_groups(self.model, o.weight_decay),
                                           lr=o.lr, betas=tuple(o.betas), eps=o.eps, **fused)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(s, r))
        self.slow_levels = SlowLevels(self.model)
        self.step = 0
        if self.resume_from is not None:
            self._load_checkpoint(self.resume_from)
        self.forward = torch.compile(self.model) if r.train.compile else self.model

    def _wrap(self, model):
        r, d = self.recipe, self.d
        if d.world == 1:
            return model
        if r.train.parallel == "fsdp":
            from torch.distributed.fsdp import fully_shard

            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
            return model
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, device_ids=[d.device.index] if d.device.type == "cuda" else None)

    def _load_data(self) -> None:
        r = self.recipe
        # rank 0 tokenizes (and fills the cache) first; the others then read the cache
        if not self.d.main:
            self.d.barrier()
        ids, eval_ids = recipe_tokens(self.tokenizer, r.data)
        if self.d.main:
            self.d.barrier()
        train_stop = len(ids)
        if eval_ids is None:  # hold out the end of the training tokens
            hold = min(r.data.eval_tokens, len(ids) // 10)
            hold -= hold % r.data.seq_len
            train_stop = len(ids) - hold
            eval_ids = torch.from_numpy(ids.read(train_stop))
        train_blocks = TokenBlocks(ids, r.data.seq_len, stop=train_stop)
        self.eval_blocks = to_blocks(eval_ids[: r.data.eval_tokens], r.data.seq_len)
        global_batch = r.train.batch_size * r.train.grad_accum * self.d.world
        if len(train_blocks) < global_batch:
            raise TrainError(f"training data has {len(train_blocks)} blocks of data.seq_len {r.data.seq_len}, fewer "
                             f"than one global batch ({global_batch}); add text or lower the batch size / seq_len")
        if len(self.eval_blocks) < self.d.world:
            raise TrainError(f"{len(self.eval_blocks)} held-out blocks of data.seq_len {r.data.seq_len} tokens for "
                             f"{self.d.world} process(es); give data.eval, more text or a larger data.eval_tokens")
        self.order = BatchOrder(train_blocks, r.train.batch_size, r.train.grad_accum, self.d.world, r.seed,
                                r.data.skip_batches)
        self.tokens_per_step = global_batch * r.data.seq_len

    def _load_checkpoint(self, path: Path) -> None:
        try:
            self._restore(path)
        except StateError as err:
            raise TrainError(f"cannot resume from {path}: {err}; resume from an earlier {CHECKPOINT_PREFIX}<step> "
                             "folder") from None

    def _check_recipe(self, path: Path) -> None:
        """Refuse a resume whose recipe changes the run (model config, data, optimizer, ...) beyond what a resume
        may change (:data:`_RESUMABLE`: max_steps, logging, threads, caches); names the differing keys. The
        checkpoint's recipe is read with today's defaults, so a key added to the format since it was written (at its
        default) is no change."""
        try:
            theirs = yaml.safe_load((path / "recipe.yaml").read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            return  # a checkpoint of the first format, without its recipe: the fingerprint is all there is
        if not isinstance(theirs, dict):
            return
        try:
            theirs = recipe_from_dict(theirs).to_dict()
        except RecipeError:
            pass  # compared as written
        old, new = _flat(theirs), _flat(self.recipe.to_dict())
        changed = sorted(k for k in old.keys() | new.keys()
                         if old.get(k) != new.get(k) and not any(k == a or k.startswith(a + ".") for a in _RESUMABLE))
        if changed:
            detail = first_few((f"{k}: {_brief(old.get(k))} -> {_brief(new.get(k))}" for k in changed), sep="; ")
            raise TrainError(f"checkpoint {path} was written by a different recipe ({detail}); resume with the recipe "
                             "it was written with (its recipe.yaml) or start a new output_dir")

    def _restore(self, path: Path) -> None:
        state = _read_trainer_state(path)
        theirs, ours = state.get("fingerprint", {}), self.fingerprint
        for key in ("parameters", "global_batch", "seq_len", "train_data", "seed", "skip_batches"):
            if theirs.get(key) != ours[key]:
                what = "model shapes" if key == "parameters" else key
                raise TrainError(f"checkpoint {path} does not match this recipe ({what} differ: "
                                 f"{_brief(theirs.get(key))} vs {_brief(ours[key])}); resume with the recipe it was "
                                 "written with (its recipe.yaml) or start a new output_dir")
        self._check_recipe(path)
        self._check_data_position(path, state.get("data"))
        weights = _read_weights(path)
        core = _unwrap(self.model)
        if self.recipe.train.parallel == "fsdp" and self.d.world > 1:
            from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                                 set_optimizer_state_dict)

            opts = StateDictOptions(full_state_dict=True, strict=False)
            set_model_state_dict(self.model, weights, options=opts)
            set_optimizer_state_dict(self.model, self.optimizer, state_io.load_state(path, "optimizer"), options=opts)
        else:
            missing, unexpected = core.load_state_dict(weights, strict=False)
            missing = [k for k in missing if not (core.config.tie_word_embeddings and k == "lm_head.weight")]
            if missing or unexpected:
                raise TrainError(f"checkpoint {path} weights do not match the model (missing {missing[:2]}, "
                                 f"unexpected {unexpected[:2]}); start a new output_dir")
            self.optimizer.load_state_dict(state_io.load_state(path, "optimizer", map_location=self.d.device))
        self.scheduler.load_state_dict(state_io.load_state(path, "scheduler"))
        rng = f"rng_state_{self.d.rank}"
        if (path / f"{rng}.json").is_file() or (path / f"{rng}.pt").is_file():
            _set_rng_state(state_io.load_state(path, rng))
        self.step = int(state["step"])
        logger.info("resumed from %s at step %d", path, self.step)

    def _data_position(self) -> dict:
        """Where the data order stands (the step alone decides it; the rest is checked on resume)."""
        o = self.order
        samples = (o.skip_batches + self.step) * o.global_batch
        return {"samples": samples, "epoch": samples // len(o.blocks), "block_in_epoch": samples % len(o.blocks),
                "train_blocks": len(o.blocks), "train_tokens": len(o.blocks) * self.recipe.data.seq_len}

    def _check_data_position(self, path: Path, saved: dict | None) -> None:
        """The order of a resumed run is that of the checkpoint's only over the same training blocks."""
        if saved is not None and saved["train_blocks"] != len(self.order.blocks):
            raise TrainError(f"checkpoint {path} was trained on {saved['train_blocks']} blocks of data, this run has "
                             f"{len(self.order.blocks)} (data.train or data.max_train_tokens changed); resume with "
                             "the same data or start a new output_dir")

    # ---------------------------------------------------------------------------------------------- saving

    def save_checkpoint(self) -> Path:
        """checkpoint-<step>: written into a temporary folder, checksummed (manifest.json), then swapped in."""
        final = self.out / f"{CHECKPOINT_PREFIX}{self.step}"
        with save_errors(final, self._checkpoint_bytes(), "output_dir"), self._removed_on_failure(final):
            return self._save_checkpoint()

    @contextmanager
    def _removed_on_failure(self, final: Path):
        """A failed save leaves no temporary folder behind (a killed one is removed by the next run)."""
        try:
            yield
        except BaseException:
            if self.d.main:
                shutil.rmtree(_temp_dir(final), ignore_errors=True)
            raise

    def _checkpoint_bytes(self) -> int:
        """About what a checkpoint takes on disk: the fp32 weights and AdamW's two moments."""
        return sum(p.numel() for p in self.model.parameters()) * 4 * 3

    def _save_checkpoint(self) -> Path:
        r, d = self.recipe, self.d
        final = self.out / f"{CHECKPOINT_PREFIX}{self.step}"
        tmp = _temp_dir(final)
        weights = _full_state_dict(self.model, r.train.parallel)
        optim = _optim_state(self.model, self.optimizer, r.train.parallel)
        if d.main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        d.barrier()
        state_io.save_state(tmp, f"rng_state_{d.rank}", _rng_state())
        if d.main:
            self._write_model(tmp, weights)
            state_io.save_state(tmp, "optimizer", optim)
            state_io.save_state(tmp, "scheduler", self.scheduler.state_dict())
            r.save(tmp / "recipe.yaml")
            state = {"step": self.step, "tokens": self.step * self.tokens_per_step,
                     "samples": self.step * self.order.global_batch, "world_size": d.world,
                     "fingerprint": self.fingerprint, "data": self._data_position()}
            (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1))
        d.barrier()
        if d.main:
            state_io.write_manifest(tmp)  # last: a folder without it (or not matching it) is incomplete
            publish(tmp, final)
            for old in list_checkpoints(self.out)[: -r.log.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
            logger.info("saved %s", final)
        d.barrier()
        return final

    def _write_model(self, folder: Path, weights: dict) -> None:
        """The weights as a loadable TLM folder (config, safetensors, remote code, tokenizer)."""
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # no "Writing model shards" bar inside the training bar
        export_model((self.model_config, {k: v.detach().cpu() for k, v in weights.items()}), folder, "tlm")
        self.tokenizer.save_pretrained(str(folder))

    def save_final(self) -> Path:
        with save_errors(self.out / "final", self._checkpoint_bytes() // 3, "output_dir"), \
                self._removed_on_failure(self.out / "final"):
            return self._save_final()

    def _save_final(self) -> Path:
        weights = _full_state_dict(self.model, self.recipe.train.parallel)
        final = self.out / "final"
        if self.d.main:
            tmp = _temp_dir(final)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            self._write_model(tmp, weights)
            self.recipe.save(tmp / "recipe.yaml")
            publish(tmp, final)
        self.d.barrier()
        return final

    # ---------------------------------------------------------------------------------------------- metrics

    def _open_metrics(self):
        path = self.out / "metrics.jsonl"
        if self.d.main and path.exists():  # a resumed run drops what was logged after its checkpoint
            lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
            kept = [ln for ln in lines if json.loads(ln).get("step", 0) <= self.step]
            path.write_text("".join(ln + "\n" for ln in kept))
        self.metrics_path = path
        self.tb = None
        if self.d.main and self.recipe.log.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(self.out / "tensorboard"))
            except ImportError:  # tensorboard is optional
                self.tb = None

    def log(self, record: dict) -> None:
        if not self.d.main:
            return
        with open(self.metrics_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, record["step"])

    # ---------------------------------------------------------------------------------------------- steps

    def _autocast(self):
        """bf16 autocast of the forward passes (student and teacher) on CUDA and on the CPU (fast where the CPU
        has bf16 matrix instructions: AVX512-BF16 or AMX); fp32 master weights, optimizer and loss."""
        if self.bf16 and self.d.device.type in ("cuda", "cpu"):
            return torch.autocast(self.d.device.type, dtype=torch.bfloat16)
        return nullcontext()

    def train_step(self) -> float:
        r, d = self.recipe, self.d
        accum = r.train.grad_accum
        total = 0.0
        hidden = self.teacher is not None and r.distill.hidden_weight > 0  # residual streams matched too
        for micro in range(accum):
            ids = next(self.batches).to(d.device, non_blocking=True)  # (B, S): this rank's micro-batch
            sync = micro == accum - 1 or d.world == 1 or r.train.parallel != "ddp"
            with (nullcontext() if sync else self.model.no_sync()), self._autocast():
                if self.teacher is None:
                    loss = lm_loss(self.forward(input_ids=ids, use_cache=False).logits, ids)
                else:
                    loss = self._distill_loss(ids, hidden)
                (loss / accum).backward()
            total += float(loss.detach()) / accum
        if r.optim.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), r.optim.grad_clip)
        self.slow_levels.before_step(self.optimizer, self.step)  # Hope's slow(m) levels (no-op without them)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return d.all_mean(total)

    def _distill_loss(self, ids: torch.Tensor, hidden: bool) -> torch.Tensor:
        """(1 - alpha) * LM loss + alpha * (T^2 * KL + hidden_weight * residual-stream loss), the logit terms formed
        from the final hidden states and LM heads a chunk of positions at a time (tlm_train.losses.head_loss):
        neither model's (B, S, V) logits exist whole. alpha 1: pure distillation, the LM term is not formed."""
        d = self.recipe.distill
        # logits_to_keep=1: the student's head runs on the last position only (unused); hidden_states[-1] is the
        # final normed state the head reads
        out = self.forward(input_ids=ids, use_cache=False, output_hidden_states=True, logits_to_keep=1)
        head = _unwrap(self.model).get_output_embeddings().weight
        if self.teacher_cache is not None:
            top = self.teacher_cache.top(ids, self._teacher_top)
            return head_loss(out.hidden_states[-1], head, ids, teacher_top=top, kd_weight=d.alpha,
                             lm_weight=1 - d.alpha, temperature=d.temperature)
        with torch.no_grad():
            teacher_out = self.teacher.model(input_ids=ids, use_cache=False, output_hidden_states=hidden or None)
        loss = head_loss(out.hidden_states[-1], head, ids,
                         teacher_hidden=teacher_out.last_hidden_state,
                         teacher_head=self.teacher.get_output_embeddings().weight,
                         kd_weight=d.alpha, lm_weight=1 - d.alpha, temperature=d.temperature)
        if hidden:
            loss = loss + d.alpha * d.hidden_weight * hidden_loss(out.hidden_states, teacher_out.hidden_states)
        return loss

    @torch.no_grad()
    def _teacher_top(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The teacher's top-k (indices, log-probabilities) of ids (M, S), each (M, S - 1, k)."""
        d = self.recipe.distill
        hidden = self.teacher.model(input_ids=ids, use_cache=False).last_hidden_state
        return teacher_topk(hidden, self.teacher.get_output_embeddings().weight, d.teacher_topk, d.temperature)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Held-out next-token loss (mean over the eval blocks, split across ranks)."""
        self.model.eval()
        d, bs = self.d, self.recipe.train.batch_size
        usable = len(self.eval_blocks) // d.world * d.world  # equal shares: DDP/FSDP forwards are collective
        blocks = self.eval_blocks[:usable][d.rank :: d.world]
        total, count = 0.0, 0
        for i in range(0, len(blocks), bs):
            ids = blocks[i : i + bs].long().to(d.device)
            with self._autocast():  # through the (DDP/FSDP) wrapper's forward, whose hooks gather the weights
                logits = self.model(input_ids=ids, use_cache=False).logits
            part, n = nll_sum(lambda x: x, logits, ids)  # the logits upcast to fp32 in chunks
            total, count = total + part, count + n
        self.model.train()
        if d.world > 1:
            t = torch.tensor([total, count], dtype=torch.float64, device=d.device)
            dist.all_reduce(t)
            total, count = float(t[0]), float(t[1])
        return total / count

    def _on_signal(self, signum, frame) -> None:
        self.stop_requested = signal.Signals(signum).name

    def run(self) -> TrainResult:
        r, d = self.recipe, self.d
        start_wall = time.perf_counter()
        if d.main:
            self.out.mkdir(parents=True, exist_ok=True)
            r.save(self.out / "recipe.yaml")
        d.barrier()
        self._open_metrics()
        handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        bar = None
        if d.main and self.show_progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=r.train.max_steps, initial=self.step, unit="step", dynamic_ncols=True)
        losses, eval_loss, stopped = [], None, False
        window_tokens, window_start = 0, time.perf_counter()
        self.batches = iter(micro_batch_loader(self.order, d.rank, self.step, r.train.max_steps, r.data.num_workers,
                                               pin_memory=d.device.type == "cuda"))
        try:
            while self.step < r.train.max_steps:
                if d.any(bool(self.stop_requested) or (self.out / STOP_FILE).exists()):
                    stopped = True
                    break
                lr = self.scheduler.get_last_lr()[0]
                loss = self.train_step()
                if not math.isfinite(loss):
                    raise TrainError(f"the training loss is {loss} at step {self.step}; lower optim.lr or enable "
                                     "optim.grad_clip (the last checkpoint is kept)")
                losses.append(loss)
                window_tokens += self.tokens_per_step
                if self.step % r.log.every == 0 or self.step == r.train.max_steps:
                    elapsed = time.perf_counter() - window_start
                    tps = window_tokens / max(elapsed, 1e-9)
                    self.log({"step": self.step, "loss": loss, "lr": lr, "tokens": self.step * self.tokens_per_step,
                              "tokens_per_s": tps})
                    window_tokens, window_start = 0, time.perf_counter()
                    if bar is not None:
                        bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tps:,.0f}")
                if r.log.eval_every and self.step % r.log.eval_every == 0 and self.step < r.train.max_steps:
                    self._log_eval()
                if self.step % r.log.save_every == 0 and self.step < r.train.max_steps:
                    self.save_checkpoint()
                if bar is not None:
                    bar.update(1)
            if stopped:
                self.save_checkpoint()
            else:
                eval_loss = self._log_eval()
                self.save_checkpoint()
        finally:
            self.batches = None  # ends the DataLoader's workers
            for s, h in handlers.items():
                signal.signal(s, h)
            if bar is not None:
                bar.close()
            if self.tb is not None:
                self.tb.close()
        final = None if stopped else self.save_final()
        reason = (self.stop_requested or "STOP") if stopped else None
        result = TrainResult(self.out, final, self.step, self.step * self.tokens_per_step,
                             time.perf_counter() - start_wall, eval_loss, losses, stopped, reason)
        if d.main:
            self._write_summary(result)
        return result

    def _write_summary(self, result: TrainResult) -> None:
        """run_summary.json: where the run stands, with the wall time of every invocation (resumes add one)."""
        path = self.out / "run_summary.json"
        previous = json.loads(path.read_text()).get("invocation_seconds", []) if path.exists() else []
        summary = {"steps": result.steps, "tokens": result.tokens, "eval_loss": result.eval_loss,
                   "finished": not result.stopped, "precision": "bf16" if self.bf16 else "fp32",
                   "invocation_seconds": previous + [round(result.seconds, 3)]}
        summary["seconds"] = round(sum(summary["invocation_seconds"]), 3)
        path.write_text(json.dumps(summary, indent=1))

    def _log_eval(self) -> float:
        loss = self.evaluate()
        self.log({"step": self.step, "eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0)),
                  "tokens": self.step * self.tokens_per_step})
        return loss


def _temp_dir(final: Path) -> Path:
    """Where ``final`` is written before it is swapped in (fixed: every rank writes its RNG state into it)."""
    return final.parent / f".{final.name}.tmp-train"


def checkpoint_problem(path: Path) -> str | None:
    """None when checkpoint ``path`` is complete and intact, else what is wrong with which file."""
    return state_io.check(path, required=("trainer_state.json", "optimizer.pt", "scheduler.pt"))


def _newest_complete(checkpoints: list[Path]) -> Path:
    """The newest checkpoint that passes :func:`checkpoint_problem`; a warning names each newer one skipped."""
    skipped = []
    for path in reversed(checkpoints):
        problem = checkpoint_problem(path)
        if problem is None:
            for bad, why in skipped:
                warnings.warn(f"{bad} is incomplete or damaged ({why}); resuming from {path.name} instead",
                              stacklevel=2)
            return path
        skipped.append((path, problem))
    listed = "; ".join(f"{p.name}: {why}" for p, why in skipped)
    raise TrainError(f"--resume: no complete checkpoint in {checkpoints[-1].parent} ({listed}); start a new "
                     "output_dir")


def _read_trainer_state(path: Path) -> dict:
    file = path / "trainer_state.json"
    try:
        state = json.loads(file.read_text())
        int(state["step"])
        return state
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise StateError(f"{file} cannot be read ({type(err).__name__})") from None


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    weights = {}
    for file in sorted(path.glob("*.safetensors")):
        if file.name.startswith(("optimizer", "scheduler", "rng_state_")):
            continue
        try:
            weights.update(load_file(str(file)))
        except Exception as err:  # safetensors raises its own error type
            raise StateError(f"{file} cannot be read ({str(err).splitlines()[0][:200]})") from None
    return weights


def _brief(value) -> str:
    if isinstance(value, dict):
        return f"{len(value)} tensors"
    return repr(value)


def train(recipe: Recipe, resume: bool | str | None = None, progress: bool | None = None) -> TrainResult:
    """Run ``recipe`` (from scratch, from ``init_from``, or resumed: ``resume=True`` for the latest checkpoint or a
    checkpoint path). Works the same under torchrun (one call per process)."""
    threads = torch.get_num_threads()
    run = None
    try:
        run = _Run(recipe, resume, progress)
        run.setup()
        return run.run()
    except ConversionError as err:  # disk full or another write error while saving
        raise TrainError(str(err)) from None
    finally:
        if run is not None:
            run.release()
        torch.set_num_threads(threads)  # train.num_threads applies to this run only


__all__ = ["train", "TrainResult", "TrainError", "bf16_is_fast", "lr_factor", "select_trainable", "lm_loss",
           "distill_loss", "hidden_loss", "list_checkpoints", "build_model_and_tokenizer", "load_pretrained"]
