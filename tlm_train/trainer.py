"""``tlm train``: a plain PyTorch training loop for TLMs, on one process or under ``torchrun`` (DDP or FSDP).

One step = ``grad_accum`` micro-batches per process -> gradient clipping -> AdamW -> LR schedule (linear warmup,
then cosine / linear decay to ``min_lr``, constant, or warmup-stable-decay; tlm_train.build.lr_factor). The loss is the next-token cross entropy, optionally mixed
with a KL term towards a frozen teacher (distillation: tlm_train.losses). Under torchrun the processes split every
global batch (see tlm_train.data.BatchOrder), DDP averages the gradients, so N processes with batch B follow the
same trajectory as one process with batch N*B up to floating-point summation order.

This module is the loop; beside it: tlm_train.build (the student, teacher, trainable parameters, optimizer),
tlm_train.checkpoints (output_dir, checkpoints, resume checks), tlm_train.distributed (ranks, DDP/FSDP, full state
dicts), tlm_train.losses and tlm_train.metrics (metrics.jsonl, run_summary.json).

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

A caller may pass the student (and the teacher) as modules already in memory: ``train(recipe, model, teacher,
tokenizer=...)``. The run then starts from ``model`` (recipe.init_from's weights are not read; it stays in
recipe.yaml as the record of where the module came from, and its tokenizer files serve when no tokenizer is given)
and distils from ``teacher`` (recipe.distill.teacher is not read either). The caller takes the trained module back
(``TrainResult.model``, as every run returns it), so such a run writes no ``final/`` and no checkpoint at its end
beyond what ``log.save_every`` asks for; a stop (signal, STOP file) still writes one, and ``resume`` works as for
any run. The module is trained in place: it comes back on the run's device, in eval mode, with its KV-cache setting
and each parameter's requires_grad as it was given. A teacher passed in is frozen and moved to the run's device
in place (under bf16 autocast its projections are stored in bf16 when its outputs stay the same).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tlm import TLMForCausalLM
from tlm.slow import SlowLevels
from tlm_io.errors import ConversionError, TLMError, TrainError
from tlm_io.load import check_positions, check_token_ids
from tlm_io.perplexity import nll_sum
from tlm_io.text import text_prefix, to_blocks

from .budget import TRAINING, Budget, Limits, Phase
from .build import (bf16_is_fast, build_model_and_tokenizer, check_teacher, grown_neurons, load_pretrained, lr_factor,
                    make_optimizer, prepare_student, restore_student, scale_updates, schedule_factor,
                    select_trainable, student_and_tokenizer, wsd_decay_start)
from .checkpoints import (STOP_FILE, CheckpointStore, discard_new_folder, fingerprint, list_checkpoints,
                          lock_run_folder, resume_path, seed_everything)
from .data import CACHE_FIX, BatchOrder, TokenBlocks, check_cache_ids, micro_batch_loader, recipe_tokens
from .distributed import Dist, setup_distributed, unwrap, wrap
from .losses import Distillation, distill_loss, hidden_loss, lm_loss, next_token_loss
from .metrics import MetricsLog, write_summary
from .recipe import Recipe
from .teacher import store_for_autocast
from .teacher_cache import TeacherTopCache

logger = logging.getLogger(__name__)


@dataclass
class TrainResult:
    output_dir: Path
    final_dir: Path | None  # None when stopped, or when the caller passed the model (it takes it back instead)
    steps: int  # optimizer steps completed (including those before a resume)
    tokens: int  # training tokens seen
    seconds: float  # wall time of this invocation
    eval_loss: float | None  # held-out loss at the end (None when stopped early)
    losses: list[float] = field(default_factory=list)  # training loss of each step run by this invocation
    stopped: bool = False  # ended by a signal or the STOP file (a checkpoint was written)
    stop_reason: str | None = None  # "SIGINT", "SIGTERM" or "STOP" (the file) when stopped
    model: TLMForCausalLM | None = None  # the trained module (eval mode, on the run's device; sharded under FSDP)
    lr: float | None = None  # the schedule's peak rate: optim.lr, times the weights' RMS with optim.lr_relative


def training_blocks(tokenizer, recipe: Recipe, d: Dist, vocab: int) -> tuple[BatchOrder, torch.Tensor]:
    """(the order of the training blocks, the held-out blocks (n, seq_len)) of the recipe's data: data.eval, else
    the end of the training tokens (data.eval_tokens of them, at most a tenth). Rank 0 tokenizes (and fills the
    token cache) first; the other ranks then read the cache. A token id of ``vocab`` or more (beyond the model's
    embeddings) is refused before anything is written."""
    r = recipe
    if not d.main:
        d.barrier()
    ids, eval_ids = recipe_tokens(tokenizer, r.data)
    if d.main:
        d.barrier()
    train_stop = len(ids)
    if eval_ids is None:  # hold out the end of the training tokens
        hold = min(r.data.eval_tokens, len(ids) // 10)
        hold -= hold % r.data.seq_len
        train_stop = len(ids) - hold
        eval_ids = torch.from_numpy(ids.read(train_stop))
    prefix = text_prefix(tokenizer)  # every block begins as the tokenizer begins a text (Gemma: <bos>)
    train_blocks = TokenBlocks(ids, r.data.seq_len, stop=train_stop, prefix=prefix)
    eval_blocks = to_blocks(eval_ids[: r.data.eval_tokens], r.data.seq_len, prefix)
    check_cache_ids(ids, vocab, f"the token cache of data.train ({ids.folder})")
    check_token_ids(eval_ids, vocab, "the held-out tokens of data.eval" if r.data.eval else
                    f"the token cache of data.train ({ids.folder})", CACHE_FIX)
    global_batch = r.train.batch_size * r.train.grad_accum * d.world
    if len(train_blocks) < global_batch:
        raise TrainError(f"training data has {len(train_blocks)} blocks of data.seq_len {r.data.seq_len}, fewer "
                         f"than one global batch ({global_batch}); add text or lower the batch size / seq_len")
    if len(eval_blocks) < d.world:
        raise TrainError(f"{len(eval_blocks)} held-out blocks of data.seq_len {r.data.seq_len} tokens for "
                         f"{d.world} process(es); give data.eval, more text or a larger data.eval_tokens")
    order = BatchOrder(train_blocks, r.train.batch_size, r.train.grad_accum, d.world, r.seed, r.data.skip_batches)
    return order, eval_blocks


class _Run:
    """One invocation of :func:`train`: set-up, the step loop, evaluation, stopping."""

    def __init__(self, recipe: Recipe, resume: bool | str | None, progress: bool | None, given: dict):
        self.recipe, self.given = recipe, given  # given: the caller's model / teacher / tokenizer (or None)
        self.out = Path(recipe.output_dir)
        self.d = setup_distributed(recipe.train.device)
        self.created = not os.path.lexists(self.out)  # a failed start removes a folder it made (and left empty)
        precision = recipe.train.precision
        self.bf16 = precision == "bf16" or (precision == "auto" and bf16_is_fast(self.d.device))
        self.lock = lock_run_folder(self.out, self.d, getattr(recipe, "source", None))
        try:
            self.show_progress = recipe.log.progress if progress is None else progress
            self.stop_requested = False
            self.limits, self.phase = None, TRAINING
            self.refused = False  # by the time budget
            self.resume_from = resume_path(self.out, resume, recipe.train.max_steps)
        except BaseException:
            self.release()
            self.discard_new_folder()
            raise

    def discard_new_folder(self) -> None:
        """After a failed start: output_dir, when this run created it and it holds only the run's marker (or what
        the run wrote before its time budget refused it)."""
        if self.created and self.d.main:
            discard_new_folder(self.out, refused=self.refused)

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    # ---------------------------------------------------------------------------------------------- set-up

    def setup(self) -> None:
        r, d = self.recipe, self.d
        if r.train.num_threads:
            torch.set_num_threads(r.train.num_threads)
        seed_everything(r.seed)
        model, self.tokenizer = student_and_tokenizer(r, self.given["model"], self.given["tokenizer"])
        check_positions(model.config, r.data.seq_len, r.init_from or "model.config", option="data.seq_len")
        self.came = prepare_student(model, r.train, d.device)
        self.distillation = self._distillation(model)
        self.order, self.eval_blocks = training_blocks(self.tokenizer, r, d, model.config.vocab_size)
        self.tokens_per_step = self.order.global_batch * r.data.seq_len
        shapes = fingerprint(model, r, d.world)  # before FSDP shards the module
        self.model = wrap(model, r.train.parallel, d)
        self.optimizer, self.scheduler = make_optimizer(self.model, r, d.device)
        if r.optim.lr_relative:
            logger.info("optim.lr_relative: the rate is %g x the weights' RMS = %.3g", r.optim.lr,
                        self.scheduler.base_lrs[0])
        if r.optim.grown_lr_scale != 1:
            grown = grown_neurons(model, self.distillation.teacher.config.intermediate_sizes)
            scale_updates(self.optimizer, grown, r.optim.grown_lr_scale)
            logger.info("optim.grown_lr_scale %g: %d grown-neuron slices", r.optim.grown_lr_scale, len(grown))
        self.slow_levels = SlowLevels(self.model)
        self.checkpoints = CheckpointStore(self.out, r, d, self.model, self.optimizer, self.scheduler, model.config,
                                           self.tokenizer, self.order, shapes)
        self.step = 0 if self.resume_from is None else self.checkpoints.restore(self.resume_from)
        self.resumed_at = None if self.resume_from is None else self.step
        self.forward = self.model  # train.compile: its layers are compiled (prepare_student)

    def _distillation(self, model) -> Distillation | None:
        """The teacher side of the loss: the caller's teacher or recipe.distill.teacher, checked against the
        student and frozen on the run's device (with its top-k cache for distill.teacher_topk). Under bf16 autocast
        its projections are stored in bf16 when that leaves its outputs unchanged (a caller's teacher included)."""
        spec, teacher = self.recipe.distill, self.given["teacher"]
        if spec is None:
            if teacher is not None:
                raise TrainError("train(teacher=...): the recipe has no distill: section; add one (alpha, "
                                 "temperature) or pass no teacher")
            return None
        if teacher is None:
            teacher, _ = load_pretrained(spec.teacher, with_tokenizer=False)
        check_teacher(teacher, model.config, spec)
        teacher = teacher.to(self.d.device).eval().requires_grad_(False)
        if self.bf16 and self.d.device.type in ("cuda", "cpu"):  # it runs under _autocast() only: same outputs
            saved = store_for_autocast(teacher, torch.bfloat16, self.d.device)
            logger.info("teacher projections stored in bf16 (%d MB less, outputs checked unchanged)" % (saved >> 20)
                        if saved else "teacher kept as loaded (bf16 storage would change its outputs)")
        return Distillation(teacher, spec, TeacherTopCache() if spec.teacher_topk else None)

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
        for micro in range(accum):
            ids = next(self.batches).to(d.device, non_blocking=True)  # (B, S): this rank's micro-batch
            sync = micro == accum - 1 or d.world == 1 or r.train.parallel != "ddp"
            with (nullcontext() if sync else self.model.no_sync()), self._autocast():
                if self.distillation is None:
                    loss = next_token_loss(self.forward, unwrap(self.model), ids)
                else:
                    loss = self.distillation.loss(self.forward, unwrap(self.model), ids)
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
        total, count = d.all_sum([total, count])
        return total / count

    def log(self, record: dict) -> None:
        self.metrics.log(record)

    def _log_eval(self) -> float:
        loss = self.evaluate()
        self.log({"step": self.step, "eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0)),
                  "tokens": self.step * self.tokens_per_step})
        return loss

    def _on_signal(self, signum, frame) -> None:
        self.stop_requested = signal.Signals(signum).name

    # ---------------------------------------------------------------------------------------------- the run

    def run(self) -> TrainResult:
        r, d = self.recipe, self.d
        start_wall = time.perf_counter()
        if d.main:
            self.out.mkdir(parents=True, exist_ok=True)
            r.save(self.out / "recipe.yaml")
        d.barrier()
        self.metrics = MetricsLog(self.out, self.step, d.main, r.log.tensorboard)
        handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        bar = None
        if d.main and self.show_progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=r.train.max_steps, initial=self.step, desc=self.phase.what, unit="step",
                       dynamic_ncols=True)
        self.batches = iter(micro_batch_loader(self.order, d.rank, self.step, r.train.max_steps, r.data.num_workers,
                                               pin_memory=d.device.type == "cuda"))
        try:
            losses, stopped = self._steps(bar)
            eval_loss = None if stopped else self._log_eval()
            saved = self.step == self.resumed_at  # no step since the checkpoint it resumed from: written already
            if (stopped or self.given["model"] is None or self.step % r.log.save_every == 0) and not saved:
                self.checkpoints.save(self.step)
        finally:
            self.batches = None  # ends the DataLoader's workers
            for s, h in handlers.items():
                signal.signal(s, h)
            if bar is not None:
                bar.close()
            self.metrics.close()
        final = None if stopped or self.given["model"] is not None else self.checkpoints.save_final()
        core = unwrap(self.model)
        restore_student(core, self.came)
        result = TrainResult(self.out, final, self.step, self.step * self.tokens_per_step,
                             time.perf_counter() - start_wall, eval_loss, losses, stopped,
                             (self.stop_requested or "STOP") if stopped else None, core, self.scheduler.base_lrs[0])
        if d.main:
            write_summary(self.out, result.steps, result.tokens, result.eval_loss, not result.stopped,
                          "bf16" if self.bf16 else "fp32", result.seconds)
        return result

    def _budget(self) -> Budget | None:
        """The run's time budget (tlm_train.budget) over the steps left, or None without ``limits``. Under torchrun
        every rank judges at the same step (no minimum of seconds) the slowest rank's estimate."""
        if self.limits is None:
            return None
        left = self.recipe.train.max_steps - self.step
        many = self.d.world > 1
        return self.limits.budget(self.phase.what, left, self.phase.unit, self.phase.fix,
                                  min_seconds=0.0 if many else 1.0, agree=self.d.all_max if many else None)

    def _steps(self, bar) -> tuple[list[float], bool]:
        """Steps up to train.max_steps, logging, evaluating and checkpointing as the recipe says; (each step's loss,
        whether a signal or the STOP file ended the run first)."""
        r, d = self.recipe, self.d
        losses = []
        window_tokens, window_start = 0, time.perf_counter()
        first, budget = self.step, self._budget()
        while self.step < r.train.max_steps:
            if d.any(bool(self.stop_requested) or (self.out / STOP_FILE).exists()):
                return losses, True
            lr = self.scheduler.get_last_lr()[0]
            loss = self.train_step()
            if budget is not None:
                try:
                    budget.update(self.step - first)
                except TLMError:
                    self.refused = True
                    raise
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
                self.checkpoints.save(self.step)
            if bar is not None:
                bar.update(1)
        return losses, False


def train(recipe: Recipe, model: TLMForCausalLM | None = None, teacher: TLMForCausalLM | None = None, *,
          tokenizer=None, resume: bool | str | None = None, progress: bool | None = None,
          limits: Limits | None = None, phase: Phase = TRAINING) -> TrainResult:
    """Run ``recipe`` (from scratch, from ``init_from``, or resumed: ``resume=True`` for the latest checkpoint or a
    checkpoint path). Works the same under torchrun (one call per process).

    ``model``: the student, a TLMForCausalLM already in memory, trained in place and returned in the result (no
    ``final/`` is written; ``tokenizer`` reads the data, else the recipe's: tokenizer:, or init_from's tokenizer
    files); ``teacher``: the distillation teacher in memory instead of recipe.distill.teacher (see the module
    doc). ``limits``: a tlm_train.budget.Limits: the run's time, measured on its first steps, is said aloud
    through ``limits.on_note`` and refused above ``limits.max_hours`` (``limits.error``; no checkpoint is kept),
    in the words of ``phase`` (default: "training: N steps ...; lower train.max_steps")."""
    threads = torch.get_num_threads()
    run, ok = None, False
    try:
        run = _Run(recipe, resume, progress, {"model": model, "teacher": teacher, "tokenizer": tokenizer})
        run.limits, run.phase = limits, phase
        run.setup()
        result = run.run()
        ok = True
        return result
    except ConversionError as err:  # disk full or another write error while saving
        raise TrainError(str(err)) from None
    finally:
        if run is not None:
            run.release()
            if not ok:
                run.discard_new_folder()
        torch.set_num_threads(threads)  # train.num_threads applies to this run only


__all__ = ["train", "TrainResult", "TrainError", "STOP_FILE", "training_blocks", "bf16_is_fast", "lr_factor",
           "schedule_factor", "wsd_decay_start", "select_trainable", "lm_loss", "next_token_loss", "distill_loss",
           "hidden_loss", "list_checkpoints", "build_model_and_tokenizer", "load_pretrained"]
